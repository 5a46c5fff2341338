"""Cases of metal/moe_prefill.metal (prefill MoE) against numpy's stable sort and ``lily.reference.qmatmul``.

The sort kernels (count, scan, scatter) are checked exactly against a numpy construction of the block counts, the
expert offsets, the sorted (token, slot) order and the block map, on routings with rows per expert 0, 1, 15, 16, 17,
31, 32, 33 (both tile sizes' boundaries), random routings over one to three sort blocks and E up to 256, and every
row on the same experts (the maximum tile waste). The grouped gate/up and down GEMMs run at both tile sizes, every
dtype and scale type, on the boundary routing and a random one; the combine sums the slots in slot order with the
gated shared expert and the residual, also in place. Outputs start NaN-poisoned.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, round_to, scale_dtype_of, to_device, to_f64
from lily.kernel_cases.moe import compare_dot, moe_args, quantized_weight, sigmoid64, silu64

PATTERN = re.compile(r"moe_sort_(count|scan|scatter)_u32|moe_gemm_(gate_up|down)_(f32|f16|bf16)(_sf32)?_bm(16|32)"
                     r"|moe_combine_(f32|f16|bf16)")
SORT_BLOCK = 256  # LILY_MOE_SORT_BLOCK
GEMM_BN, GEMM_THREADS = 64, 128  # LILY_GEMM_BN, LILY_GEMM_THREADS
# Rows per expert at every tile boundary; the remaining experts share what is left of T·k.
BOUNDARY_COUNTS = [0, 1, 15, 16, 17, 31, 32, 33]
# Routings of the sort cases: (name, T, E, k); "boundary" forces BOUNDARY_COUNTS, "same" puts every row on the same
# k experts, "random" draws random logits (top-k of them). The first is the self-test's.
ROUTINGS = [("random", 70, 32, 4), ("boundary", 48, 16, 4), ("random", 1, 64, 8), ("random", 33, 64, 8),
            ("random", 40, 64, 8), ("random", 70, 256, 8), ("same", 70, 256, 8)]
# (routing, H, I) of the grouped GEMMs.
GEMM_SHAPES = [(("random", 70, 32, 4), 128, 64), (("boundary", 48, 16, 4), 128, 64)]


def routing_for_counts(rng: np.random.Generator, counts: list[int], num_rows: int, top_k: int) -> np.ndarray:
    """Expert ids [T, k] (k distinct experts per row) in which expert e is chosen by exactly counts[e] rows.

    Greedy: each row takes the k experts with the most assignments left, which always succeeds while no count
    exceeds the rows left. Rows are shuffled afterwards so experts are spread over the chunk.
    """
    left = np.array(counts, dtype=np.int64)
    assert left.sum() == num_rows * top_k and left.max() <= num_rows, "counts must fill T·k with at most T per expert"
    ids = np.empty((num_rows, top_k), dtype=np.int64)
    for row in range(num_rows):
        order = np.lexsort((np.arange(len(left)), -left))[:top_k]
        assert (left[order] > 0).all(), "counts are not realisable"
        ids[row] = rng.permutation(order)
        left[order] -= 1
    return ids[rng.permutation(num_rows)]


def logits_for_routing(rng: np.random.Generator, ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Router logits [T, E] whose top-k are exactly `ids`, in that order, with clear gaps (no near-ties)."""
    num_rows, top_k = ids.shape
    logits = rng.uniform(-3.0, 1.0, (num_rows, num_experts))
    for row in range(num_rows):
        logits[row, ids[row]] = 2.0 + 0.5 * np.arange(top_k)[::-1] + rng.uniform(0.0, 0.2, top_k)
    return logits.astype(np.float32)


def boundary_counts(num_experts: int, num_rows: int, top_k: int) -> list[int]:
    """BOUNDARY_COUNTS at scattered expert ids, the rest of T·k spread over the other experts."""
    rest = num_rows * top_k - sum(BOUNDARY_COUNTS)
    others = num_experts - len(BOUNDARY_COUNTS)
    counts = BOUNDARY_COUNTS + [rest // others + (1 if i < rest % others else 0) for i in range(others)]
    order = np.random.default_rng(num_experts).permutation(num_experts)
    return [counts[i] for i in np.argsort(order)]


def expert_ids(rng: np.random.Generator, kind: str, num_rows: int, num_experts: int, top_k: int) -> np.ndarray:
    """Expert ids [T, k] of one routing kind (see ROUTINGS)."""
    if kind == "boundary":
        return routing_for_counts(rng, boundary_counts(num_experts, num_rows, top_k), num_rows, top_k)
    if kind == "same":
        return np.tile(rng.choice(num_experts, top_k, replace=False), (num_rows, 1))
    return np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_rows)])


def sort_products(ids: np.ndarray, num_experts: int, tile_rows: int) -> dict:
    """What the sort kernels build, in numpy: block counts, per-block offsets within each expert, expert offsets,
    the stable sort of the (token, slot) pairs by expert, the block map and its tile count."""
    flat = ids.reshape(-1).astype(np.int64)
    blocks = -(-flat.size // SORT_BLOCK)
    block_counts = np.stack([np.bincount(flat[b * SORT_BLOCK : (b + 1) * SORT_BLOCK], minlength=num_experts)
                             for b in range(blocks)]).astype(np.uint32)
    counts = block_counts.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    tiles = [(e, offsets[e] + first, min(tile_rows, counts[e] - first), 0)
             for e in range(num_experts) for first in range(0, counts[e], tile_rows)]
    max_tiles = -(-flat.size // tile_rows) + min(num_experts, flat.size)  # the grouped GEMM's grid bound
    tile_map = np.zeros((max_tiles, 4), np.uint32)
    tile_map[: len(tiles)] = np.array(tiles, np.uint32).reshape(-1, 4)
    return {"ids": np.ascontiguousarray(ids, np.uint32), "block_counts": block_counts,
            "block_offsets": (np.cumsum(block_counts, axis=0) - block_counts).astype(np.uint32), "offsets": offsets,
            "sorted_pairs": np.argsort(flat, kind="stable").astype(np.uint32), "tile_map": tile_map,
            "tile_count": np.array([len(tiles)], np.uint32), "max_tiles": max_tiles}


def _sort(run: Run, kernel: str, routing: tuple, tile_rows: int) -> None:
    kind, rows, experts, k = routing
    r = sort_products(expert_ids(run.rng, kind, rows, experts, k), experts, tile_rows)
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


def _gemm(run: Run, kernel: str, routing: tuple, hidden: int, expert: int) -> None:
    """gate/up: SwiGLU rows in sorted order; down: routing-weighted rows in (token, slot) order. The kernels stage the
    dequantized weights in the activation dtype, as MLX does: the reference rounds them too."""
    kind, rows, experts, k = routing
    dtype, scales, tile_rows = dtype_of(kernel), scale_dtype_of(kernel), int(kernel[-2:])
    r = sort_products(expert_ids(run.rng, kind, rows, experts, k), experts, tile_rows)
    weights = run.rng.dirichlet(np.ones(k), rows).astype(np.float32).reshape(-1)
    args = moe_args(rows, experts, k, hidden, expert, 0, tile_rows, r["max_tiles"])
    tiles = [r["sorted_pairs"], r["tile_map"], r["tile_count"]]
    flat_ids, pairs = r["ids"].reshape(-1).astype(np.int64), r["sorted_pairs"].astype(np.int64)
    if "_gate_up_" in kernel:
        gate = quantized_weight(run.rng, (experts, expert, hidden), scales)
        up = quantized_weight(run.rng, (experts, expert, hidden), scales)
        x = to_device(run.rng.standard_normal((rows, hidden)), dtype)
        h = poisoned((pairs.size, expert), dtype)
        run.dispatch(kernel, [args, x, *tiles, *gate.buffers(), *up.buffers(), h],
                     (expert // GEMM_BN, r["max_tiles"], 1), GEMM_THREADS)
        xs = to_f64(x, dtype).astype(np.float32)
        gate_w, up_w = (round_to(w.dense, dtype).astype(np.float32) for w in (gate, up))
        expected = np.stack([silu64(reference.qmatmul(xs[p // k], gate_w[flat_ids[p]]))
                             * reference.qmatmul(xs[p // k], up_w[flat_ids[p]]) for p in pairs])
        compare_dot(run, "h (sorted order)", to_f64(h, dtype), round_to(expected, dtype), dtype)
        return
    down = quantized_weight(run.rng, (experts, hidden, expert), scales)
    h = to_device(run.rng.standard_normal((pairs.size, expert)), dtype)  # sorted order
    y = poisoned((pairs.size, hidden), dtype)
    run.dispatch(kernel, [args, h, *tiles, weights, *down.buffers(), y], (hidden // GEMM_BN, r["max_tiles"], 1),
                 GEMM_THREADS)
    hs = to_f64(h, dtype).astype(np.float32)
    down_w = round_to(down.dense, dtype).astype(np.float32)
    expected = np.empty((pairs.size, hidden))
    for pos, pair in enumerate(pairs):
        expected[pair] = float(weights[pair]) * reference.qmatmul(hs[pos], down_w[flat_ids[pair]])
    compare_dot(run, "expert_out (pair order)", to_f64(y, dtype), round_to(expected, dtype), dtype)


def _combine(run: Run, kernel: str, rows: int, k: int, hidden: int, threads: int) -> None:
    """Slots summed in slot order, plus the gated shared expert and the residual; out may alias residual."""
    dtype, rng = dtype_of(kernel), run.rng
    y = to_device(0.3 * rng.standard_normal((rows * k, hidden)), dtype)
    shared_out = to_device(rng.standard_normal((rows, hidden)), dtype)
    gate_logits = (3.0 * rng.standard_normal(rows)).astype(np.float32)
    residual = to_device(2.0 * rng.standard_normal((rows, hidden)), dtype)
    out = poisoned((rows, hidden), dtype)
    args = moe_args(rows, 32, k, hidden, 0)
    grid = (-(-hidden // threads), rows, 1)  # threads not a divisor of H: the last threadgroup of a row is partial
    run.dispatch(kernel, [args, y, shared_out, gate_logits, residual, out], grid, threads)
    expected = (to_f64(residual, dtype) + to_f64(y, dtype).reshape(rows, k, hidden).sum(axis=1)
                + sigmoid64(gate_logits)[:, None] * to_f64(shared_out, dtype))
    run.compare("out", to_f64(out, dtype), round_to(expected, dtype), dtype)
    run.dispatch(kernel, [args, y, shared_out, gate_logits, residual, residual], grid, threads)
    run.compare_exact("in place == separate (bits)", residual.view(np.uint8), out.view(np.uint8))


def cases(kernel: str) -> list[Case]:
    """Every case of one MoE prefill kernel; the first is the self-test's."""
    if kernel.startswith("moe_sort_"):
        return [Case(kernel, f"{kind} T={t} E={e} k={k} bm={bm}",
                     partial(_sort, kernel=kernel, routing=(kind, t, e, k), tile_rows=bm), quick=i == 0 and bm == 16)
                for i, (kind, t, e, k) in enumerate(ROUTINGS) for bm in (16, 32)]
    if kernel.startswith("moe_combine_"):
        return [Case(kernel, "T=5 k=8 H=200 threads=96",
                     partial(_combine, kernel=kernel, rows=5, k=8, hidden=200, threads=96), quick=True)]
    return [Case(kernel, f"{kind} T={t} E={e} k={k} H={h} I={i}",
                 partial(_gemm, kernel=kernel, routing=(kind, t, e, k), hidden=h, expert=i), quick=n == 0)
            for n, ((kind, t, e, k), h, i) in enumerate(GEMM_SHAPES)]
