"""metal/attention_prefill.metal through the CPU harness, against lily.reference.attention.

A chunk of T queries over a KV cache [Hkv, capacity, D] (D = 256) that holds `offset` keys of earlier chunks and the
chunk's own T keys; query t sits at position offset + t (causal). attention_prefill (vector ALUs): a first chunk of
31/32/33 queries (query tiles of 8 with a partial last one), chunks continuing a cache (offsets 17 and 40: key tiles
of 16 in bf16 and 8 in f32, partial tiles, tiles only some queries see), the model's GQA 8 (two threadgroups per KV
head), 1, 3 and 8 simdgroups per threadgroup. attention_prefill_mma (8x8 simdgroup matrices): chunks of 3, 7, 8, 9,
12, 16 and 33 queries (partial 8-query tiles), offsets 0, 5, 21 and 40 (partial 8-key tiles). Outputs start
NaN-poisoned and the cache's spare rows hold NaN, so a key read past the causal limit is caught. The last test chains
attention_prep with the attention kernels, as a layer runs them. The head-dim-64 instances (2 heads per threadgroup;
the demo model's 4/2 heads and the gqa4 fixture's 8/2) run both kernels on first and continuing chunks, and the
prep + prefill + decode chain. The *_unpacked_* instances (one head per threadgroup, the engine's fallback for head
ratios the packing cannot split) run head ratios 3 and 1 at both head dims.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, op_cases
from test_attention import CACHE_DTYPE, D, assert_close, attention_args
from test_attention import SINGLE as DECODE
from test_attention import VARIANTS as DECODE_VARIANTS

from lily import reference
from lily._ext import msl
from lily.kernel_cases.attention_prep import attention_prep_args as prep_args

PREP = {"f32": "attention_prep_f32_d256", "bf16": "attention_prep_bf16_d256"}
PREP_D64 = {"f32": "attention_prep_f32_d64", "bf16": "attention_prep_bf16_d64"}

HEADS_PER_GROUP = 4  # LILY_ATTN_HEADS_PER_GROUP
DTYPES = ["f32", "bf16"]
KERNELS = {
    "f32": "attention_prefill_f32_d256",
    "bf16": "attention_prefill_bf16_d256",
}
MMA = {
    "f32": "attention_prefill_mma_f32_d256",
    "bf16": "attention_prefill_mma_bf16_d256",
}
MMA_QUERIES = 8  # query tokens per attention_prefill_mma threadgroup (one 8-row fragment)
# Head dim 64 (demo model, fixtures): 2 heads per threadgroup (LILY_ATTN_HEADS_PER_GROUP_D64).
HEADS_PER_GROUP_D64 = 2
KERNELS_D64 = {"f32": "attention_prefill_f32_d64", "bf16": "attention_prefill_bf16_d64"}
MMA_D64 = {"f32": "attention_prefill_mma_f32_d64", "bf16": "attention_prefill_mma_bf16_d64"}
# One head per threadgroup, for head ratios the packing cannot split: {(mma, head dim, dtype): kernel}.
UNPACKED = {
    (False, 256, "f32"): "attention_prefill_unpacked_f32_d256",
    (False, 256, "bf16"): "attention_prefill_unpacked_bf16_d256",
    (True, 256, "f32"): "attention_prefill_mma_unpacked_f32_d256",
    (True, 256, "bf16"): "attention_prefill_mma_unpacked_bf16_d256",
    (False, 64, "f32"): "attention_prefill_unpacked_f32_d64",
    (False, 64, "bf16"): "attention_prefill_unpacked_bf16_d64",
    (True, 64, "f32"): "attention_prefill_mma_unpacked_f32_d64",
    (True, 64, "bf16"): "attention_prefill_mma_unpacked_bf16_d64",
}


def run_prefill(kio, dtype: str, rng: np.random.Generator, heads: int, kv_heads: int, queries: int, offset: int,
                simdgroups: int, mma: bool = False, head_dim: int = D, packed: bool = True):
    """Dispatch attention_prefill (or attention_prefill_mma, which takes one simdgroup per packed head and 8 queries
    per threadgroup), the instance for `head_dim` (packed, or the *_unpacked_* one with one head per threadgroup), on
    fresh random inputs; return (out, expected) as float64."""
    per_head_group = HEADS_PER_GROUP if head_dim == D else HEADS_PER_GROUP_D64
    if head_dim == D:
        kernel = (MMA if mma else KERNELS)[dtype]
    else:
        kernel = (MMA_D64 if mma else KERNELS_D64)[dtype]
    if not packed:
        per_head_group = 1
        kernel = UNPACKED[(mma, head_dim, dtype)]
    keys = offset + queries
    capacity = keys + 4
    q = kio.to_device(rng.standard_normal((queries, heads, head_dim)) * 2.0, dtype)
    gate = kio.to_device(rng.standard_normal((queries, heads, head_dim)) * 2.0, dtype)
    cache_dtype = CACHE_DTYPE[dtype]
    k_cache = kio.poisoned((kv_heads, capacity, head_dim), cache_dtype)
    v_cache = kio.poisoned((kv_heads, capacity, head_dim), cache_dtype)
    k_cache[:, :keys] = kio.to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
    v_cache[:, :keys] = kio.to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
    out = kio.poisoned((queries, heads, head_dim), dtype)
    per_group = MMA_QUERIES if mma else simdgroups
    msl.dispatch(
        kernel,
        [attention_args(queries, heads, kv_heads, keys, capacity, scale=head_dim**-0.5), q, gate, k_cache, v_cache,
         out],
        (-(-queries // per_group), heads // per_head_group, 1),
        (32 * (per_head_group if mma else simdgroups), 1, 1),
    )
    k = kio.to_f64(k_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    v = kio.to_f64(v_cache, cache_dtype)[:, :keys].transpose(1, 0, 2)
    expected = reference.attention(kio.to_f64(q, dtype), k, v, kio.to_f64(gate, dtype), offset=offset)
    return kio.to_f64(out, dtype), kio.round(expected, dtype)


CASES = [
    # (heads, kv_heads, queries, offset, simdgroups)
    (8, 2, 31, 0, 8),
    (8, 2, 32, 0, 8),
    (8, 2, 33, 0, 8),  # a last query tile of one query
    (8, 2, 5, 17, 3),  # a short chunk after an earlier one; key tiles end mid-chunk
    (16, 2, 12, 40, 8),  # the model's GQA 8; offset 40 is not a multiple of either tile size
    (4, 1, 3, 0, 1),  # one simdgroup per threadgroup
    (8, 2, 1, 9, 8),  # a one-token chunk: seven spare simdgroups only load and meet barriers
]


@pytest.mark.parametrize("heads,kv_heads,queries,offset,simdgroups", CASES,
                         ids=[f"h{c[0]}x{c[1]}-T{c[2]}-off{c[3]}-sg{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill(dtype: str, heads: int, kv_heads: int, queries: int, offset: int, simdgroups: int,
                           kio) -> None:
    rng = np.random.default_rng(1000 * queries + 10 * offset + simdgroups + DTYPES.index(dtype))
    out, expected = run_prefill(kio, dtype, rng, heads, kv_heads, queries, offset, simdgroups)
    what = f"attention_prefill {dtype} T={queries} offset={offset} h={heads}x{kv_heads}"
    assert_close(kio, out, expected, dtype, what)


MMA_CASES = [
    # (heads, kv_heads, queries, offset)
    (8, 2, 7, 0),  # one partial query tile
    (8, 2, 8, 0),
    (8, 2, 9, 0),  # a last query tile of one query
    (8, 2, 33, 0),
    (16, 2, 12, 21),  # the model's GQA 8; offset 21 leaves partial key tiles on both sides of the chunk
    (4, 1, 16, 40),
    (8, 2, 3, 5),  # a chunk shorter than the fragment continuing a cache
]


@pytest.mark.parametrize("heads,kv_heads,queries,offset", MMA_CASES,
                         ids=[f"h{c[0]}x{c[1]}-T{c[2]}-off{c[3]}" for c in MMA_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_mma(dtype: str, heads: int, kv_heads: int, queries: int, offset: int, kio) -> None:
    rng = np.random.default_rng(3000 * queries + 10 * offset + heads + DTYPES.index(dtype))
    out, expected = run_prefill(kio, dtype, rng, heads, kv_heads, queries, offset, HEADS_PER_GROUP, mma=True)
    assert_close(kio, out, expected, dtype, f"attention_prefill_mma {dtype} T={queries} offset={offset}")


D64_CASES = [
    # (heads, kv_heads, queries, offset, simdgroups)
    (4, 2, 33, 0, 8),  # the demo model's heads (GQA 2): one threadgroup per KV head; a last query tile of one
    (4, 2, 5, 40, 3),  # continuing a cache: the f32 key tile of 32 ends before the chunk (bf16 tiles hold 64)
    (8, 2, 7, 17, 8),  # the gqa4 fixture: two threadgroups per KV head
    (2, 1, 2, 0, 1),
]


@pytest.mark.parametrize("heads,kv_heads,queries,offset,simdgroups", D64_CASES,
                         ids=[f"h{c[0]}x{c[1]}-T{c[2]}-off{c[3]}-sg{c[4]}" for c in D64_CASES])
@pytest.mark.parametrize("dtype", list(KERNELS_D64))
def test_attention_prefill_d64(dtype: str, heads: int, kv_heads: int, queries: int, offset: int, simdgroups: int,
                               kio) -> None:
    rng = np.random.default_rng(6000 + 1000 * queries + 10 * offset + simdgroups + DTYPES.index(dtype))
    out, expected = run_prefill(kio, dtype, rng, heads, kv_heads, queries, offset, simdgroups, head_dim=64)
    assert_close(kio, out, expected, dtype, f"attention_prefill d64 {dtype} T={queries} offset={offset} h={heads}")


D64_MMA_CASES = [
    # (heads, kv_heads, queries, offset)
    (4, 2, 7, 0),  # one partial query tile
    (4, 2, 9, 21),  # a last query tile of one query; partial key tiles on both sides of the chunk
    (8, 2, 16, 5),  # the gqa4 fixture's heads
    (2, 1, 33, 0),
]


@pytest.mark.parametrize("heads,kv_heads,queries,offset", D64_MMA_CASES,
                         ids=[f"h{c[0]}x{c[1]}-T{c[2]}-off{c[3]}" for c in D64_MMA_CASES])
@pytest.mark.parametrize("dtype", list(MMA_D64))
def test_attention_prefill_mma_d64(dtype: str, heads: int, kv_heads: int, queries: int, offset: int, kio) -> None:
    rng = np.random.default_rng(8000 + 1000 * queries + 10 * offset + heads + DTYPES.index(dtype))
    out, expected = run_prefill(kio, dtype, rng, heads, kv_heads, queries, offset, 0, mma=True, head_dim=64)
    assert_close(kio, out, expected, dtype, f"attention_prefill_mma d64 {dtype} T={queries} offset={offset}")


UNPACKED_CASES = [
    # (heads, kv_heads, queries, offset, simdgroups): head ratios 3 and 1, which no packed group of 2 or 4 splits
    (6, 2, 9, 0, 4),  # ratio 3; a last query tile of one query
    (6, 2, 5, 17, 3),  # ratio 3 continuing a cache
    (3, 3, 12, 5, 8),  # ratio 1
    (2, 2, 2, 0, 1),
]


@pytest.mark.parametrize("heads,kv_heads,queries,offset,simdgroups", UNPACKED_CASES,
                         ids=[f"h{c[0]}x{c[1]}-T{c[2]}-off{c[3]}-sg{c[4]}" for c in UNPACKED_CASES])
@pytest.mark.parametrize("mma", [False, True], ids=["vector", "mma"])
@pytest.mark.parametrize("head_dim", [64, D])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_prefill_unpacked(dtype: str, head_dim: int, mma: bool, heads: int, kv_heads: int, queries: int,
                                    offset: int, simdgroups: int, kio) -> None:
    rng = np.random.default_rng(9000 + 1000 * queries + 10 * offset + heads + head_dim + mma)
    out, expected = run_prefill(kio, dtype, rng, heads, kv_heads, queries, offset, simdgroups, mma=mma,
                                head_dim=head_dim, packed=False)
    what = f"{UNPACKED[(mma, head_dim, dtype)]} T={queries} offset={offset} h={heads}x{kv_heads}"
    assert_close(kio, out, expected, dtype, what)


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_prefill_independent_of_schedule(seed: int, kio) -> None:
    """Each query's sums run in one fixed order: FIFO and random schedules give the same bits."""
    results = []
    for random_schedule in (False, True):
        rng = np.random.default_rng(5)
        queries, offset, keys = 9, 7, 16
        q = rng.standard_normal((queries, 8, D)).astype(np.float32)
        gate = rng.standard_normal((queries, 8, D)).astype(np.float32)
        k_cache = rng.standard_normal((2, keys, D)).astype(np.float32)
        v_cache = rng.standard_normal((2, keys, D)).astype(np.float32)
        out = kio.poisoned((queries, 8, D), "f32")
        msl.dispatch("attention_prefill_f32_d256", [attention_args(queries, 8, 2, keys, keys), q, gate, k_cache,
                     v_cache, out], (3, 2, 1), (128, 1, 1), random_schedule=random_schedule, seed=seed)
        results.append(out)
    assert np.array_equal(results[0], results[1])
    expected = reference.attention(q, k_cache.transpose(1, 0, 2), v_cache.transpose(1, 0, 2), gate, offset=offset)
    assert_close(kio, results[1].astype(np.float64), expected.astype(np.float64), "f32", "schedule")


CHAIN_CASES = [(dt, D) for dt in DTYPES] + [("f32", 64), ("bf16", 64)]


@pytest.mark.parametrize("dtype,head_dim", CHAIN_CASES, ids=[f"{c[0]}-d{c[1]}" for c in CHAIN_CASES])
def test_prep_prefill_decode_chain(dtype: str, head_dim: int, kio) -> None:
    """A layer's attention as the engine runs it: prep + prefill (both kernels) for a 9-token chunk, then prep + decode
    for the next token, all on one cache; against the reference chain on the same rounded inputs. Head dim 64 runs
    the demo model's layout (4/2 heads, rotary 16, 2 heads per threadgroup)."""
    rng = np.random.default_rng(31 + DTYPES.index(dtype) + head_dim)
    heads, kv_heads, chunk, capacity, rotary_dim, theta, eps = 8, 2, 9, 16, 64, 1e7, 1e-6
    prep, prefill, mma, decode, per_group = PREP[dtype], KERNELS[dtype], MMA[dtype], DECODE[dtype], HEADS_PER_GROUP
    if head_dim == 64:
        heads, rotary_dim, per_group = 4, 16, HEADS_PER_GROUP_D64
        prep, prefill, mma = PREP_D64[dtype], KERNELS_D64[dtype], MMA_D64[dtype]
        decode = DECODE_VARIANTS[(64, 2)][dtype][0]
    q_norm = kio.to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    k_norm = kio.to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    cache_dtype = CACHE_DTYPE[dtype]
    k_cache = kio.poisoned((kv_heads, capacity, head_dim), cache_dtype)
    v_cache = kio.poisoned((kv_heads, capacity, head_dim), cache_dtype)
    ref_keys, ref_values = [], []
    for tokens, position in ((chunk, 0), (1, chunk)):
        q_and_gate = kio.to_device(rng.standard_normal((tokens, heads, 2 * head_dim)) * 2.0, dtype)
        k = kio.to_device(rng.standard_normal((tokens, kv_heads, head_dim)) * 2.0, dtype)
        v = kio.to_device(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
        q_out = kio.poisoned((tokens, heads, head_dim), dtype)
        gate_out = kio.poisoned((tokens, heads, head_dim), dtype)
        rows = tokens * (heads + kv_heads)
        msl.dispatch(prep,
                     [prep_args(tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps), q_and_gate, k,
                      v, q_norm, k_norm, q_out, gate_out, k_cache, v_cache], (rows, 1, 1), (32, 1, 1))
        # Reference chain on the same stored inputs; the reference's K is rounded to the cache dtype as stored.
        ref_q, ref_gate, ref_k = reference.attention_prep(
            kio.to_f64(q_and_gate, dtype), kio.to_f64(k, dtype), kio.to_f64(q_norm, dtype), kio.to_f64(k_norm, dtype),
            np.arange(position, position + tokens), rotary_dim, theta, eps)
        ref_keys.append(kio.round(ref_k, cache_dtype))
        ref_values.append(kio.round(kio.to_f64(v, dtype), cache_dtype))
        keys = position + tokens
        expected = kio.round(reference.attention(kio.round(ref_q, dtype), np.concatenate(ref_keys),
                                                 np.concatenate(ref_values), ref_gate, offset=position), dtype)
        args = attention_args(tokens, heads, kv_heads, keys, capacity, scale=head_dim**-0.5)
        if tokens > 1:
            for kernel, grid, threads in ((prefill, 2, 256), (mma, 2, 32 * per_group)):
                out = kio.poisoned((tokens, heads, head_dim), dtype)
                msl.dispatch(kernel, [args, q_out, gate_out, k_cache, v_cache, out], (grid, heads // per_group, 1),
                             (threads, 1, 1))
                assert_close(kio, kio.to_f64(out, dtype), expected, dtype, f"prep + {kernel}", widen=3.0)
            continue
        out = kio.poisoned((heads, head_dim), dtype)
        msl.dispatch(decode, [args, q_out[0], gate_out[0], k_cache, v_cache, out], (heads // per_group, 1, 1),
                     (128, 1, 1))
        assert_close(kio, kio.to_f64(out, dtype), expected[0], dtype, f"prep + decode {dtype}", widen=3.0)


def test_simdgroup_layout_probe_reports_the_layout_the_mma_kernel_assumes() -> None:
    """The engine trusts attention_prefill_mma only where this probe matches (src/lily_ext/layout_probe.cpp); here
    the harness emulates MLX's layout, so it must match exactly, and every lane must write both elements."""
    from lily.kernel_cases.attention_prefill import assumed_simdgroup_layout

    out = np.full((32, 2), np.nan, np.float32)
    msl.dispatch("simdgroup_layout_probe", [out], (1, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(out, assumed_simdgroup_layout().astype(np.float32))
    assert sorted(out.ravel().astype(int)) == list(range(64)), "each element of the 8x8 matrix held by one lane"


@pytest.mark.parametrize("case", op_cases("attention_prefill"))
def test_attention_prefill_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.attention_prefill: the self-test's, on this session's device."""
    check(case, kernel_device)
