"""Cases of metal/attention.metal (decode: single pass, split-KV partials and combine, the GQA-packing and
coalesced-KV ablations) against ``lily.reference.attention``, and the helpers the attention ops' cases share.

The KV cache holds NaN after the context, so a read past it shows; the split-KV partials are checked against a
numpy per-block softmax.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, to_device, to_f64

PATTERN = re.compile(r"attention_decode_(unpacked_|plain_|partial_|partial_unpacked_|partial_plain_|combine_)?"
                     r"(f32|f16|bf16)_d(256|64)")
# Query heads per threadgroup of the packed kernels by head dim (LILY_ATTN_HEADS_PER_GROUP, ..._D64); the
# *_unpacked_* kernels (the GQA-packing ablation) take one; the *_plain_* ones (coalesced-KV ablation) pack like the
# default kernels.
HEADS_PER_GROUP = {256: 4, 64: 2}
# The KV cache is bf16 except in float32 mode.
CACHE_DTYPE = {"f32": "f32", "f16": "bf16", "bf16": "bf16"}


def attention_layout(kernel: str) -> tuple[int, int, int]:
    """(head dim, query heads per threadgroup, query heads of the case) of an attention kernel's host name: the model's
    16 heads at head dim 256, the demo model's 4 at head dim 64, always 2 KV heads."""
    head_dim = int(re.search(r"_d(\d+)$", kernel).group(1))
    per_group = 1 if "_unpacked_" in kernel else HEADS_PER_GROUP[head_dim]
    return head_dim, per_group, 16 if head_dim == 256 else 4


def attention_args(queries: int, heads: int, kv_heads: int, keys: int, capacity: int, head_dim: int,
                   block_size: int = 0, num_blocks: int = 0) -> bytes:
    return struct.pack("<IIIIIIIf", queries, heads, kv_heads, keys, capacity, block_size, num_blocks,
                       head_dim**-0.5)  # lily::AttentionArgs


def kv_cache(rng: np.random.Generator, cache_dtype: str, kv_heads: int, keys: int, capacity: int,
             head_dim: int) -> np.ndarray:
    """[Hkv, capacity, D] with `keys` random rows and NaN after them (a read past the context shows)."""
    cache = poisoned((kv_heads, capacity, head_dim), cache_dtype)
    cache[:, :keys] = to_device(rng.standard_normal((kv_heads, keys, head_dim)), cache_dtype)
    return cache


def cache_rows(cache: np.ndarray, cache_dtype: str, keys: int) -> np.ndarray:
    """The first `keys` rows of a cache as [keys, Hkv, D] float64 (the reference's layout)."""
    return to_f64(cache, cache_dtype)[:, :keys].transpose(1, 0, 2)


def _decode_inputs(run: Run, dtype: str, heads: int, kv_heads: int, keys: int, head_dim: int):
    cache_dtype = CACHE_DTYPE[dtype]
    capacity = keys + 3
    q = to_device(2.0 * run.rng.standard_normal((heads, head_dim)), dtype)
    gate = to_device(2.0 * run.rng.standard_normal((heads, head_dim)), dtype)
    k_cache = kv_cache(run.rng, cache_dtype, kv_heads, keys, capacity, head_dim)
    v_cache = kv_cache(run.rng, cache_dtype, kv_heads, keys, capacity, head_dim)
    k, v = cache_rows(k_cache, cache_dtype, keys), cache_rows(v_cache, cache_dtype, keys)
    expected = reference.attention(to_f64(q, dtype)[None], k, v, to_f64(gate, dtype)[None], offset=keys - 1)[0]
    return capacity, q, gate, k_cache, v_cache, expected


def _decode(run: Run, kernel: str, kv_heads: int, keys: int) -> None:
    dtype = dtype_of(kernel)
    d, per_group, heads = attention_layout(kernel)
    capacity, q, gate, k_cache, v_cache, expected = _decode_inputs(run, dtype, heads, kv_heads, keys, d)
    out = poisoned((heads, d), dtype)
    run.dispatch(kernel, [attention_args(1, heads, kv_heads, keys, capacity, d), q, gate, k_cache, v_cache, out],
                 heads // per_group, 128)
    run.compare("out", to_f64(out, dtype), expected, REL_RMS[dtype])


def block_partials(q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int, block: int):
    """Per block of keys: the softmax-normalised output [Hq, blocks, D] and (max score, sum of exp) [Hq, blocks, 2]."""
    heads = q.shape[0]
    kv = np.arange(heads) // group
    outs, stats = [], []
    for begin in range(0, k.shape[0], block):
        kb, vb = k[begin : begin + block][:, kv], v[begin : begin + block][:, kv]  # [n, Hq, D]
        scores = np.einsum("hd,nhd->hn", q, kb) * q.shape[1] ** -0.5
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        outs.append(np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), vb))
        stats.append(np.stack([top[:, 0], weights.sum(axis=1)], axis=-1))
    return np.stack(outs, axis=1), np.stack(stats, axis=1)


def _split(run: Run, kernel: str, kv_heads: int, keys: int, block: int) -> None:
    """Split-KV decode: the partials of each block of keys (fp32), or the combine of exact partials."""
    dtype = dtype_of(kernel)
    d, per_group, heads = attention_layout(kernel)
    capacity, q, gate, k_cache, v_cache, expected = _decode_inputs(run, dtype, heads, kv_heads, keys, d)
    blocks = -(-keys // block)
    args = attention_args(1, heads, kv_heads, keys, capacity, d, block, blocks)
    cache_dtype = CACHE_DTYPE[dtype]
    k, v = cache_rows(k_cache, cache_dtype, keys), cache_rows(v_cache, cache_dtype, keys)
    part_out, part_stats = block_partials(to_f64(q, dtype), k, v, heads // kv_heads, block)
    if "_partial" in kernel:
        out = np.full((heads, blocks, d), np.nan, np.float32)
        stats = np.full((heads, blocks, 2), np.nan, np.float32)
        run.dispatch(kernel, [args, q, k_cache, v_cache, out, stats], (heads // per_group, blocks, 1), 64)
        run.compare("partial out", out, part_out, REL_RMS["f32"])
        run.compare("partial (max, sum)", stats, part_stats, REL_RMS["f32"])
        return
    out = poisoned((heads, d), dtype)
    run.dispatch(kernel, [args, gate, part_out.astype(np.float32), part_stats.astype(np.float32), out], heads, 64)
    run.compare("out", to_f64(out, dtype), expected, REL_RMS[dtype])


def cases(kernel: str) -> list[Case]:
    """Every case of one decode attention kernel; the first is the self-test's."""
    d, _, heads = attention_layout(kernel)
    if "_partial" in kernel or "_combine_" in kernel:
        return [Case(kernel, f"Hq={heads} Hkv=2 S=45 block=16 D={d}",
                     partial(_split, kernel=kernel, kv_heads=2, keys=45, block=16), quick=True)]
    return [Case(kernel, f"Hq={heads} Hkv=2 S=45 D={d}", partial(_decode, kernel=kernel, kv_heads=2, keys=45),
                 quick=True)]
