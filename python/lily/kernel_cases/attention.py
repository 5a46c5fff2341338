"""Cases of metal/attention.metal (decode attention) against ``lily.reference.attention``, and the helpers the
attention ops' cases share.

One query token over a KV cache [Hkv, capacity, D]. The single-pass kernel runs at contexts 1, 31, 32, 33, 45, 100
and 300 with 1, 3, 4, 8 and 32 simdgroups (simdgroups that see no key), GQA groups of 4 and 8 (the model's: two
threadgroups per KV head), and scores in the hundreds. The split-KV pair (attention_decode_partial +
attention_decode_combine) runs with block counts whose span ceil(keys / blocks) leaves a short last block, an empty
last block, more blocks than keys, and the engine's counts at 1025 and 4096 keys; its partials are checked against a
numpy per-block softmax. Every context that is not a multiple of 8 (LILY_ATTN_DECODE_KEYS_PER_STEP) ends in a masked
step. The head-dim-64 instances (2 heads
per threadgroup), the unpacked instances of the GQA-packing ablation (1 head per threadgroup; GQA groups of 2 and 1)
and the plain-mapping instances of the coalesced-KV ablation run their own single-pass and split-KV cases. The
matrix-unit kernels (attention_decode_mma, attention_decode_partial_mma: the whole GQA group per threadgroup, chunks of
64 keys, each simdgroup scoring 8 of them and writing its own output dims) run the same checks with their own shapes;
their outputs may move by one bf16 rounding of the weighted |v| (their P·V operands are bf16). Outputs and partials
start NaN-poisoned; the cache has spare rows past the context holding NaN, so reading a key past the
context is caught.

The split kernel with attention_prep fused in front (attention_decode_partial_prep_mma: FUSED_ATTENTION_PREP) starts
from q_proj's [query | gate] rows, k and v: the new key's cache row starts NaN, must come out as the reference's roped
key (v rounded once) in every layout, including one where two threadgroups of a KV head both write it, and no other
cache row may change. Its output after the combine is compared with the reference's attention of the reference's
prepped q under the mma kernels' tolerance (a q element whose fp32 and fp64 values round to neighbouring bf16 values
moves a score by about 2^-8 |q k| / 16, far inside it); its gate copy must be exact.
tests/kernels/test_attention.py also checks that it gives the bits of attention_prep followed by the unfused kernels.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import TOLERANCES, Case, Run, Tolerance, dtype_of, poisoned, round_to, to_device, to_f64

PATTERN = re.compile(r"attention_decode_(unpacked_|plain_|mma_|partial_|partial_unpacked_|partial_plain_|partial_mma_|"
                     r"partial_prep_mma_|combine_)?"
                     r"(f32|f16|bf16)_d(256|64)")
# Query heads per threadgroup of the packed kernels by head dim (LILY_ATTN_HEADS_PER_GROUP, ..._D64); the
# *_unpacked_* kernels (the GQA-packing ablation) take one; the *_plain_* ones (coalesced-KV ablation) pack like the
# default kernels; the *_mma_* ones pack the whole GQA group at D = 256 (LILY_ATTN_MMA_HEADS_PER_GROUP, ..._D64).
HEADS_PER_GROUP = {256: 4, 64: 2}
MMA_HEADS_PER_GROUP = {256: 8, 64: 2}
MMA_SIMDGROUPS = 8  # LILY_ATTN_DECODE_MMA_SIMDGROUPS: the mma kernels take exactly this many
ROUNDING_UNIT = {"bf16": 2.0**-8, "f16": 2.0**-11}  # one rounding (2^-p, twice the half-ulp bound) of a 16-bit dtype
# The KV cache is bf16 except in float32 mode.
CACHE_DTYPE = {"f32": "f32", "f16": "bf16", "bf16": "bf16"}
# fp32 outputs: the kernel's fp32 dot products, exps and sums over up to 1025 keys against an fp64 reference.
F32_SUMS = Tolerance(rtol=2e-5, atol=2e-6, rel_rms=5e-6)
COMBINE_THREADS, COMBINE_SLICE = 256, 32  # tuning::kAttentionCombineThreads, kAttentionCombineSlice: the engine's

# Single-pass shapes (heads, kv_heads, keys, simdgroups) by kernel family; the first is the self-test's.
SINGLE_SHAPES = {
    ("packed", 256): [(16, 2, 45, 4), (8, 2, 1, 4), (8, 2, 31, 4), (8, 2, 32, 4), (8, 2, 33, 4),
                      (16, 2, 33, 3),  # GQA 8: two threadgroups per KV head; keys not a multiple of the simdgroups
                      (4, 1, 100, 1),  # one simdgroup walks every key
                      (8, 1, 33, 32),  # a full 1024-thread threadgroup: 31 simdgroups see one key, one sees two
                      (16, 2, 300, 8)],  # the model's heads at the engine's 256 threads
    ("packed", 64): [(4, 2, 45, 4), (4, 2, 1, 8), (4, 2, 33, 3), (8, 2, 32, 4), (2, 1, 100, 1)],
    ("unpacked", 256): [(16, 2, 45, 4), (4, 2, 31, 4), (16, 2, 33, 8)],
    ("unpacked", 64): [(4, 2, 45, 4), (4, 2, 33, 2), (3, 3, 5, 8)],  # 3 heads of 3 KV heads: no group needed
    ("plain", 256): [(16, 2, 45, 4), (8, 2, 1, 4), (16, 2, 33, 3), (8, 1, 32, 8)],
    ("plain", 64): [(4, 2, 45, 4), (4, 2, 33, 3), (8, 2, 31, 4)],
    # attention_decode_mma (MMA_SIMDGROUPS, chunks of 8 per simdgroup = 64 keys): one key, a partial chunk (45: two
    # simdgroups see no key, two steps none), one whole chunk, a second chunk of one key, two chunks (the even and odd
    # sets of loads and score buffers) and five, two threadgroups per KV head.
    ("mma", 256): [(16, 2, 45, 8), (8, 1, 1, 8), (16, 2, 64, 8), (16, 2, 65, 8), (16, 2, 128, 8), (32, 2, 300, 8)],
    ("mma", 64): [(4, 2, 45, 8), (8, 2, 17, 8), (2, 1, 70, 8), (4, 2, 259, 8)],
}
# Split-KV shapes (heads, kv_heads, keys, blocks, simdgroups); the kernel's block span is ceil(keys / blocks). 45 keys
# in 3 blocks of 15 (no block a multiple of 8 keys), 1 key in 2 blocks (the second empty), 3 keys in 8 blocks (5 empty),
# 65 keys in 4 blocks of 17 (the last one short: 14), 33 keys in 2 blocks, 9 keys in 4 blocks of 3 (the last empty),
# 64 keys in 8 full blocks, the Metal engine's 8 blocks at 1025 keys and 32 at 4096 keys, and the CUDA engine's 64 at
# 4096 keys (tuning::attention_split_blocks; CUDA splits into short blocks) with the model's heads.
SPLIT_SHAPES = {
    ("packed", 256): [(16, 2, 45, 3, 2), (8, 2, 1, 2, 2), (8, 2, 3, 8, 2), (8, 2, 65, 4, 2), (8, 2, 33, 2, 3),
                      (16, 2, 9, 4, 2), (8, 2, 64, 8, 4), (16, 2, 1025, 8, 8), (16, 2, 4096, 32, 8)],
    ("packed", 64): [(4, 2, 45, 3, 2), (4, 2, 17, 4, 2), (8, 2, 33, 2, 3), (4, 2, 5, 8, 2)],
    ("unpacked", 256): [(16, 2, 45, 3, 2), (4, 2, 47, 4, 2), (4, 2, 2, 4, 2), (16, 2, 1025, 8, 8)],
    ("unpacked", 64): [(4, 2, 45, 3, 2), (4, 2, 32, 4, 4), (4, 2, 3, 8, 2)],
    ("plain", 256): [(16, 2, 45, 3, 2), (16, 2, 47, 4, 2), (8, 2, 17, 2, 3), (8, 2, 3, 4, 2)],
    ("plain", 64): [(4, 2, 45, 3, 2), (4, 2, 33, 2, 2), (4, 2, 1, 2, 2)],
    # attention_decode_partial_mma (MMA_SIMDGROUPS, chunks of 64 keys): blocks of a part of a chunk, most simdgroups
    # seeing no key; 32 heads of 2 KV heads (two threadgroups per KV head); one KV head; a block of 65 keys (a second
    # chunk of one key), the Metal engine's 8 blocks of 1025 keys (129: three chunks), five chunks a block, and the
    # CUDA engine's 64 blocks at 4096 keys (one chunk each).
    ("mma", 256): [(16, 2, 45, 3, 8), (8, 1, 1, 2, 8), (16, 2, 3, 8, 8), (16, 2, 65, 4, 8), (16, 2, 130, 2, 8),
                   (16, 2, 100, 2, 8), (32, 2, 47, 3, 8), (16, 2, 1025, 8, 8), (16, 2, 600, 2, 8),
                   (16, 2, 4096, 64, 8)],
    # Head dim 64 packs 2 heads (the demo model's ratio; the gqa4 fixture's 4 gives two threadgroups per KV head).
    ("mma", 64): [(4, 2, 45, 3, 8), (8, 2, 33, 2, 8), (4, 2, 5, 8, 8), (2, 1, 300, 2, 8)],
}
# The fused kernel (attention_decode_partial_prep_mma): (heads, kv_heads, keys, blocks, simdgroups, rotary_dim). At
# head dim 256 (MMA_SIMDGROUPS: 9 prep rows, one simdgroup takes two): the first token (no earlier row; its block 1
# empty), 32 heads of 2 KV heads (two threadgroups per KV head, both writing the new row), rotary over the whole head,
# empty trailing blocks, the new key in a later chunk (130 and 300 keys in 2 blocks), the CUDA engine's 64 blocks at
# 4096 keys. At 64: the demo model (rotary 16), the gqa4 fixture (rotary 32, two threadgroups per KV head), rotary 64.
PREP_SHAPES = {
    256: [(16, 2, 45, 3, 8, 64), (16, 2, 1, 2, 8, 64), (16, 2, 3, 8, 8, 64), (32, 2, 47, 3, 8, 64),
          (32, 2, 100, 4, 8, 64), (8, 1, 20, 2, 8, 256), (16, 2, 130, 2, 8, 64), (16, 2, 300, 2, 8, 64),
          (16, 2, 4096, 64, 8, 64)],
    64: [(4, 2, 45, 3, 8, 16), (8, 2, 33, 2, 8, 32), (4, 2, 5, 8, 8, 16), (2, 1, 70, 4, 8, 64)],
}


def attention_args(queries: int, heads: int, kv_heads: int, keys: int, capacity: int, num_blocks: int = 0,
                   scale: float = 256**-0.5) -> bytes:
    """lily::AttentionArgs (metal/lily.h); its `reserved` field is 0."""
    return struct.pack("<IIIIIIIf", queries, heads, kv_heads, keys, capacity, 0, num_blocks, scale)


def block_span(keys: int, num_blocks: int) -> int:
    """Keys per split-KV block as attention_decode_partial derives it; blocks past the keys are empty."""
    return -(-keys // num_blocks)


def attention_layout(kernel: str) -> tuple[int, int, int]:
    """(head dim, query heads per threadgroup, query heads of the self-test's case) of an attention kernel's host name:
    the model's 16 heads at head dim 256, the demo model's 4 at head dim 64, always 2 KV heads."""
    head_dim = int(re.search(r"_d(\d+)$", kernel).group(1))
    packing = MMA_HEADS_PER_GROUP if "_mma_" in kernel else HEADS_PER_GROUP
    per_group = 1 if "_unpacked_" in kernel else packing[head_dim]
    return head_dim, per_group, 16 if head_dim == 256 else 4


def tolerance(dtype: str, widen: float = 1.0) -> Tolerance:
    """The dtype's tolerance; for f32 the bound of sums over many keys, widened by `widen`."""
    if dtype != "f32":
        return TOLERANCES[dtype]
    return Tolerance(widen * F32_SUMS.rtol, widen * F32_SUMS.atol, widen * F32_SUMS.rel_rms)


def kv_cache(rng: np.random.Generator, cache_dtype: str, kv_heads: int, keys: int, capacity: int,
             head_dim: int) -> np.ndarray:
    """[Hkv, capacity, D] with `keys` random rows and NaN after them (a read past the context shows)."""
    cache = poisoned((kv_heads, capacity, head_dim), cache_dtype)
    cache[:, :keys] = to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
    return cache


def cache_rows(cache: np.ndarray, cache_dtype: str, keys: int) -> np.ndarray:
    """The first `keys` rows of a cache as [keys, Hkv, D] float64 (the reference's layout)."""
    return to_f64(cache, cache_dtype)[:, :keys].transpose(1, 0, 2)


@dataclass
class DecodeInputs:
    """Random q, gate and KV cache for one decode step; the cache's spare rows hold NaN."""

    dtype: str
    heads: int
    kv_heads: int
    keys: int
    head_dim: int
    q: np.ndarray
    gate: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray

    @classmethod
    def random(cls, rng: np.random.Generator, dtype: str, heads: int, kv_heads: int, keys: int, head_dim: int,
               query_scale: float = 2.0) -> DecodeInputs:
        cache_dtype = CACHE_DTYPE[dtype]
        q = to_device(rng.standard_normal((heads, head_dim)) * query_scale, dtype)
        gate = to_device(rng.standard_normal((heads, head_dim)) * 2.0, dtype)
        k_cache = kv_cache(rng, cache_dtype, kv_heads, keys, keys + 3, head_dim)
        v_cache = kv_cache(rng, cache_dtype, kv_heads, keys, keys + 3, head_dim)
        return cls(dtype, heads, kv_heads, keys, head_dim, q, gate, k_cache, v_cache)

    @property
    def capacity(self) -> int:
        return self.k_cache.shape[1]

    def args(self, num_blocks: int = 0) -> bytes:
        return attention_args(1, self.heads, self.kv_heads, self.keys, self.capacity, num_blocks, self.head_dim**-0.5)

    def keys_values(self) -> tuple[np.ndarray, np.ndarray]:
        cache_dtype = CACHE_DTYPE[self.dtype]
        return cache_rows(self.k_cache, cache_dtype, self.keys), cache_rows(self.v_cache, cache_dtype, self.keys)

    def expected(self) -> np.ndarray:
        """reference.attention on the stored (rounded) values, rounded once to the dtype: [Hq, D]."""
        k, v = self.keys_values()
        out = reference.attention(to_f64(self.q, self.dtype)[None], k, v, to_f64(self.gate, self.dtype)[None],
                                  offset=self.keys - 1)
        return round_to(out[0], self.dtype)

    def block_partials(self, num_blocks: int, absolute_values: bool = False):
        """Per block of keys (span ceil(keys / num_blocks)): the softmax-normalised output [Hq, blocks, D] and
        (max score, sum of exp) [Hq, blocks, 2], in fp64. An empty block has output 0, max -inf and sum 0.
        `absolute_values`: of |v| (the scale of an output's rounding error when the weights are rounded)."""
        k, v = self.keys_values()
        v = np.abs(v) if absolute_values else v
        q, kv = to_f64(self.q, self.dtype), np.arange(self.heads) // (self.heads // self.kv_heads)
        span = block_span(self.keys, num_blocks)
        outs, stats = [], []
        for begin in range(0, num_blocks * span, span):
            if begin >= self.keys:
                outs.append(np.zeros((self.heads, self.head_dim)))
                stats.append(np.stack([np.full(self.heads, -np.inf), np.zeros(self.heads)], axis=-1))
                continue
            kb, vb = k[begin : begin + span][:, kv], v[begin : begin + span][:, kv]  # [n, Hq, D]
            scores = np.einsum("hd,nhd->hn", q, kb) * self.head_dim**-0.5
            top = scores.max(axis=1, keepdims=True)
            weights = np.exp(scores - top)
            outs.append(np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), vb))
            stats.append(np.stack([top[:, 0], weights.sum(axis=1)], axis=-1))
        return np.stack(outs, axis=1), np.stack(stats, axis=1)


def run_single(run: Run, kernel: str, inputs: DecodeInputs, simdgroups: int, **options) -> np.ndarray:
    """The single-pass `kernel`, one threadgroup per packed group of heads: the output as float64."""
    out = poisoned((inputs.heads, inputs.head_dim), inputs.dtype)
    run.dispatch(kernel, [inputs.args(), inputs.q, inputs.gate, inputs.k_cache, inputs.v_cache, out],
                 inputs.heads // attention_layout(kernel)[1], 32 * simdgroups, **options)
    return to_f64(out, inputs.dtype)


def run_split(run: Run, partial_kernel: str, inputs: DecodeInputs, num_blocks: int, simdgroups: int):
    """The split-KV pair over `num_blocks` key blocks: the partial kernel, then its head dim's combine kernel.
    (partials, stats, output)."""
    args = inputs.args(num_blocks)
    partial_out = np.full((inputs.heads, num_blocks, inputs.head_dim), np.nan, np.float32)
    partial_stats = np.full((inputs.heads, num_blocks, 2), np.nan, np.float32)
    run.dispatch(partial_kernel, [args, inputs.q, inputs.k_cache, inputs.v_cache, partial_out, partial_stats],
                 (inputs.heads // attention_layout(partial_kernel)[1], num_blocks, 1), 32 * simdgroups)
    out = poisoned((inputs.heads, inputs.head_dim), inputs.dtype)
    run.dispatch(f"attention_decode_combine_{inputs.dtype}_d{inputs.head_dim}",
                 [args, inputs.gate, partial_out, partial_stats, out],
                 (inputs.heads, -(-inputs.head_dim // COMBINE_SLICE), 1), COMBINE_THREADS)
    return partial_out.astype(np.float64), partial_stats.astype(np.float64), to_f64(out, inputs.dtype)


def weight_rounding_allowance(inputs: DecodeInputs) -> np.ndarray:
    """The mma kernels' P·V takes the weights rounded to bf16 (the MMA operands): an output moves by up to one rounding
    of sum_k p_k |v_k| / sum_k p_k, times the gate."""
    k, v = inputs.keys_values()
    magnitude = reference.attention(to_f64(inputs.q, inputs.dtype)[None], k, np.abs(v),
                                    to_f64(inputs.gate, inputs.dtype)[None], offset=inputs.keys - 1)[0]
    return ROUNDING_UNIT["bf16"] * np.abs(magnitude)


def _single(run: Run, kernel: str, heads: int, kv_heads: int, keys: int, simdgroups: int,
            query_scale: float = 2.0, widen: float = 1.0) -> None:
    dtype, head_dim = dtype_of(kernel), attention_layout(kernel)[0]
    inputs = DecodeInputs.random(run.rng, dtype, heads, kv_heads, keys, head_dim, query_scale)
    allowance = weight_rounding_allowance(inputs) if "_mma_" in kernel else None
    run.compare("out", run_single(run, kernel, inputs, simdgroups), inputs.expected(), tolerance(dtype, widen),
                allowance)


def _split(run: Run, kernel: str, heads: int, kv_heads: int, keys: int, blocks: int, simdgroups: int) -> None:
    """The partial kernel's outputs and (max, sum) against numpy per block; the combined output against the
    reference."""
    dtype, head_dim = dtype_of(kernel), attention_layout(kernel)[0]
    inputs = DecodeInputs.random(run.rng, dtype, heads, kv_heads, keys, head_dim)
    partial_out, partial_stats, out = run_split(run, kernel, inputs, blocks, simdgroups)
    expected_out, expected_stats = inputs.block_partials(blocks)
    partial_allowance = combined_allowance = None
    if "_mma_" in kernel:  # the weights' bf16 rounding (weight_rounding_allowance), per block and combined
        partial_allowance = ROUNDING_UNIT["bf16"] * inputs.block_partials(blocks, absolute_values=True)[0]
        combined_allowance = weight_rounding_allowance(inputs)
    run.compare("partial outputs", partial_out, expected_out, tolerance("f32"), partial_allowance)
    run.compare("partial (max, sum)", partial_stats, expected_stats, tolerance("f32"))
    run.compare("combined out", out, inputs.expected(), tolerance(dtype), combined_allowance)


def _combine(run: Run, kernel: str, heads: int, kv_heads: int, keys: int, blocks: int, slices: int,
             threads: int = COMBINE_THREADS) -> None:
    """The combine kernel alone, on exact (fp64, rounded to fp32) partials, each head's D elements split over
    `slices` threadgroups of `threads` (the engine: D / COMBINE_SLICE of COMBINE_THREADS; any split must give the same
    result)."""
    dtype, head_dim = dtype_of(kernel), attention_layout(kernel)[0]
    inputs = DecodeInputs.random(run.rng, dtype, heads, kv_heads, keys, head_dim)
    part_out, part_stats = inputs.block_partials(blocks)
    out = poisoned((heads, head_dim), dtype)
    run.dispatch(kernel, [inputs.args(blocks), inputs.gate, part_out.astype(np.float32),
                          part_stats.astype(np.float32), out], (heads, slices, 1), threads)
    run.compare("out", to_f64(out, dtype), inputs.expected(), tolerance(dtype))


@dataclass
class PrepDecodeInputs:
    """Random q_proj rows ([query | gate] per head), k, v, norms and a cache for one decode step with the prep fused:
    rows 0 .. keys - 2 random, the new key's row (keys - 1) and the spare rows NaN; `prepped` is the reference's
    result as DecodeInputs (q, gate, and the cache with the new row, each rounded once as the prep stores them)."""

    q_and_gate: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    rotary_dim: int
    prepped: DecodeInputs

    @classmethod
    def random(cls, rng: np.random.Generator, heads: int, kv_heads: int, keys: int, head_dim: int,
               rotary_dim: int) -> PrepDecodeInputs:
        from lily.kernel_cases.attention_prep import EPS, THETA

        dtype = cache_dtype = "bf16"
        position = keys - 1
        q_and_gate = to_device(rng.standard_normal((heads, 2 * head_dim)) * 2.0, dtype)
        k = to_device(rng.standard_normal((kv_heads, head_dim)) * 2.0, dtype)
        v = to_device(rng.standard_normal((kv_heads, head_dim)), dtype)
        q_norm = to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
        k_norm = to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
        k_cache = kv_cache(rng, cache_dtype, kv_heads, position, keys + 3, head_dim)
        v_cache = kv_cache(rng, cache_dtype, kv_heads, position, keys + 3, head_dim)
        q, gate, k_new = reference.attention_prep(to_f64(q_and_gate, dtype)[None], to_f64(k, dtype)[None],
                                                  to_f64(q_norm, dtype), to_f64(k_norm, dtype), np.array([position]),
                                                  rotary_dim, THETA, EPS)
        k_with_row, v_with_row = k_cache.copy(), v_cache.copy()
        k_with_row[:, position] = to_device(k_new[0], cache_dtype)
        v_with_row[:, position] = to_device(to_f64(v, dtype), cache_dtype)
        prepped = DecodeInputs(dtype, heads, kv_heads, keys, head_dim, to_device(q[0], dtype),
                               to_device(gate[0], dtype), k_with_row, v_with_row)
        return cls(q_and_gate, k, v, q_norm, k_norm, k_cache, v_cache, rotary_dim, prepped)

    def prep_args(self) -> bytes:
        from lily.kernel_cases.attention_prep import attention_prep_args

        p = self.prepped
        return attention_prep_args(1, p.heads, p.kv_heads, p.keys - 1, p.capacity, self.rotary_dim)

    def prep_inputs(self) -> list:
        """The fused kernels' buffers 2 .. 6: q_and_gate, k, v, q_norm, k_norm."""
        return [self.q_and_gate, self.k, self.v, self.q_norm, self.k_norm]


def run_prep_fused(run: Run, kernel: str, inputs: PrepDecodeInputs, blocks: int, simdgroups: int):
    """The fused `kernel` then its head dim's combine on `inputs`, whose caches it writes in place. (output, gate copy,
    partials, stats): output float64, the rest as the kernel wrote them (partials and stats float32)."""
    p = inputs.prepped
    groups = p.heads // attention_layout(kernel)[1]
    out = poisoned((p.heads, p.head_dim), p.dtype)
    gate = poisoned((p.heads, p.head_dim), p.dtype)
    partial_out = np.full((p.heads, blocks, p.head_dim), np.nan, np.float32)
    partial_stats = np.full((p.heads, blocks, 2), np.nan, np.float32)
    run.dispatch(kernel, [p.args(blocks), inputs.prep_args(), *inputs.prep_inputs(), gate, inputs.k_cache,
                          inputs.v_cache, partial_out, partial_stats], (groups, blocks, 1), 32 * simdgroups)
    run.dispatch(f"attention_decode_combine_{p.dtype}_d{p.head_dim}",
                 [p.args(blocks), gate, partial_out, partial_stats, out],
                 (p.heads, -(-p.head_dim // COMBINE_SLICE), 1), COMBINE_THREADS)
    return to_f64(out, p.dtype), gate, partial_out, partial_stats


def _prep_fused(run: Run, kernel: str, heads: int, kv_heads: int, keys: int, blocks: int, simdgroups: int,
                rotary_dim: int) -> None:
    """The output against the reference's attention of the reference's prep; the new cache row against the
    reference's roped key (v exact); every other cache row unchanged; the split kernel's gate copy exact."""
    head_dim = attention_layout(kernel)[0]
    inputs = PrepDecodeInputs.random(run.rng, heads, kv_heads, keys, head_dim, rotary_dim)
    p, position = inputs.prepped, keys - 1
    k_before, v_before = inputs.k_cache.copy(), inputs.v_cache.copy()
    out, gate, _, _ = run_prep_fused(run, kernel, inputs, blocks, simdgroups)
    run.compare("out", out, p.expected(), tolerance(p.dtype), weight_rounding_allowance(p))
    run.compare_exact("gate (copied)", gate, p.gate)
    run.compare("k cache, new row", to_f64(inputs.k_cache[:, position], "bf16"), to_f64(p.k_cache[:, position], "bf16"),
                "bf16")
    run.compare_exact("v cache, new row (one rounding)", inputs.v_cache[:, position], p.v_cache[:, position])
    others = np.arange(p.capacity) != position
    run.compare_exact("k cache, other rows", inputs.k_cache[:, others], k_before[:, others])
    run.compare_exact("v cache, other rows", inputs.v_cache[:, others], v_before[:, others])


def cases(kernel: str) -> list[Case]:
    """Every case of one decode attention kernel; the first is the self-test's."""
    head_dim, _, heads = attention_layout(kernel)
    if "_prep_mma_" in kernel:
        return [Case(kernel, f"Hq={h} Hkv={kv} S={s} blocks={b} simdgroups={sg} R={r} D={head_dim}",
                     partial(_prep_fused, kernel=kernel, heads=h, kv_heads=kv, keys=s, blocks=b, simdgroups=sg,
                             rotary_dim=r), quick=i == 0)
                for i, (h, kv, s, b, sg, r) in enumerate(PREP_SHAPES[head_dim])]
    if "_combine_" in kernel:
        # 45 keys in 3 blocks; 66 keys in 64 blocks (LILY_ATTN_SPLIT_MAX_BLOCKS; span 2: blocks 33.. empty: 8 loads
        # in flight per lane with the engine's 8 simdgroups), block counts below one batch of 8 per simdgroup (7, 17)
        # and one batch plus 5 (13 blocks on 1 simdgroup); one threadgroup per head (slices 1), the engine's split,
        # one leaving threadgroups idle; 1, 3 and 32 simdgroups (more simdgroups than blocks).
        engine = -(-head_dim // COMBINE_SLICE)
        return [Case(kernel, f"Hq={heads} Hkv=2 S={s} blocks={b} slices={n} threads={t} D={head_dim}",
                     partial(_combine, kernel=kernel, heads=heads, kv_heads=2, keys=s, blocks=b, slices=n, threads=t),
                     quick=i == 0)
                for i, (s, b, n, t) in enumerate([(45, 3, engine, COMBINE_THREADS), (66, 64, 1, COMBINE_THREADS),
                                                  (50, 7, engine, COMBINE_THREADS), (70, 17, engine + 1, 96),
                                                  (80, 13, engine, 32), (90, 9, 2, 1024)])]
    family = ("unpacked" if "_unpacked_" in kernel else "plain" if "_plain_" in kernel else
              "mma" if "_mma_" in kernel else "packed", head_dim)
    if "_partial" in kernel:
        return [Case(kernel, f"Hq={h} Hkv={kv} S={s} blocks={b} simdgroups={sg} D={head_dim}",
                     partial(_split, kernel=kernel, heads=h, kv_heads=kv, keys=s, blocks=b, simdgroups=sg),
                     quick=i == 0) for i, (h, kv, s, b, sg) in enumerate(SPLIT_SHAPES[family])]
    found = [Case(kernel, f"Hq={h} Hkv={kv} S={s} simdgroups={sg} D={head_dim}",
                  partial(_single, kernel=kernel, heads=h, kv_heads=kv, keys=s, simdgroups=sg), quick=i == 0)
             for i, (h, kv, s, sg) in enumerate(SINGLE_SHAPES[family])]
    if family in (("packed", 256), ("mma", 256)):
        # Scores in the hundreds: the online softmax must rescale rather than overflow exp. A score s carries an fp32
        # error of about |s| * 2^-24 * sqrt(D), which exp turns into a relative error of the weights: with scores
        # near 200 that is ~10x the bound for unit-sized scores.
        # (The mma kernel packs a whole group of 8 heads; 140 keys are three chunks, each rescaling the last.)
        heads, keys, simdgroups = (16, 140, MMA_SIMDGROUPS) if family[0] == "mma" else (8, 40, 4)
        found.append(Case(kernel, f"Hq={heads} Hkv=2 S={keys} simdgroups={simdgroups} D=256 large-scores",
                          partial(_single, kernel=kernel, heads=heads, kv_heads=2, keys=keys, simdgroups=simdgroups,
                                  query_scale=60.0, widen=10.0)))
    return found
