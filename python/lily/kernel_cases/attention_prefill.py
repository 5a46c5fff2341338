"""Cases of metal/attention_prefill.metal against ``lily.reference.attention``, and of ``simdgroup_layout_probe``, the
lane layout of ``thread_elements()`` the mma kernel assumes.

A chunk of T queries over a KV cache [Hkv, capacity, D] that holds `offset` keys of earlier chunks and the chunk's own
T keys; query t sits at position offset + t (causal). attention_prefill (vector ALUs): first chunks of 31/32/33
queries (query tiles with a partial last one), chunks continuing a cache (offsets 17 and 40: partial key tiles, tiles
only some queries see), the model's GQA 8, 1, 3, 4 and 8 simdgroups per threadgroup. attention_prefill_mma (8x8
simdgroup matrices, key tiles of `mma_tile_keys` keys): chunks of 3 to 33 queries (partial 8-query fragments), key
counts one below, at and one above the tile width, chunks whose first tiles lie wholly before the causal diagonal
(offsets past a tile) and chunks over three or more tiles (the register prefetch of the next tile), the model's GQA
8 and a group of 16 (two threadgroups per KV head). attention_prefill_mma_split (grid z: key blocks, each writing a
partial that attention_decode_combine merges over T x Hq rows) runs block counts whose spans of whole tiles leave an
empty last block, a block boundary exactly at the first query's position (the last block then holds only the
diagonal tile), query threadgroups whose shared keys end in different blocks, 64 blocks over a few tiles (most of
them empty) and two threadgroups per KV head; its partials start NaN, so a partial a block leaves unwritten poisons
the combined output. The head-dim-64 instances run the demo model's 4/2 heads and the
gqa4 fixture's 8/2; the *_unpacked_* instances (one head per threadgroup, the engine's fallback) run head ratios 3
and 1, and ratio 4 at head dim 256 (which the mma kernel's packing of 8 cannot split), around their tile width too.
Outputs start NaN-poisoned and the cache's spare rows hold NaN, so a key read past the causal limit is caught.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.attention import (CACHE_DTYPE, COMBINE_SLICE, COMBINE_THREADS, ROUNDING_UNIT, attention_args,
                                         attention_layout, cache_rows, kv_cache, tolerance)
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, round_to, to_device, to_f64

PATTERN = re.compile(r"attention_prefill(_mma)?_(unpacked_|split_)?(f32|f16|bf16)_d(256|64)|simdgroup_layout_probe")
MMA_QUERIES = 8  # query tokens per attention_prefill_mma threadgroup (LILY_ATTN_MMA_QUERIES)
# Query heads per attention_prefill_mma threadgroup by head dim (LILY_ATTN_MMA_HEADS_PER_GROUP, ..._D64); the vector
# kernel packs attention.HEADS_PER_GROUP.
MMA_HEADS_PER_GROUP = {256: 8, 64: 2}
# Most keys and bytes of one K (or V) tile of attention_prefill_mma (LILY_ATTN_MMA_TILE_KEYS, ..._TILE_BYTES).
MMA_TILE_KEYS, MMA_TILE_BYTES = 32, 16384
CACHE_BYTES = {"f32": 4, "bf16": 2}
# (heads, kv_heads, queries, offset, simdgroups) of the packed vector kernel by head dim; the first is the self-test's.
SHAPES = {
    256: [(16, 2, 12, 21, 4), (8, 2, 31, 0, 8), (8, 2, 32, 0, 8), (8, 2, 33, 0, 8),
          (8, 2, 5, 17, 3),  # a short chunk after an earlier one; key tiles end mid-chunk
          (16, 2, 12, 40, 8),  # the model's GQA 8; offset 40 is not a multiple of either tile size
          (4, 1, 3, 0, 1),  # one simdgroup per threadgroup
          (8, 2, 1, 9, 8)],  # a one-token chunk: seven spare simdgroups only load and meet barriers
    64: [(4, 2, 12, 21, 4), (4, 2, 33, 0, 8),
         (4, 2, 5, 40, 3),  # continuing a cache: the f32 key tile ends before the chunk
         (8, 2, 7, 17, 8), (2, 1, 2, 0, 1)],
}
# Head ratios 3 and 1, which no packed group of 2 or 4 splits, for every unpacked instance.
UNPACKED_SHAPES = [(6, 2, 9, 0, 4), (6, 2, 5, 17, 3), (3, 3, 12, 5, 8), (2, 2, 2, 0, 1)]


def mma_tile_keys(head_dim: int, cache_dtype: str) -> int:
    """Keys per attention_prefill_mma tile (lily::attn_mma_tile_keys): 32 in bf16 and 16 in f32 at D = 256."""
    return min(MMA_TILE_KEYS, MMA_TILE_BYTES // (head_dim * CACHE_BYTES[cache_dtype]))


def mma_shapes(head_dim: int, cache_dtype: str, packed: bool) -> list[tuple[int, int, int, int, int]]:
    """(heads, kv_heads, queries, offset, 0) of an mma kernel, around its tile width `bk`; the first is the
    self-test's. The mma kernels take one simdgroup per packed head: their simdgroup count is not a parameter."""
    bk = mma_tile_keys(head_dim, cache_dtype)
    if not packed:
        ratio3, ratio1, last = (6, 2), (3, 3), ((8, 2) if head_dim == 256 else (2, 2))  # ratio 4 at D = 256
        return [(*ratio3, 12, 21, 0), (*ratio3, 9, 0, 0),
                (*ratio1, 9, bk - 10, 0), (*ratio3, 5, bk - 5, 0), (*last, 9, bk - 8, 0),  # bk - 1, bk, bk + 1 keys
                (*last, 9, 2 * bk - 8, 0),  # three tiles, copied after each tile's barrier
                (*ratio3, 7, 40, 0)]
    h, kv = (16, 2) if head_dim == 256 else (4, 2)  # the model's GQA 8; the demo model's 2
    # One KV head (D = 64: the gqa4 fixture's ratio), and more heads than one threadgroup packs per KV head.
    other_ratios = [(8, 1, 11, 3, 0), (32, 2, 10, 6, 0)] if head_dim == 256 else [(8, 2, 11, 3, 0), (8, 1, 10, 6, 0)]
    return [(h, kv, 12, 21, 0),
            (h, kv, 7, 0, 0), (h, kv, 8, 0, 0), (h, kv, 9, 0, 0),  # a partial fragment, a full one, one more query
            (h, kv, 9, bk - 10, 0), (h, kv, 9, bk - 9, 0), (h, kv, 9, bk - 8, 0),  # bk - 1, bk and bk + 1 keys
            (h, kv, 33, 0, 0),  # a first chunk over two tiles: every threadgroup's last tile is on the diagonal
            (h, kv, 12, bk + 8, 0),  # continuing a cache: whole tiles before the diagonal, no mask there
            (h, kv, 16, 3 * bk - 8, 0),  # four tiles: the next tile's K/V fetched during this tile's MMAs
            (h, kv, 3, 5, 0),  # a chunk shorter than the fragment continuing a cache
            *other_ratios]


def split_shapes(head_dim: int, cache_dtype: str) -> list[tuple[int, int, int, int, int]]:
    """(heads, kv_heads, queries, offset, blocks) of a split kernel around its tile width `bk`; the first is the
    self-test's."""
    bk = mma_tile_keys(head_dim, cache_dtype)
    h, kv = (16, 2) if head_dim == 256 else (4, 2)
    more_heads = (32, 2) if head_dim == 256 else (8, 2)
    return [(h, kv, 12, 5 * bk - 3, 3),
            (h, kv, 8, 4 * bk + 1, 4),  # spans of 2 tiles: the third block takes 2 shared keys and the diagonal, the
                                        # fourth is empty
            (h, kv, 8, 2 * bk - 1, 2),  # the boundary at the first query's position: block 1 is the diagonal tile
            (h, kv, 20, 3 * bk, 2),  # three query threadgroups, each splitting its own shared keys
            (h, kv, 9, bk - 3, 64),  # the combine's most blocks over 2 tiles: 62 empty
            (*more_heads, 11, 2 * bk + 5, 3)]  # two threadgroups per KV head


def _layout_probe(run: Run, kernel: str) -> None:
    """Apple does not specify the lane layout of thread_elements(); where the device's differs from what the kernels'
    attn_mma_row/col assume, the engine runs prefill attention on the vector kernel, and this case fails to say so.
    The assumed layout must also be a layout: every element of the 8x8 matrix held by exactly one lane."""
    out = np.full((64, 2), np.nan, np.float32)
    run.dispatch(kernel, [out], 1, 32)
    held, assumed = (np.where(np.isfinite(out[rows]), out[rows], -1).astype(np.int64) for rows in (slice(0, 32),
                                                                                                   slice(32, 64)))
    run.compare_exact("element index per lane", held, assumed)
    run.compare_exact("elements the assumed layout covers", np.sort(assumed, axis=None), np.arange(64))


def _chunk(run: Run, dtype: str, heads: int, kv_heads: int, queries: int, offset: int, d: int):
    """Random q and gate [T, Hq, D] and a cache of offset + T keys (spare rows NaN): (q, gate, k_cache, v_cache,
    keys, capacity)."""
    keys = offset + queries
    capacity = keys + 4
    q = to_device(2.0 * run.rng.standard_normal((queries, heads, d)), dtype)
    gate = to_device(2.0 * run.rng.standard_normal((queries, heads, d)), dtype)
    k_cache = kv_cache(run.rng, CACHE_DTYPE[dtype], kv_heads, keys, capacity, d)
    v_cache = kv_cache(run.rng, CACHE_DTYPE[dtype], kv_heads, keys, capacity, d)
    return q, gate, k_cache, v_cache, keys, capacity


def _compare_out(run: Run, out, q, gate, k_cache, v_cache, dtype: str, keys: int, offset: int, mma: bool,
                 widen: float = 1.0) -> None:
    """`out` against the reference; the mma kernels' P·V takes the probabilities rounded to the cache dtype (its MMA
    operands): each output moves by up to a rounding of sum_k p_k |v_k| / sum_k p_k (times the gate), however small
    the output itself is."""
    cache_dtype = CACHE_DTYPE[dtype]
    keys_f64, values_f64 = cache_rows(k_cache, cache_dtype, keys), cache_rows(v_cache, cache_dtype, keys)
    expected = reference.attention(to_f64(q, dtype), keys_f64, values_f64, to_f64(gate, dtype), offset=offset)
    allowance = None
    if mma and cache_dtype != "f32":
        magnitude = reference.attention(to_f64(q, dtype), keys_f64, np.abs(values_f64), to_f64(gate, dtype),
                                        offset=offset)
        allowance = ROUNDING_UNIT[cache_dtype] * np.abs(magnitude)
    run.compare("out", to_f64(out, dtype), round_to(expected, dtype), tolerance(dtype, widen), allowance)


def _prefill(run: Run, kernel: str, heads: int, kv_heads: int, queries: int, offset: int, simdgroups: int) -> None:
    dtype = dtype_of(kernel)
    d, per_group, _ = attention_layout(kernel)
    mma = "_mma_" in kernel
    if mma and "_unpacked_" not in kernel:
        per_group = MMA_HEADS_PER_GROUP[d]
    q, gate, k_cache, v_cache, keys, capacity = _chunk(run, dtype, heads, kv_heads, queries, offset, d)
    out = poisoned((queries, heads, d), dtype)
    queries_per_group = MMA_QUERIES if mma else simdgroups
    run.dispatch(kernel, [attention_args(queries, heads, kv_heads, keys, capacity, scale=d**-0.5), q, gate, k_cache,
                          v_cache, out],
                 (-(-queries // queries_per_group), heads // per_group, 1), 32 * (per_group if mma else simdgroups))
    _compare_out(run, out, q, gate, k_cache, v_cache, dtype, keys, offset, mma)


def _split(run: Run, kernel: str, heads: int, kv_heads: int, queries: int, offset: int, blocks: int) -> None:
    """The split kernel over `blocks` key blocks, then its head dim's combine over the T x Hq rows, against the
    reference (the mma kernel's bf16 allowance)."""
    dtype = dtype_of(kernel)
    d = attention_layout(kernel)[0]
    q, gate, k_cache, v_cache, keys, capacity = _chunk(run, dtype, heads, kv_heads, queries, offset, d)
    args = attention_args(queries, heads, kv_heads, keys, capacity, num_blocks=blocks, scale=d**-0.5)
    partial_out = np.full((queries * heads, blocks, d), np.nan, np.float32)
    partial_stats = np.full((queries * heads, blocks, 2), np.nan, np.float32)
    run.dispatch(kernel, [args, q, k_cache, v_cache, partial_out, partial_stats],
                 (-(-queries // MMA_QUERIES), heads // MMA_HEADS_PER_GROUP[d], blocks), 32 * MMA_HEADS_PER_GROUP[d])
    out = poisoned((queries, heads, d), dtype)
    run.dispatch(f"attention_decode_combine_{dtype}_d{d}", [args, gate, partial_out, partial_stats, out],
                 (queries * heads, -(-d // COMBINE_SLICE), 1), COMBINE_THREADS)
    # f32: the single pass's error (up to 2.6e-6 on these shapes, as much as its own tolerance) plus the combine's
    # roundings of each block's normalised output.
    _compare_out(run, out, q, gate, k_cache, v_cache, dtype, keys, offset, mma=True, widen=2.0)


def cases(kernel: str) -> list[Case]:
    """Every case of one prefill attention kernel (or the layout probe); the first is the self-test's."""
    if kernel == "simdgroup_layout_probe":
        return [Case(kernel, "32 lanes x 2 elements", partial(_layout_probe, kernel=kernel), quick=True)]
    d, _, heads = attention_layout(kernel)
    if "_split_" in kernel:
        return [Case(kernel, f"Hq={h} Hkv={kv} T={t} offset={o} blocks={b} D={d}",
                     partial(_split, kernel=kernel, heads=h, kv_heads=kv, queries=t, offset=o, blocks=b), quick=i == 0)
                for i, (h, kv, t, o, b) in enumerate(split_shapes(d, CACHE_DTYPE[dtype_of(kernel)]))]
    mma, packed = "_mma_" in kernel, "_unpacked_" not in kernel
    if mma:
        shapes = mma_shapes(d, CACHE_DTYPE[dtype_of(kernel)], packed)
    else:
        shapes = SHAPES[d] if packed else [(heads, 2, 12, 21, 4)] + UNPACKED_SHAPES
    return [Case(kernel, f"Hq={h} Hkv={kv} T={t} offset={o}" + ("" if mma else f" simdgroups={sg}") + f" D={d}",
                 partial(_prefill, kernel=kernel, heads=h, kv_heads=kv, queries=t, offset=o, simdgroups=sg),
                 quick=i == 0) for i, (h, kv, t, o, sg) in enumerate(shapes)]
