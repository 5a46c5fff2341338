"""metal/attention_prefill.metal: every case of lily.kernel_cases.attention_prefill (both kernels at first and
continuing chunks, partial query and key tiles, the mma kernels around their key-tile width, head dims 256 and 64,
the unpacked instances at head ratios 3 and 1 (and 4 for the mma kernel at 256), and the simdgroup layout probe), then
what the cases do not cover: the cases' copy of lily.h's mma shape constants, the bits independent of the fiber
schedule, and attention_prep chained with the prefill and decode kernels on one cache, as a layer runs them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cases import check, op_cases
from test_attention import CACHE_DTYPE, D, assert_close, attention_args
from test_attention import SINGLE as DECODE
from test_attention import VARIANTS as DECODE_VARIANTS

from lily import reference
from lily._ext import msl
from lily.kernel_cases.attention_prefill import (MMA_HEADS_PER_GROUP, MMA_QUERIES, MMA_TILE_BYTES, MMA_TILE_KEYS,
                                                 ROUNDING_UNIT, mma_tile_keys)
from lily.kernel_cases.common import TOLERANCES, compare_values
from lily.kernel_cases.attention_prep import attention_prep_args as prep_args

PREP = {"f32": "attention_prep_f32_d256", "bf16": "attention_prep_bf16_d256"}
PREP_D64 = {"f32": "attention_prep_f32_d64", "bf16": "attention_prep_bf16_d64"}
HEADS_PER_GROUP = 4  # LILY_ATTN_HEADS_PER_GROUP
HEADS_PER_GROUP_D64 = 2  # LILY_ATTN_HEADS_PER_GROUP_D64
DTYPES = ["f32", "bf16"]
KERNELS = {"f32": "attention_prefill_f32_d256", "bf16": "attention_prefill_bf16_d256"}
MMA = {"f32": "attention_prefill_mma_f32_d256", "bf16": "attention_prefill_mma_bf16_d256"}
KERNELS_D64 = {"f32": "attention_prefill_f32_d64", "bf16": "attention_prefill_bf16_d64"}
MMA_D64 = {"f32": "attention_prefill_mma_f32_d64", "bf16": "attention_prefill_mma_bf16_d64"}


@pytest.mark.parametrize("case", op_cases("attention_prefill"))
def test_attention_prefill(case, kernel_device) -> None:
    check(case, kernel_device)


def test_mma_shapes_mirror_lily_h() -> None:
    """The cases' copy of the mma kernel's shape constants (tile keys and bytes, queries and heads per threadgroup) is
    metal/lily.h's, so the cases straddle the kernel's real tile width: 32 keys in bf16, 16 in f32 at head dim 256."""
    header = (Path(__file__).resolve().parents[2] / "metal" / "lily.h").read_text()
    constants = {"TILE_KEYS": MMA_TILE_KEYS, "TILE_BYTES": MMA_TILE_BYTES, "QUERIES": MMA_QUERIES,
                 "HEADS_PER_GROUP": MMA_HEADS_PER_GROUP[256], "HEADS_PER_GROUP_D64": MMA_HEADS_PER_GROUP[64]}
    for name, value in constants.items():
        assert f"#define LILY_ATTN_MMA_{name} {value}\n" in header, name
    tile_keys = {(d, c): mma_tile_keys(d, c) for d in (256, 64) for c in ("bf16", "f32")}
    assert tile_keys == {(256, "bf16"): 32, (256, "f32"): 16, (64, "bf16"): 32, (64, "f32"): 32}


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
    for the next token, all on one cache; against the reference chain on the same rounded inputs. Head dim 256 runs
    the model's 16/2 heads (the mma kernel packs all 8 of a KV head, the others 4); head dim 64 the demo model's
    layout (4/2 heads, rotary 16, 2 heads per threadgroup)."""
    rng = np.random.default_rng(31 + DTYPES.index(dtype) + head_dim)
    heads, kv_heads, chunk, capacity, rotary_dim, theta, eps = 16, 2, 9, 16, 64, 1e7, 1e-6
    prep, prefill, mma, decode, per_group = PREP[dtype], KERNELS[dtype], MMA[dtype], DECODE[dtype], HEADS_PER_GROUP
    if head_dim == 64:
        heads, rotary_dim, per_group = 4, 16, HEADS_PER_GROUP_D64
        prep, prefill, mma = PREP_D64[dtype], KERNELS_D64[dtype], MMA_D64[dtype]
        decode = DECODE_VARIANTS[(64, 2)][dtype][0]
    mma_per_group = MMA_HEADS_PER_GROUP[head_dim]
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
        # The mma kernel rounds the probabilities to a 16-bit cache dtype for P·V (kernel_cases.attention_prefill).
        magnitude = np.abs(reference.attention(kio.round(ref_q, dtype), np.concatenate(ref_keys),
                                               np.abs(np.concatenate(ref_values)), ref_gate, offset=position))
        args = attention_args(tokens, heads, kv_heads, keys, capacity, scale=head_dim**-0.5)
        if tokens > 1:
            for kernel, packed in ((prefill, per_group), (mma, mma_per_group)):
                out = kio.poisoned((tokens, heads, head_dim), dtype)
                threads = 256 if kernel == prefill else 32 * packed
                msl.dispatch(kernel, [args, q_out, gate_out, k_cache, v_cache, out], (2, heads // packed, 1),
                             (threads, 1, 1))
                if kernel == mma and cache_dtype != "f32":
                    result = compare_values(f"prep + {kernel}", kio.to_f64(out, dtype), expected, TOLERANCES[dtype],
                                            ROUNDING_UNIT[cache_dtype] * magnitude)
                    assert result.passed, f"{result.what}: {result.detail} (tolerance {result.tolerance})"
                    continue
                assert_close(kio, kio.to_f64(out, dtype), expected, dtype, f"prep + {kernel}", widen=3.0)
            continue
        out = kio.poisoned((heads, head_dim), dtype)
        msl.dispatch(decode, [args, q_out[0], gate_out[0], k_cache, v_cache, out], (heads // per_group, 1, 1),
                     (128, 1, 1))
        assert_close(kio, kio.to_f64(out, dtype), expected[0], dtype, f"prep + decode {dtype}", widen=3.0)
