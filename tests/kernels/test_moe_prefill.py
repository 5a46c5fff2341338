"""metal/moe_prefill.metal (prefill MoE): every case of lily.kernel_cases.moe_prefill (each sort kernel exactly on
boundary, random and degenerate routings; the grouped GEMMs at both tile sizes, every dtype and scale type; the
combine, also in place), then what the cases do not cover: the GPU routing pipeline (moe_route_f32 ->
moe_sort_count -> moe_sort_scan -> moe_sort_scatter) end to end against numpy, the whole f32 chain against
residual + lily.reference.moe, and every buffer of the chain independent of the fiber schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily._ext import msl
from lily.kernel_cases.moe import compare_dot, moe_args, quantized_weight
from lily.kernel_cases.moe_prefill import (BOUNDARY_COUNTS, boundary_counts, logits_for_routing, routing_for_counts,
                                           sort_products)
from lily.kernel_cases.common import Run

DTYPES = ["f32", "bf16"]
SORT_BLOCK = 256  # LILY_MOE_SORT_BLOCK
GEMM_BN = 64  # LILY_GEMM_BN
GEMM_THREADS = 128  # LILY_GEMM_THREADS
# (activation dtype, scale/bias dtype, bm) -> host name
GATE_UP = {
    ("f32", "bf16", 16): "moe_gemm_gate_up_f32_bm16",
    ("f32", "bf16", 32): "moe_gemm_gate_up_f32_bm32",
    ("f32", "f32", 16): "moe_gemm_gate_up_f32_sf32_bm16",
    ("f32", "f32", 32): "moe_gemm_gate_up_f32_sf32_bm32",
    ("bf16", "bf16", 16): "moe_gemm_gate_up_bf16_bm16",
    ("bf16", "bf16", 32): "moe_gemm_gate_up_bf16_bm32",
    ("bf16", "f32", 16): "moe_gemm_gate_up_bf16_sf32_bm16",
    ("bf16", "f32", 32): "moe_gemm_gate_up_bf16_sf32_bm32",
}
DOWN = {
    ("f32", "bf16", 16): "moe_gemm_down_f32_bm16",
    ("f32", "bf16", 32): "moe_gemm_down_f32_bm32",
    ("f32", "f32", 16): "moe_gemm_down_f32_sf32_bm16",
    ("f32", "f32", 32): "moe_gemm_down_f32_sf32_bm32",
    ("bf16", "bf16", 16): "moe_gemm_down_bf16_bm16",
    ("bf16", "bf16", 32): "moe_gemm_down_bf16_bm32",
    ("bf16", "f32", 16): "moe_gemm_down_bf16_sf32_bm16",
    ("bf16", "f32", 32): "moe_gemm_down_bf16_sf32_bm32",
}
COMBINE = {"f32": "moe_combine_f32", "f16": "moe_combine_f16", "bf16": "moe_combine_bf16"}
class Routing:
    """The GPU routing pipeline's buffers for one chunk."""

    def __init__(self, logits: np.ndarray, top_k: int, tile_rows: int, seed: int = 0):
        num_rows, num_experts = logits.shape
        self.num_rows, self.num_experts, self.top_k, self.tile_rows = num_rows, num_experts, top_k, tile_rows
        pairs = num_rows * top_k
        self.max_tiles = -(-pairs // tile_rows) + min(num_experts, pairs)  # the grouped GEMM's grid bound
        blocks = -(-pairs // SORT_BLOCK)
        self.args = moe_args(num_rows, num_experts, top_k, 0, 0, 0, tile_rows, self.max_tiles)
        self.ids = np.full((num_rows, top_k), 0xFFFFFFFF, np.uint32)
        self.weights = np.full((num_rows, top_k), np.nan, np.float32)
        self.block_counts = np.full((blocks, num_experts), 0xFFFFFFFF, np.uint32)
        self.expert_offsets = np.full(num_experts + 1, 0xFFFFFFFF, np.uint32)
        self.tile_map = np.full((self.max_tiles, 4), 0xFFFFFFFF, np.uint32)
        self.tile_count = np.full(1, 0xFFFFFFFF, np.uint32)
        self.sorted_pairs = np.full(pairs, 0xFFFFFFFF, np.uint32)

        logits = np.ascontiguousarray(logits, np.float32)
        msl.dispatch("moe_route_f32", [self.args, logits, self.ids, self.weights], (num_rows, 1, 1), (32, 1, 1),
                     seed=seed)
        msl.dispatch("moe_sort_count_u32", [self.args, self.ids, self.block_counts], (blocks, 1, 1),
                     (SORT_BLOCK, 1, 1), seed=seed)
        msl.dispatch(
            "moe_sort_scan_u32",
            [self.args, self.block_counts, self.expert_offsets, self.tile_map, self.tile_count],
            (1, 1, 1),
            (256, 1, 1),
            seed=seed,
        )
        msl.dispatch(
            "moe_sort_scatter_u32",
            [self.args, self.ids, self.block_counts, self.expert_offsets, self.sorted_pairs],
            (blocks, 1, 1),
            (SORT_BLOCK, 1, 1),
            seed=seed,
        )

    def check_exact(self) -> None:
        expected = sort_products(self.ids.astype(np.int64), self.num_experts, self.tile_rows)
        tiles = int(expected["tile_count"][0])
        assert np.array_equal(self.expert_offsets, expected["offsets"]), "expert offsets"
        assert np.array_equal(self.sorted_pairs, expected["sorted_pairs"]), "sorted (token, slot) order"
        assert int(self.tile_count[0]) == tiles <= self.max_tiles, f"tile count {self.tile_count[0]}"
        assert np.array_equal(self.tile_map[:tiles], expected["tile_map"][:tiles]), "block map"


def forced_chunk(num_experts: int, num_rows: int, top_k: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = routing_for_counts(rng, boundary_counts(num_experts, num_rows, top_k), num_rows, top_k)
    return ids, logits_for_routing(rng, ids, num_experts)


@pytest.mark.parametrize("case", op_cases("moe_prefill"))
def test_moe_prefill(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("tile_rows", [16, 32])
def test_routing_forced_counts_exact(tile_rows: int) -> None:
    num_experts, num_rows, top_k = 16, 48, 4
    ids, logits = forced_chunk(num_experts, num_rows, top_k, seed=tile_rows)
    routing = Routing(logits, top_k, tile_rows)
    expected_ids, expected_weights = reference.moe_route(logits, top_k)
    assert np.array_equal(routing.ids.astype(np.int64), ids) and np.array_equal(expected_ids, ids)
    np.testing.assert_allclose(routing.weights, expected_weights, rtol=2e-6, atol=1e-7)
    counts = np.bincount(ids.reshape(-1), minlength=num_experts)
    assert sorted(set(BOUNDARY_COUNTS)) == sorted(set(counts[np.isin(counts, BOUNDARY_COUNTS)].tolist()))
    routing.check_exact()


RANDOM_CHUNKS = [(1, 64), (33, 64), (40, 64), (70, 256)]  # (T, E) at k = 8: 8 to 560 pairs, one to three sort blocks


@pytest.mark.parametrize("num_rows,num_experts", RANDOM_CHUNKS, ids=[f"T{t}-E{e}" for t, e in RANDOM_CHUNKS])
def test_routing_random_exact(num_rows: int, num_experts: int) -> None:
    """Random logits, top-8: the sorted order and block map across sort blocks and simdgroups of the expert scan."""
    rng = np.random.default_rng(num_rows + num_experts)
    logits = (rng.standard_normal((num_rows, num_experts)) * 2.0).astype(np.float32)
    for tile_rows in (16, 32):
        routing = Routing(logits, 8, tile_rows)
        assert np.array_equal(routing.ids.astype(np.int64), reference.moe_route(logits, 8)[0])
        routing.check_exact()


def test_routing_all_rows_one_expert_set() -> None:
    """Every row picks the same k experts: k experts of T rows each, all others empty (the maximum tile waste)."""
    num_rows, num_experts, top_k = 70, 256, 8
    ids = np.tile(np.array([255, 0, 128, 7, 64, 200, 1, 31]), (num_rows, 1))
    logits = logits_for_routing(np.random.default_rng(9), ids, num_experts)
    for tile_rows in (16, 32):
        routing = Routing(logits, top_k, tile_rows)
        routing.check_exact()


class PrefillLayer:
    """The stacked routed-expert weights of one layer."""

    def __init__(self, rng: np.random.Generator, num_experts: int, hidden: int, expert: int, kio,
                 scales: str = "bf16"):
        self.hidden, self.expert, self.scales = hidden, expert, scales
        self.gate = quantized_weight(rng, (num_experts, expert, hidden), scales)
        self.up = quantized_weight(rng, (num_experts, expert, hidden), scales)
        self.down = quantized_weight(rng, (num_experts, hidden, expert), scales)

    def gemm_args(self, routing: Routing) -> bytes:
        """The grouped-GEMM kernels' arguments for this layer's shapes under `routing` (no shared expert)."""
        return moe_args(routing.num_rows, routing.num_experts, routing.top_k, self.hidden, self.expert, 0,
                        routing.tile_rows, routing.max_tiles)


def run_gate_up(layer: PrefillLayer, routing: Routing, x: np.ndarray, dtype: str, kio, seed: int = 0) -> np.ndarray:
    pairs = routing.num_rows * routing.top_k
    h = kio.poisoned((pairs, layer.expert), dtype)
    args = layer.gemm_args(routing)
    msl.dispatch(
        GATE_UP[dtype, layer.scales, routing.tile_rows],
        [args, x, routing.sorted_pairs, routing.tile_map, routing.tile_count, *layer.gate.buffers(),
         *layer.up.buffers(), h],
        (layer.expert // GEMM_BN, routing.max_tiles, 1),
        (GEMM_THREADS, 1, 1),
        seed=seed,
    )
    return h


def run_down(layer: PrefillLayer, routing: Routing, h: np.ndarray, dtype: str, kio, seed: int = 0) -> np.ndarray:
    pairs = routing.num_rows * routing.top_k
    y = kio.poisoned((pairs, layer.hidden), dtype)
    args = layer.gemm_args(routing)
    msl.dispatch(
        DOWN[dtype, layer.scales, routing.tile_rows],
        [args, h, routing.sorted_pairs, routing.tile_map, routing.tile_count, routing.weights.reshape(-1),
         *layer.down.buffers(), y],
        (layer.hidden // GEMM_BN, routing.max_tiles, 1),
        (GEMM_THREADS, 1, 1),
        seed=seed,
    )
    return y


def run_combine(routing: Routing, y, shared_out, gate_logits, residual, out, hidden: int, dtype: str,
                seed: int = 0) -> None:
    args = moe_args(routing.num_rows, routing.num_experts, routing.top_k, hidden, 0)
    threads = 96  # not a divisor of H: the last threadgroup of each row is partial
    msl.dispatch(
        COMBINE[dtype],
        [args, y, shared_out, gate_logits, residual, out],
        (-(-hidden // threads), routing.num_rows, 1),
        (threads, 1, 1),
        seed=seed,
    )


E2E_SHAPES = [(16, 192, 128), (32, 128, 64), (32, 256, 128)]  # (bm, H, I): 1-4 column blocks, 4-8 K steps


@pytest.mark.parametrize("tile_rows,hidden,expert", E2E_SHAPES, ids=[f"bm{b}-H{h}-I{i}" for b, h, i in E2E_SHAPES])
def test_moe_prefill_matches_reference_moe(tile_rows: int, hidden: int, expert: int, kio) -> None:
    """The whole f32 chain (route, sort, both GEMMs, combine) against residual + lily.reference.moe.

    The shared expert's dense SwiGLU and the router/shared-gate logits are qmatmul outputs: taken from the reference.
    """
    num_rows, num_experts, top_k, shared = 24, 32, 8, 64
    rng = np.random.default_rng(70 + tile_rows + hidden)
    layer = PrefillLayer(rng, num_experts, hidden, expert, kio)
    router = (rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_gate_w = (rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_weights = [quantized_weight(rng, shape).tensor
                      for shape in ((shared, hidden), (shared, hidden), (hidden, shared))]
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32)
    residual = rng.standard_normal((num_rows, hidden)).astype(np.float32)

    routing = Routing(reference.qmatmul(x, router), top_k, tile_rows)
    routing.check_exact()
    h = run_gate_up(layer, routing, x, "f32", kio)
    y = run_down(layer, routing, h, "f32", kio)
    shared_out = reference.swiglu(x, *shared_weights)
    gate_logits = np.ascontiguousarray(reference.qmatmul(x, shared_gate_w)[:, 0])
    out = kio.poisoned((num_rows, hidden), "f32")
    run_combine(routing, y, shared_out, gate_logits, residual, out, hidden, "f32")

    weights_by_name = {
        "gate.weight": router,
        "switch_mlp.gate_proj.weight": layer.gate.tensor,
        "switch_mlp.up_proj.weight": layer.up.tensor,
        "switch_mlp.down_proj.weight": layer.down.tensor,
        "shared_expert.gate_proj.weight": shared_weights[0],
        "shared_expert.up_proj.weight": shared_weights[1],
        "shared_expert.down_proj.weight": shared_weights[2],
        "shared_expert_gate.weight": shared_gate_w,
    }
    expected = residual.astype(np.float64) + reference.moe(x, weights_by_name, num_experts_per_tok=top_k)
    run = Run(None, rng)
    compare_dot(run, f"prefill MoE bm{tile_rows}", out, expected, "f32")
    assert run.comparisons[-1].passed, run.comparisons[-1]


def test_moe_prefill_independent_of_schedule(kio) -> None:
    """No float atomics and fixed summation orders: every buffer of the chain has the same bits under any schedule."""
    num_rows, num_experts, top_k, hidden, expert = 20, 16, 4, 128, 64
    rng = np.random.default_rng(99)
    layer = PrefillLayer(rng, num_experts, hidden, expert, kio)
    logits = rng.standard_normal((num_rows, num_experts)).astype(np.float32)
    x = kio.to_device(rng.standard_normal((num_rows, hidden)), "bf16")
    shared_out = kio.to_device(rng.standard_normal((num_rows, hidden)), "bf16")
    gate_logits = rng.standard_normal(num_rows).astype(np.float32)
    runs = []
    for seed in (1, 2, 3):
        routing = Routing(logits, top_k, 16, seed=seed)
        h = run_gate_up(layer, routing, x, "bf16", kio, seed=seed)
        y = run_down(layer, routing, h, "bf16", kio, seed=seed)
        out = kio.poisoned((num_rows, hidden), "bf16")
        run_combine(routing, y, shared_out, gate_logits, x, out, hidden, "bf16", seed=seed)
        runs.append([routing.ids, routing.weights, routing.sorted_pairs, routing.tile_map, h, y, out])
    for run in runs[1:]:
        for got, first in zip(run, runs[0]):
            assert np.array_equal(got, first, equal_nan=got.dtype.kind == "f")
