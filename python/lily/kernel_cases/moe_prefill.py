"""Cases of metal/moe_prefill.metal (prefill: the counting sort of (token, slot) pairs by expert, the grouped
gate/up and down GEMMs over expert tiles, the combine with the shared expert and the residual) against numpy's
stable sort and ``lily.reference.qmatmul``."""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, quantized_weight, to_device, to_f64
from lily.kernel_cases.moe import SHAPE, moe_args, silu64

PATTERN = re.compile(r"moe_sort_(count|scan|scatter)_u32|moe_gemm_(gate_up|down)_(f32|f16|bf16)(_sf32)?_bm(16|32)"
                     r"|moe_combine_(f32|f16|bf16)")
SORT_BLOCK = 256  # LILY_MOE_SORT_BLOCK
GEMM_BN, GEMM_THREADS = 64, 128  # LILY_MOE_GEMM_BN, LILY_MOE_GEMM_THREADS


def routing(rng: np.random.Generator, rows: int, experts: int, k: int, tile_rows: int) -> dict:
    """Random distinct expert ids [T, k], softmax-like weights, and the numpy sort products the kernels build."""
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]).astype(np.uint32)
    weights = rng.dirichlet(np.ones(k), rows).astype(np.float32)
    flat = ids.reshape(-1).astype(np.int64)
    blocks = -(-flat.size // SORT_BLOCK)
    block_counts = np.stack([np.bincount(flat[b * SORT_BLOCK : (b + 1) * SORT_BLOCK], minlength=experts)
                             for b in range(blocks)]).astype(np.uint32)
    counts = block_counts.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    block_offsets = (np.cumsum(block_counts, axis=0) - block_counts).astype(np.uint32)  # within each expert
    tiles = [(e, offsets[e] + first, min(tile_rows, counts[e] - first), 0)
             for e in range(experts) for first in range(0, counts[e], tile_rows)]
    max_tiles = -(-flat.size // tile_rows) + min(experts, flat.size)
    tile_map = np.zeros((max_tiles, 4), np.uint32)
    tile_map[: len(tiles)] = np.array(tiles, np.uint32).reshape(-1, 4)
    return {
        "ids": ids, "weights": weights, "block_counts": block_counts, "block_offsets": block_offsets,
        "offsets": offsets, "sorted_pairs": np.argsort(flat, kind="stable").astype(np.uint32),
        "tile_map": tile_map, "tile_count": np.array([len(tiles)], np.uint32), "max_tiles": max_tiles,
    }


def _sort(run: Run, kernel: str, rows: int, experts: int, k: int, tile_rows: int) -> None:
    r = routing(run.rng, rows, experts, k, tile_rows)
    args = moe_args(rows, experts, k, 0, 0, 0, tile_rows, r["max_tiles"])
    blocks = r["block_counts"].shape[0]
    if "_count_" in kernel:
        block_counts = np.full(r["block_counts"].shape, 0xFFFFFFFF, np.uint32)
        run.dispatch(kernel, [args, r["ids"], block_counts], blocks, SORT_BLOCK)
        run.compare_exact("block counts", block_counts, r["block_counts"])
    elif "_scan_" in kernel:
        block_counts = r["block_counts"].copy()  # becomes the per-block offsets within each expert
        offsets = np.full(experts + 1, 0xFFFFFFFF, np.uint32)
        tile_map = np.full((r["max_tiles"], 4), 0xFFFFFFFF, np.uint32)
        tile_count = np.full(1, 0xFFFFFFFF, np.uint32)
        run.dispatch(kernel, [args, block_counts, offsets, tile_map, tile_count], 1, 256)
        tiles = int(r["tile_count"][0])
        run.compare_exact("block offsets", block_counts, r["block_offsets"])
        run.compare_exact("expert offsets", offsets, r["offsets"])
        run.compare_exact("tile count", tile_count, r["tile_count"])
        run.compare_exact("tile map", tile_map[:tiles], r["tile_map"][:tiles])
    else:
        sorted_pairs = np.full(rows * k, 0xFFFFFFFF, np.uint32)
        run.dispatch(kernel, [args, r["ids"], r["block_offsets"], r["offsets"], sorted_pairs], blocks, SORT_BLOCK)
        run.compare_exact("sorted pairs", sorted_pairs, r["sorted_pairs"])


def _gemm(run: Run, kernel: str, tile_rows: int) -> None:
    dtype, rng = dtype_of(kernel), run.rng
    rows, experts, k, hidden, expert, _ = SHAPE
    r = routing(rng, rows, experts, k, tile_rows)
    args = moe_args(rows, experts, k, hidden, expert, 0, tile_rows, r["max_tiles"])
    tiles = [r["sorted_pairs"], r["tile_map"], r["tile_count"]]
    flat_ids = r["ids"].reshape(-1).astype(np.int64)
    pairs = r["sorted_pairs"].astype(np.int64)
    if "_gate_up_" in kernel:
        gate, gate_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
        up, up_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
        x = to_device(rng.standard_normal((rows, hidden)), dtype)
        h = poisoned((pairs.size, expert), dtype)
        run.dispatch(kernel, [args, x, *tiles, *gate_buffers, *up_buffers, h],
                     (expert // GEMM_BN, r["max_tiles"], 1), GEMM_THREADS)
        xs = to_f64(x, dtype).astype(np.float32)
        g_all, u_all = gate.dequantize(), up.dequantize()
        expected = np.stack([silu64(reference.qmatmul(xs[p // k], g_all[flat_ids[p]]).astype(np.float64))
                             * reference.qmatmul(xs[p // k], u_all[flat_ids[p]]) for p in pairs])
        run.compare("h (sorted order)", to_f64(h, dtype), expected, REL_RMS[dtype])
        return
    down, down_buffers = quantized_weight(kernel, (experts, hidden, expert), rng)
    h = to_device(rng.standard_normal((pairs.size, expert)), dtype)  # sorted order
    y = poisoned((pairs.size, hidden), dtype)
    run.dispatch(kernel, [args, h, *tiles, r["weights"].reshape(-1), *down_buffers, y],
                 (hidden // GEMM_BN, r["max_tiles"], 1), GEMM_THREADS)
    hs, d_all, w = to_f64(h, dtype).astype(np.float32), down.dequantize(), r["weights"].reshape(-1)
    expected = np.empty((pairs.size, hidden))
    for pos, pair in enumerate(pairs):
        expected[pair] = float(w[pair]) * reference.qmatmul(hs[pos], d_all[flat_ids[pair]])
    run.compare("expert_out (pair order)", to_f64(y, dtype), expected, REL_RMS[dtype])


def _combine(run: Run, kernel: str, rows: int, k: int, hidden: int, threads: int) -> None:
    dtype, rng = dtype_of(kernel), run.rng
    y = to_device(0.3 * rng.standard_normal((rows * k, hidden)), dtype)
    shared_out = to_device(rng.standard_normal((rows, hidden)), dtype)
    gate_logits = (3.0 * rng.standard_normal(rows)).astype(np.float32)
    residual = to_device(2.0 * rng.standard_normal((rows, hidden)), dtype)
    out = poisoned((rows, hidden), dtype)
    run.dispatch(kernel, [moe_args(rows, 32, k, hidden, 0), y, shared_out, gate_logits, residual, out],
                 (-(-hidden // threads), rows, 1), threads)
    expected = (to_f64(residual, dtype) + to_f64(y, dtype).reshape(rows, k, hidden).sum(axis=1)
                + to_f64(shared_out, dtype) / (1.0 + np.exp(-gate_logits.astype(np.float64)))[:, None])
    run.compare("out", to_f64(out, dtype), expected, REL_RMS[dtype])


def cases(kernel: str) -> list[Case]:
    """Every case of one MoE prefill kernel; the first is the self-test's."""
    rows, experts, k, hidden, expert, _ = SHAPE
    if kernel.startswith("moe_sort_"):
        return [Case(kernel, f"T={rows} E={experts} k={k} bm=16",
                     partial(_sort, kernel=kernel, rows=rows, experts=experts, k=k, tile_rows=16), quick=True)]
    if kernel.startswith("moe_combine_"):
        return [Case(kernel, "T=5 k=8 H=200", partial(_combine, kernel=kernel, rows=5, k=8, hidden=200, threads=96),
                     quick=True)]
    bm = int(kernel[-2:])
    return [Case(kernel, f"T={rows} E={experts} k={k} H={hidden} I={expert} bm={bm}",
                 partial(_gemm, kernel=kernel, tile_rows=bm), quick=True)]
