"""metal/attention.metal (decode attention) through the CPU harness, against lily.reference.attention.

One query token over a KV cache [Hkv, capacity, D] with D = 256 (the model's head dim). The single-pass
kernel runs at contexts 1, 31, 32, 33, 100 and 300 with 1, 3, 4, 8 and 32 simdgroups (simdgroups that see no key),
with GQA groups of 4 (one threadgroup per KV head) and 8 (the model's: two threadgroups per KV head). The split-KV
pair (attention_decode_partial + attention_decode_combine) runs with small blocks at contexts around block boundaries
and with the model's block of 1024 at 1025 keys; its partials are also checked against a numpy per-block softmax.
Outputs and partials start NaN-poisoned; the cache has spare rows past the context holding NaN, so reading a key
past the context is caught. The head-dim-64 instances (2 heads per threadgroup; demo model: 4/2 heads, fixtures 8/2)
and the unpacked instances of the GQA-packing ablation (1 head per threadgroup; d256 and d64) run the same single-pass
and split-KV checks on their own cases, including GQA groups of 2 and 1 head per KV head. The plain-mapping instances
of the coalesced-KV ablation (packed heads, d256 and d64) run single-pass and split-KV checks against the reference
and against the coalesced kernels.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily._ext import msl

D = 256
SCALE = D**-0.5
HEADS_PER_GROUP = 4  # LILY_ATTN_HEADS_PER_GROUP
DTYPES = ["f32", "bf16"]
# The KV cache dtype of each activation dtype: f32 in float32 mode, bf16 otherwise.
CACHE_DTYPE = {"f32": "f32", "bf16": "bf16"}
SINGLE = {"f32": "attention_decode_f32_d256", "bf16": "attention_decode_bf16_d256", "f16": "attention_decode_f16_d256"}
PARTIAL = {
    "f32": "attention_decode_partial_f32_d256",
    "bf16": "attention_decode_partial_bf16_d256",
}
COMBINE = {
    "f32": "attention_decode_combine_f32_d256",
    "bf16": "attention_decode_combine_bf16_d256",
}
# Other instances: (head dim, heads per threadgroup) -> {dtype: (single-pass, partial, combine)}.
VARIANTS = {
    (64, 2): {
        "f32": ("attention_decode_f32_d64", "attention_decode_partial_f32_d64", "attention_decode_combine_f32_d64"),
        "bf16": ("attention_decode_bf16_d64", "attention_decode_partial_bf16_d64", "attention_decode_combine_bf16_d64"),
    },
    (256, 1): {
        "f32": ("attention_decode_unpacked_f32_d256", "attention_decode_partial_unpacked_f32_d256",
                "attention_decode_combine_f32_d256"),
        "bf16": ("attention_decode_unpacked_bf16_d256", "attention_decode_partial_unpacked_bf16_d256",
                 "attention_decode_combine_bf16_d256"),
    },
    (64, 1): {
        "f32": ("attention_decode_unpacked_f32_d64", "attention_decode_partial_unpacked_f32_d64",
                "attention_decode_combine_f32_d64"),
        "bf16": ("attention_decode_unpacked_bf16_d64", "attention_decode_partial_unpacked_bf16_d64",
                 "attention_decode_combine_bf16_d64"),
    },
}
# fp32 outputs: the kernel's fp32 dot products, exps and sums over up to 100 keys against an fp64 reference.
F32_SUMS = {"rtol": 2e-5, "atol": 2e-6, "rel_rms": 5e-6}


def attention_args(queries: int, heads: int, kv_heads: int, keys: int, capacity: int, block_size: int = 0,
                   num_blocks: int = 0, scale: float = SCALE) -> bytes:
    """lily::AttentionArgs (metal/lily.h)."""
    return struct.pack("<IIIIIIIf", queries, heads, kv_heads, keys, capacity, block_size, num_blocks, scale)


def assert_close(kio, actual: np.ndarray, expected: np.ndarray, dtype: str, what: str, widen: float = 1.0) -> None:
    """kio.assert_close, with the fp32 bound widened for sums over many keys (and by `widen` on request)."""
    if dtype != "f32":
        kio.assert_close(actual, expected, dtype, what)
        return
    assert not np.isnan(actual).any(), f"{what}: NaN in output"
    err = np.abs(actual - expected)
    rel_rms = np.sqrt(np.mean(err**2) / np.mean(expected**2))
    assert rel_rms <= widen * F32_SUMS["rel_rms"], f"{what}: relative RMS error {rel_rms:.3g}"
    limit = widen * (F32_SUMS["atol"] + F32_SUMS["rtol"] * np.abs(expected))
    assert (err <= limit).all(), f"{what}: max abs error {err.max():.3g}"


class DecodeInputs:
    """Random q, gate and KV cache for one decode step; the cache's spare rows hold NaN."""

    def __init__(self, kio, dtype: str, rng: np.random.Generator, heads: int, kv_heads: int, keys: int,
                 query_scale: float = 2.0, head_dim: int = D):
        self.dtype, self.heads, self.kv_heads, self.keys = dtype, heads, kv_heads, keys
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.capacity = keys + 3
        self.q = kio.to_device(rng.standard_normal((heads, head_dim)) * query_scale, dtype)
        self.gate = kio.to_device(rng.standard_normal((heads, head_dim)) * 2.0, dtype)
        cache_dtype = self.cache_dtype = CACHE_DTYPE[dtype]
        self.k_cache = kio.poisoned((kv_heads, self.capacity, head_dim), cache_dtype)
        self.v_cache = kio.poisoned((kv_heads, self.capacity, head_dim), cache_dtype)
        self.k_cache[:, :keys] = kio.to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
        self.v_cache[:, :keys] = kio.to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
        self.kio = kio

    def f64(self, name: str) -> np.ndarray:
        return self.kio.to_f64(getattr(self, name), self.cache_dtype if "cache" in name else self.dtype)

    def expected(self) -> np.ndarray:
        """reference.attention on the stored (rounded) values: [Hq, D]."""
        k = self.f64("k_cache")[:, : self.keys].transpose(1, 0, 2)  # [S, Hkv, D]
        v = self.f64("v_cache")[:, : self.keys].transpose(1, 0, 2)
        out = reference.attention(self.f64("q")[None], k, v, self.f64("gate")[None], offset=self.keys - 1)
        return self.kio.round(out[0], self.dtype)


def run_single(inputs: DecodeInputs, simdgroups: int, kernel: str | None = None,
               heads_per_group: int = HEADS_PER_GROUP) -> np.ndarray:
    """The single-pass kernel (default: the d256 one of the inputs' dtype), one threadgroup per heads_per_group."""
    out = inputs.kio.poisoned((inputs.heads, inputs.head_dim), inputs.dtype)
    msl.dispatch(
        kernel or SINGLE[inputs.dtype],
        [attention_args(1, inputs.heads, inputs.kv_heads, inputs.keys, inputs.capacity, scale=inputs.scale),
         inputs.q, inputs.gate, inputs.k_cache, inputs.v_cache, out],
        (inputs.heads // heads_per_group, 1, 1),
        (32 * simdgroups, 1, 1),
    )
    return inputs.kio.to_f64(out, inputs.dtype)


def run_split(inputs: DecodeInputs, block_size: int, simdgroups: int, combine_threads: int,
              kernels: tuple[str, str] | None = None, heads_per_group: int = HEADS_PER_GROUP):
    """The split-KV pair (default: the d256 kernels of the inputs' dtype): partials, stats and the output."""
    partial_kernel, combine_kernel = kernels or (PARTIAL[inputs.dtype], COMBINE[inputs.dtype])
    num_blocks = -(-inputs.keys // block_size)
    args = attention_args(1, inputs.heads, inputs.kv_heads, inputs.keys, inputs.capacity, block_size, num_blocks,
                          inputs.scale)
    partial_out = np.full((inputs.heads, num_blocks, inputs.head_dim), np.nan, np.float32)
    partial_stats = np.full((inputs.heads, num_blocks, 2), np.nan, np.float32)
    msl.dispatch(
        partial_kernel,
        [args, inputs.q, inputs.k_cache, inputs.v_cache, partial_out, partial_stats],
        (inputs.heads // heads_per_group, num_blocks, 1),
        (32 * simdgroups, 1, 1),
    )
    out = inputs.kio.poisoned((inputs.heads, inputs.head_dim), inputs.dtype)
    msl.dispatch(
        combine_kernel,
        [args, inputs.gate, partial_out, partial_stats, out],
        (inputs.heads, 1, 1),
        (combine_threads, 1, 1),
    )
    return partial_out, partial_stats, inputs.kio.to_f64(out, inputs.dtype)


def block_partials(inputs: DecodeInputs, block_size: int):
    """Per block: the softmax-normalised output, the max score and the sum of exp(score - max), in fp64."""
    group = inputs.heads // inputs.kv_heads
    q, k, v = inputs.f64("q"), inputs.f64("k_cache"), inputs.f64("v_cache")
    outs, stats = [], []
    for begin in range(0, inputs.keys, block_size):
        end = min(begin + block_size, inputs.keys)
        kh = k[np.arange(inputs.heads) // group, begin:end]  # [Hq, n, D]
        vh = v[np.arange(inputs.heads) // group, begin:end]
        scores = np.einsum("hd,hnd->hn", q, kh) * inputs.scale
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        outs.append(np.einsum("hn,hnd->hd", weights / weights.sum(axis=1, keepdims=True), vh))
        stats.append(np.stack([top[:, 0], weights.sum(axis=1)], axis=-1))
    return np.stack(outs, axis=1), np.stack(stats, axis=1)


SINGLE_CASES = [
    # (heads, kv_heads, keys, simdgroups)
    (8, 2, 1, 4),  # first token: three simdgroups see no key
    (8, 2, 31, 4),
    (8, 2, 32, 4),
    (8, 2, 33, 4),
    (16, 2, 33, 3),  # the model's GQA 8: two threadgroups per KV head; keys not a multiple of the simdgroups
    (4, 1, 100, 1),  # one simdgroup walks every key
    (8, 1, 33, 32),  # a full 1024-thread threadgroup: 31 simdgroups see one key, one sees two
    (16, 2, 300, 8),  # the model's heads at the engine's 256 threads
]


@pytest.mark.parametrize("heads,kv_heads,keys,simdgroups", SINGLE_CASES,
                         ids=[f"h{c[0]}x{c[1]}-S{c[2]}-sg{c[3]}" for c in SINGLE_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode(dtype: str, heads: int, kv_heads: int, keys: int, simdgroups: int, kio) -> None:
    rng = np.random.default_rng(1000 * keys + 10 * heads + simdgroups + DTYPES.index(dtype))
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys)
    out = run_single(inputs, simdgroups)
    assert_close(kio, out, inputs.expected(), dtype, f"attention_decode {dtype} S={keys} heads={heads}x{kv_heads}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_large_scores(dtype: str, kio) -> None:
    """Scores in the hundreds: the online softmax must rescale rather than overflow exp."""
    rng = np.random.default_rng(77 + DTYPES.index(dtype))
    inputs = DecodeInputs(kio, dtype, rng, 8, 2, 40, query_scale=60.0)
    out = run_single(inputs, 4)
    # A score s carries an fp32 error of about |s| * 2^-24 * sqrt(D), which exp turns into a relative error of the
    # weights: with scores near 200 that is ~10x the bound for unit-sized scores.
    assert_close(kio, out, inputs.expected(), dtype, f"large scores {dtype}", widen=10.0)


SPLIT_CASES = [
    # (heads, kv_heads, keys, block_size, simdgroups)
    (8, 2, 15, 16, 2),  # one partial block
    (8, 2, 16, 16, 2),  # one full block
    (8, 2, 17, 16, 2),  # a second block of one key
    (8, 2, 33, 16, 3),  # three blocks, the last of one key
    (16, 2, 47, 16, 2),  # the model's GQA 8, the last block one short
    (8, 2, 64, 32, 4),  # two full blocks
    (16, 2, 1025, 1024, 8),  # the model's heads and block size (LILY_ATTN_SPLIT_BLOCK): a second block of one key
]


@pytest.mark.parametrize("heads,kv_heads,keys,block_size,simdgroups", SPLIT_CASES,
                         ids=[f"h{c[0]}x{c[1]}-S{c[2]}-B{c[3]}-sg{c[4]}" for c in SPLIT_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_split(dtype: str, heads: int, kv_heads: int, keys: int, block_size: int, simdgroups: int,
                                kio) -> None:
    rng = np.random.default_rng(2000 * keys + 10 * block_size + heads + DTYPES.index(dtype))
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys)
    partial_out, partial_stats, out = run_split(inputs, block_size, simdgroups, combine_threads=64)
    expected_out, expected_stats = block_partials(inputs, block_size)
    what = f"{dtype} S={keys} block={block_size}"
    assert_close(kio, partial_out.astype(np.float64), expected_out, "f32", f"attention_decode_partial outputs {what}")
    assert_close(kio, partial_stats.astype(np.float64), expected_stats, "f32", f"attention_decode_partial stats {what}")
    assert_close(kio, out, inputs.expected(), dtype, f"attention_decode_combine {what}")


def test_attention_decode_split_matches_single_pass(kio) -> None:
    """Both decode paths compute the same attention: they agree within fp32 rounding (combine with 100 threads)."""
    rng = np.random.default_rng(9)
    inputs = DecodeInputs(kio, "f32", rng, 8, 2, 70)
    single = run_single(inputs, 4)
    _, _, split = run_split(inputs, 24, 4, combine_threads=100)
    assert_close(kio, split, single, "f32", "split vs single pass")
    assert_close(kio, split, inputs.expected(), "f32", "split vs reference")


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_decode_independent_of_schedule(seed: int, kio) -> None:
    """Keys are walked and simdgroups merged in a fixed order: FIFO and random schedules give the same bits."""
    inputs = DecodeInputs(kio, "f32", np.random.default_rng(12), 8, 2, 45)
    args = attention_args(1, 8, 2, 45, inputs.capacity)
    results = []
    for random_schedule in (False, True):
        out = kio.poisoned((8, D), "f32")
        msl.dispatch("attention_decode_f32_d256", [args, inputs.q, inputs.gate, inputs.k_cache, inputs.v_cache, out],
                     (2, 1, 1), (160, 1, 1), random_schedule=random_schedule, seed=seed)
        results.append(out)
    assert np.array_equal(results[0], results[1])
    assert_close(kio, results[1].astype(np.float64), inputs.expected(), "f32", "schedule")


VARIANT_CASES = [
    # (head_dim, heads_per_group, heads, kv_heads, keys, simdgroups)
    (64, 2, 4, 2, 1, 8),  # the demo model's heads (GQA 2: one threadgroup per KV head), first token, engine's 8 sg
    (64, 2, 4, 2, 33, 3),
    (64, 2, 8, 2, 32, 4),  # the gqa4 fixture: two threadgroups per KV head
    (64, 2, 2, 1, 100, 1),  # one simdgroup walks every key
    (256, 1, 4, 2, 31, 4),  # unpacked at GQA 2: two threadgroups read each KV head
    (256, 1, 16, 2, 33, 8),  # unpacked with the model's heads (GQA 8)
    (64, 1, 4, 2, 33, 2),
    (64, 1, 3, 3, 5, 8),  # unpacked needs no group: 3 heads of 3 KV heads (MHA), five keys over 8 simdgroups
]


@pytest.mark.parametrize("head_dim,per_group,heads,kv_heads,keys,simdgroups", VARIANT_CASES,
                         ids=[f"d{c[0]}-g{c[1]}-h{c[2]}x{c[3]}-S{c[4]}-sg{c[5]}" for c in VARIANT_CASES])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_decode_variants(dtype: str, head_dim: int, per_group: int, heads: int, kv_heads: int, keys: int,
                                   simdgroups: int, kio) -> None:
    """Head dim 64 (2 heads per threadgroup) and unpacked (1 head) single-pass kernels against the reference."""
    rng = np.random.default_rng(7000 + 1000 * keys + 10 * heads + head_dim + per_group + simdgroups)
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys, head_dim=head_dim)
    kernel = VARIANTS[(head_dim, per_group)][dtype][0]
    out = run_single(inputs, simdgroups, kernel, per_group)
    assert_close(kio, out, inputs.expected(), dtype, f"{kernel} S={keys} heads={heads}x{kv_heads}")


VARIANT_SPLIT_CASES = [
    # (head_dim, heads_per_group, heads, kv_heads, keys, block_size, simdgroups)
    (64, 2, 4, 2, 17, 16, 2),  # the demo model's heads; a second block of one key
    (64, 2, 8, 2, 33, 16, 3),
    (256, 1, 4, 2, 47, 16, 2),
    (256, 1, 16, 2, 1025, 1024, 8),  # the model's heads and block: what the ablation runs past the split switch
    (64, 1, 4, 2, 32, 16, 4),
]


@pytest.mark.parametrize("head_dim,per_group,heads,kv_heads,keys,block_size,simdgroups", VARIANT_SPLIT_CASES,
                         ids=[f"d{c[0]}-g{c[1]}-h{c[2]}x{c[3]}-S{c[4]}-B{c[5]}" for c in VARIANT_SPLIT_CASES])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_decode_variants_split(dtype: str, head_dim: int, per_group: int, heads: int, kv_heads: int,
                                         keys: int, block_size: int, simdgroups: int, kio) -> None:
    """The split-KV pair of the head-dim-64 and unpacked instances: partials, stats and the combined output."""
    rng = np.random.default_rng(9000 + 1000 * keys + 10 * block_size + head_dim + per_group)
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys, head_dim=head_dim)
    single, partial, combine = VARIANTS[(head_dim, per_group)][dtype]
    partial_out, partial_stats, out = run_split(inputs, block_size, simdgroups, 64, (partial, combine), per_group)
    expected_out, expected_stats = block_partials(inputs, block_size)
    what = f"{partial} S={keys} block={block_size}"
    assert_close(kio, partial_out.astype(np.float64), expected_out, "f32", f"outputs {what}")
    assert_close(kio, partial_stats.astype(np.float64), expected_stats, "f32", f"stats {what}")
    assert_close(kio, out, inputs.expected(), dtype, f"{combine} {what}")


def test_attention_decode_unpacked_matches_packed(kio) -> None:
    """The GQA-packing ablation changes the schedule, not the maths: per head, the same keys in the same order, so
    the packed and unpacked kernels agree within fp32 rounding (and both with the reference)."""
    inputs = DecodeInputs(kio, "f32", np.random.default_rng(21), 16, 2, 70)
    packed = run_single(inputs, 8)
    unpacked = run_single(inputs, 8, VARIANTS[(256, 1)]["f32"][0], 1)
    assert_close(kio, unpacked, packed, "f32", "unpacked vs packed")
    assert_close(kio, unpacked, inputs.expected(), "f32", "unpacked vs reference")


# Coalesced-KV ablation (plain row mapping, packed heads): head dim -> {dtype: (single-pass, partial, combine)}.
PLAIN = {
    256: {
        "f32": ("attention_decode_plain_f32_d256", "attention_decode_partial_plain_f32_d256",
                "attention_decode_combine_f32_d256"),
        "bf16": ("attention_decode_plain_bf16_d256", "attention_decode_partial_plain_bf16_d256",
                 "attention_decode_combine_bf16_d256"),
    },
    64: {
        "f32": ("attention_decode_plain_f32_d64", "attention_decode_partial_plain_f32_d64",
                "attention_decode_combine_f32_d64"),
        "bf16": ("attention_decode_plain_bf16_d64", "attention_decode_partial_plain_bf16_d64",
                 "attention_decode_combine_bf16_d64"),
    },
}
# Heads per threadgroup of the packed kernels by head dim (LILY_ATTN_HEADS_PER_GROUP, ..._D64).
PACKED_HEADS = {256: HEADS_PER_GROUP, 64: 2}
PLAIN_CASES = [
    # (head_dim, heads, kv_heads, keys, simdgroups)
    (256, 8, 2, 1, 4),  # first token: three simdgroups see no key
    (256, 16, 2, 33, 3),  # the model's heads (GQA 8), keys not a multiple of the simdgroups
    (256, 8, 1, 32, 8),
    (64, 4, 2, 33, 3),  # the demo model's heads
    (64, 8, 2, 31, 4),
]


@pytest.mark.parametrize("head_dim,heads,kv_heads,keys,simdgroups", PLAIN_CASES,
                         ids=[f"d{c[0]}-h{c[1]}x{c[2]}-S{c[3]}-sg{c[4]}" for c in PLAIN_CASES])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_decode_plain(dtype: str, head_dim: int, heads: int, kv_heads: int, keys: int, simdgroups: int,
                                kio) -> None:
    """The plain-mapping single-pass kernels against the reference (NaN-poisoned output and spare cache rows)."""
    rng = np.random.default_rng(31000 + 1000 * keys + 10 * heads + head_dim + simdgroups)
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys, head_dim=head_dim)
    kernel = PLAIN[head_dim][dtype][0]
    out = run_single(inputs, simdgroups, kernel, PACKED_HEADS[head_dim])
    assert_close(kio, out, inputs.expected(), dtype, f"{kernel} S={keys} heads={heads}x{kv_heads}")


PLAIN_SPLIT_CASES = [
    # (head_dim, heads, kv_heads, keys, block_size, simdgroups)
    (256, 16, 2, 47, 16, 2),  # the model's heads, the last block one short
    (256, 8, 2, 17, 16, 3),  # a second block of one key
    (64, 4, 2, 33, 16, 2),
]


@pytest.mark.parametrize("head_dim,heads,kv_heads,keys,block_size,simdgroups", PLAIN_SPLIT_CASES,
                         ids=[f"d{c[0]}-h{c[1]}x{c[2]}-S{c[3]}-B{c[4]}" for c in PLAIN_SPLIT_CASES])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_decode_plain_split(dtype: str, head_dim: int, heads: int, kv_heads: int, keys: int,
                                      block_size: int, simdgroups: int, kio) -> None:
    """The plain-mapping partial pass: partials and stats against numpy, the combined output against the reference."""
    rng = np.random.default_rng(37000 + 1000 * keys + 10 * block_size + head_dim)
    inputs = DecodeInputs(kio, dtype, rng, heads, kv_heads, keys, head_dim=head_dim)
    _, partial, combine = PLAIN[head_dim][dtype]
    partial_out, partial_stats, out = run_split(inputs, block_size, simdgroups, 64, (partial, combine),
                                                PACKED_HEADS[head_dim])
    expected_out, expected_stats = block_partials(inputs, block_size)
    what = f"{partial} S={keys} block={block_size}"
    assert_close(kio, partial_out.astype(np.float64), expected_out, "f32", f"outputs {what}")
    assert_close(kio, partial_stats.astype(np.float64), expected_stats, "f32", f"stats {what}")
    assert_close(kio, out, inputs.expected(), dtype, f"{combine} {what}")


def test_attention_decode_plain_matches_coalesced(kio) -> None:
    """The coalesced-KV ablation changes which lane reads which chunk, not the maths: the plain and coalesced kernels
    agree within fp32 rounding (the dot products' lane partial sums are grouped differently), single pass and split."""
    inputs = DecodeInputs(kio, "f32", np.random.default_rng(41), 16, 2, 70)
    coalesced = run_single(inputs, 8)
    plain = run_single(inputs, 8, PLAIN[256]["f32"][0])
    assert_close(kio, plain, coalesced, "f32", "plain vs coalesced")
    _, partial, combine = PLAIN[256]["f32"]
    coalesced_parts, coalesced_stats, _ = run_split(inputs, 32, 4, 64)
    plain_parts, plain_stats, plain_split = run_split(inputs, 32, 4, 64, (partial, combine))
    assert_close(kio, plain_parts.astype(np.float64), coalesced_parts.astype(np.float64), "f32", "plain partials")
    assert_close(kio, plain_stats.astype(np.float64), coalesced_stats.astype(np.float64), "f32", "plain stats")
    assert_close(kio, plain_split, inputs.expected(), "f32", "plain split vs reference")


@pytest.mark.parametrize("case", op_cases("attention"))
def test_attention_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.attention: the self-test's, on this session's device."""
    check(case, kernel_device)
