"""metal/moe.metal (decode MoE) through the CPU harness, against lily.reference.moe_route / swiglu_experts / moe.

Shapes keep the model's structure (up to 256 experts, top-k up to 8, a shared expert of its own width) at small
sizes: H = 128 (half the lanes idle), 256 (one K step) and 320 (a partial second K step), I and Is multiples of 64
with Is != I. The routed expert ids are read from the buffer moe_route wrote. Outputs start NaN-poisoned.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily._ext import msl

from moe_helpers import (
    assert_close_dot,
    moe_args,
    quantized_weight,
    sigmoid64,
    silu64,
)

DTYPES = ["f32", "bf16"]
# (activation dtype, scale/bias dtype) -> host name
GATE_UP = {
    ("f32", "bf16"): "moe_gate_up_swiglu_f32",
    ("bf16", "bf16"): "moe_gate_up_swiglu_bf16",
    ("f32", "f32"): "moe_gate_up_swiglu_f32_sf32",
    ("bf16", "f32"): "moe_gate_up_swiglu_bf16_sf32",
}
DOWN = {
    ("f32", "bf16"): "moe_down_combine_f32",
    ("bf16", "bf16"): "moe_down_combine_bf16",
    ("f32", "f32"): "moe_down_combine_f32_sf32",
    ("bf16", "f32"): "moe_down_combine_bf16_sf32",
}
# Every kernel on the smallest shape; the other shapes with the checkpoints' bf16 scales.
VARIANTS = [(dtype, scales, 0) for dtype in DTYPES for scales in ("bf16", "f32")] + [
    (dtype, "bf16", shape) for dtype in DTYPES for shape in (1, 2)
]
VARIANT_IDS = [f"{d}-s{s}-shape{i}" for d, s, i in VARIANTS]
GEMV_THREADS = 64  # 2 simdgroups x 4 rows (LILY_MOE_GEMV_*)
GEMV_ROWS = 8
# (E, k, H, I, Is)
SHAPES = [(16, 4, 128, 64, 128), (64, 8, 256, 128, 64), (32, 5, 320, 64, 64)]


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """moe_route_f32 over every row of `logits` [T, E]: ids [T, k] uint32, weights [T, k] f32."""
    rows, num_experts = logits.shape
    ids = np.full((rows, k), 0xFFFFFFFF, np.uint32)
    weights = np.full((rows, k), np.nan, np.float32)
    msl.dispatch(
        "moe_route_f32",
        [moe_args(rows, num_experts, k, 0, 0), np.ascontiguousarray(logits, np.float32), ids, weights],
        (rows, 1, 1),
        (32, 1, 1),
    )
    return ids, weights


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("num_experts,k", [(256, 8), (64, 8), (40, 16), (33, 5), (16, 4), (8, 8), (1, 1)])
def test_moe_route(num_experts: int, k: int, rows: int, kio) -> None:
    rng = np.random.default_rng(100 * num_experts + 10 * k + rows)
    logits = (rng.standard_normal((rows, num_experts)) * 2.0).astype(np.float32)
    ids, weights = route(logits, k)
    expected_ids, expected_weights = reference.moe_route(logits, k)
    assert np.array_equal(ids.astype(np.int64), expected_ids), f"ids {ids.tolist()} != {expected_ids.tolist()}"
    kio.assert_close(weights, expected_weights, "f32", f"routing weights E={num_experts} k={k}")


def test_moe_route_ties_go_to_lower_expert(kio) -> None:
    """Logits drawn from three values: most probabilities tie, and the lower expert id must win every tie."""
    rng = np.random.default_rng(3)
    logits = rng.integers(0, 3, (4, 64)).astype(np.float32)
    logits[3] = 0.0  # all equal: experts 0..k-1
    ids, weights = route(logits, 8)
    expected_ids, expected_weights = reference.moe_route(logits, 8)
    assert np.array_equal(ids.astype(np.int64), expected_ids)
    assert list(ids[3]) == list(range(8))
    kio.assert_close(weights, expected_weights, "f32", "tied routing weights")


def test_moe_route_large_logits(kio) -> None:
    """Logits in the hundreds: the softmax must subtract the row max (exp would overflow otherwise)."""
    rng = np.random.default_rng(4)
    logits = (300.0 + rng.standard_normal((2, 128)) * 5.0).astype(np.float32)
    ids, weights = route(logits, 8)
    expected_ids, expected_weights = reference.moe_route(logits, 8)
    assert np.array_equal(ids.astype(np.int64), expected_ids)
    kio.assert_close(weights, expected_weights, "f32", "large logits")


class DecodeLayer:
    """One MoE layer's quantized weights (routed experts stacked, shared expert separate)."""

    def __init__(self, rng: np.random.Generator, num_experts: int, hidden: int, expert: int, shared: int, kio,
                 scales: str = "bf16"):
        self.scales = scales
        self.gate = quantized_weight(rng, (num_experts, expert, hidden), kio, scales)
        self.up = quantized_weight(rng, (num_experts, expert, hidden), kio, scales)
        self.down = quantized_weight(rng, (num_experts, hidden, expert), kio, scales)
        self.shared_gate = quantized_weight(rng, (shared, hidden), kio, scales)
        self.shared_up = quantized_weight(rng, (shared, hidden), kio, scales)
        self.shared_down = quantized_weight(rng, (hidden, shared), kio, scales)

    def reference_weights(self, router: np.ndarray, shared_gate: np.ndarray) -> dict[str, object]:
        """The layer's tensors, with the router and shared-expert gate, by the names lily.reference.moe reads."""
        return {
            "gate.weight": router,
            "switch_mlp.gate_proj.weight": self.gate.tensor,
            "switch_mlp.up_proj.weight": self.up.tensor,
            "switch_mlp.down_proj.weight": self.down.tensor,
            "shared_expert.gate_proj.weight": self.shared_gate.tensor,
            "shared_expert.up_proj.weight": self.shared_up.tensor,
            "shared_expert.down_proj.weight": self.shared_down.tensor,
            "shared_expert_gate.weight": shared_gate,
        }


def gate_up(layer: DecodeLayer, args: bytes, x: np.ndarray, ids: np.ndarray, k: int, expert: int, shared: int,
            dtype: str) -> np.ndarray:
    hidden = np.full(k * expert + shared, np.nan, np.float32)
    buffers = [args, x, ids, *layer.gate.buffers(), *layer.up.buffers(), *layer.shared_gate.buffers(),
               *layer.shared_up.buffers(), hidden]
    grid = (-(-max(expert, shared) // GEMV_ROWS), k + 1, 1)
    msl.dispatch(GATE_UP[dtype, layer.scales], buffers, grid, (GEMV_THREADS, 1, 1))
    return hidden


def down_combine(layer: DecodeLayer, args: bytes, hidden_act: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 gate_logit: np.ndarray, residual: np.ndarray, out: np.ndarray, dtype: str, hidden: int) -> None:
    buffers = [args, hidden_act, ids, weights, *layer.down.buffers(), *layer.shared_down.buffers(), gate_logit,
               residual, out]
    msl.dispatch(DOWN[dtype, layer.scales], buffers, (hidden // GEMV_ROWS, 1, 1), (GEMV_THREADS, 1, 1))


@pytest.mark.parametrize("dtype,scales,shape_index", VARIANTS, ids=VARIANT_IDS)
def test_moe_gate_up_swiglu(dtype: str, scales: str, shape_index: int, kio) -> None:
    shape = SHAPES[shape_index]
    num_experts, k, hidden, expert, shared = shape
    rng = np.random.default_rng(hidden + 7 * k + DTYPES.index(dtype) + 100 * (scales == "f32"))
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio, scales)
    x = kio.to_device(rng.standard_normal(hidden), dtype)
    ids = rng.choice(num_experts, k, replace=False).astype(np.uint32)
    out = gate_up(layer, moe_args(1, num_experts, k, hidden, expert, shared), x, ids, k, expert, shared, dtype)

    xs = kio.to_f64(x, dtype)
    expected = []
    for slot, e in enumerate(ids):
        g = reference.qmatmul(xs, layer.gate.dense[e]).astype(np.float64)
        u = reference.qmatmul(xs, layer.up.dense[e]).astype(np.float64)
        expected.append(silu64(g) * u)
    g = reference.qmatmul(xs, layer.shared_gate.dense).astype(np.float64)
    u = reference.qmatmul(xs, layer.shared_up.dense).astype(np.float64)
    expected.append(silu64(g) * u)
    # The hidden scratch is fp32 in both modes.
    assert_close_dot(kio, out, np.concatenate(expected), "f32", f"gate/up SwiGLU {dtype} scales {scales} {shape}")


@pytest.mark.parametrize("dtype,scales,shape_index", VARIANTS, ids=VARIANT_IDS)
def test_moe_down_combine(dtype: str, scales: str, shape_index: int, kio) -> None:
    shape = SHAPES[shape_index]
    num_experts, k, hidden, expert, shared = shape
    rng = np.random.default_rng(3 * hidden + k + DTYPES.index(dtype) + 100 * (scales == "f32"))
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio, scales)
    h = rng.standard_normal(k * expert + shared).astype(np.float32)
    ids = rng.choice(num_experts, k, replace=False).astype(np.uint32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([rng.standard_normal()], np.float32)
    residual = kio.to_device(rng.standard_normal(hidden) * 2.0, dtype)
    out = kio.poisoned((hidden,), dtype)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    down_combine(layer, args, h, ids, weights, gate_logit, residual, out, dtype, hidden)

    total = kio.to_f64(residual, dtype).copy()
    for slot, e in enumerate(ids):
        y = reference.qmatmul(h[slot * expert : (slot + 1) * expert], layer.down.dense[e]).astype(np.float64)
        total += float(weights[slot]) * y
    y_shared = reference.qmatmul(h[k * expert :], layer.shared_down.dense).astype(np.float64)
    total += sigmoid64(gate_logit[0]) * y_shared
    assert_close_dot(kio, kio.to_f64(out, dtype), kio.round(total, dtype), dtype, f"down+combine {dtype} scales {scales} {shape}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_down_combine_in_place(dtype: str, kio) -> None:
    """out may alias residual: the residual stream is updated in place."""
    num_experts, k, hidden, expert, shared = 16, 4, 128, 64, 64
    rng = np.random.default_rng(21)
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    h = rng.standard_normal(k * expert + shared).astype(np.float32)
    ids = np.array([3, 0, 15, 7], np.uint32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([-0.7], np.float32)
    residual = kio.to_device(rng.standard_normal(hidden), dtype)
    separate = kio.poisoned((hidden,), dtype)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    down_combine(layer, args, h, ids, weights, gate_logit, residual, separate, dtype, hidden)
    down_combine(layer, args, h, ids, weights, gate_logit, residual, residual, dtype, hidden)
    assert np.array_equal(residual, separate)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_matches_reference_moe(dtype: str, kio) -> None:
    """route -> gate/up -> down+combine, fed by GPU buffers only, against residual + lily.reference.moe."""
    num_experts, k, hidden, expert, shared = 64, 8, 256, 64, 128
    rng = np.random.default_rng(40 + DTYPES.index(dtype))
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    router = (rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_gate_w = (rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
    x = kio.to_device(rng.standard_normal(hidden), dtype)
    residual = kio.to_device(rng.standard_normal(hidden), dtype)
    xs = kio.to_f64(x, dtype).astype(np.float32)[None]

    # The router and shared-gate GEMVs belong to the qmatmul family: their fp32 logits are this test's inputs.
    ids, weights = route(reference.qmatmul(xs, router), k)
    gate_logit = reference.qmatmul(xs, shared_gate_w)[0]
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    hidden_act = gate_up(layer, args, x, ids[0], k, expert, shared, dtype)
    out = kio.poisoned((hidden,), dtype)
    down_combine(layer, args, hidden_act, ids[0], weights[0], gate_logit, residual, out, dtype, hidden)

    weights_by_name = layer.reference_weights(router, shared_gate_w)
    expected = kio.to_f64(residual, dtype) + reference.moe(xs, weights_by_name, num_experts_per_tok=k)[0]
    assert_close_dot(kio, kio.to_f64(out, dtype), kio.round(expected, dtype), dtype, f"decode MoE {dtype}")


def test_moe_route_nan_row_keeps_ids_valid() -> None:
    """A NaN logit makes the row's softmax NaN: ids stay valid expert indices (no out-of-range weight reads in the
    expert kernels) and every weight is NaN, so the fault reaches the layer output instead of being hidden."""
    logits = np.random.default_rng(5).standard_normal((2, 40)).astype(np.float32)
    logits[1, 17] = np.nan
    ids, weights = route(logits, 6)
    assert np.array_equal(ids[0].astype(np.int64), reference.moe_route(logits[:1], 6)[0][0])
    assert not np.isnan(weights[0]).any()
    assert (ids[1] < 40).all() and len(set(ids[1].tolist())) == 6, f"ids {ids[1].tolist()}"
    assert np.isnan(weights[1]).all()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_moe_decode_model_width(dtype: str, kio) -> None:
    """The model's H = 2048, I = Is = 512 and k = 8 (16 experts instead of 256 to keep the test small): 8 K steps for
    gate/up, 2 for down, 64 threadgroups per slot."""
    num_experts, k, hidden, expert, shared = 16, 8, 2048, 512, 512
    rng = np.random.default_rng(80 + DTYPES.index(dtype))
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    x = kio.to_device(rng.standard_normal(hidden), dtype)
    residual = kio.to_device(rng.standard_normal(hidden), dtype)
    ids = rng.choice(num_experts, k, replace=False).astype(np.uint32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([0.3], np.float32)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    hidden_act = gate_up(layer, args, x, ids, k, expert, shared, dtype)
    out = kio.poisoned((hidden,), dtype)
    down_combine(layer, args, hidden_act, ids, weights, gate_logit, residual, out, dtype, hidden)

    xs = kio.to_f64(x, dtype).astype(np.float32)[None]
    routed = reference.swiglu_experts(
        xs, layer.gate.tensor, layer.up.tensor, layer.down.tensor, ids[None].astype(np.int64), weights[None]
    )
    shared_y = reference.swiglu(xs, layer.shared_gate.tensor, layer.shared_up.tensor, layer.shared_down.tensor)
    expected = kio.to_f64(residual, dtype) + routed[0] + sigmoid64(gate_logit[0]) * shared_y[0]
    assert_close_dot(kio, kio.to_f64(out, dtype), kio.round(expected, dtype), dtype, f"model width {dtype}")


def test_moe_decode_independent_of_schedule(kio) -> None:
    """Every lane's partial sums and the simd_sum order are fixed: the bits do not depend on the fiber schedule."""
    num_experts, k, hidden, expert, shared = 16, 4, 256, 64, 64
    rng = np.random.default_rng(90)
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    x = kio.to_device(rng.standard_normal(hidden), "bf16")
    ids = np.array([2, 9, 0, 15], np.uint32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    results = []
    for seed, random_schedule in ((0, False), (1, True), (2, True)):
        hidden_act = np.full(k * expert + shared, np.nan, np.float32)
        buffers = [args, x, ids, *layer.gate.buffers(), *layer.up.buffers(), *layer.shared_gate.buffers(),
                   *layer.shared_up.buffers(), hidden_act]
        msl.dispatch("moe_gate_up_swiglu_bf16", buffers, (expert // GEMV_ROWS, k + 1, 1), (GEMV_THREADS, 1, 1),
                     random_schedule=random_schedule, seed=seed)
        out = kio.poisoned((hidden,), "bf16")
        buffers = [args, hidden_act, ids, weights, *layer.down.buffers(), *layer.shared_down.buffers(),
                   np.array([0.1], np.float32), x, out]
        msl.dispatch("moe_down_combine_bf16", buffers, (hidden // GEMV_ROWS, 1, 1), (GEMV_THREADS, 1, 1),
                     random_schedule=random_schedule, seed=seed)
        results.append((hidden_act, out))
    for hidden_act, out in results[1:]:
        assert np.array_equal(hidden_act, results[0][0]) and np.array_equal(out, results[0][1])


# ---- moe_gate_up_swiglu_routed: routing and the post-attention RMSNorm folded into gate/up ----

ROUTED = {
    ("f32", "bf16"): "moe_gate_up_swiglu_routed_f32",
    ("bf16", "bf16"): "moe_gate_up_swiglu_routed_bf16",
    ("f32", "f32"): "moe_gate_up_swiglu_routed_f32_sf32",
    ("bf16", "f32"): "moe_gate_up_swiglu_routed_bf16_sf32",
}
NORM_EPS = 1e-6
# (E, k, H, I, Is): the model's 256 experts and top-8; E not a multiple of 32 (idle lanes); k = E; Is != I; H with a
# partial second K step.
ROUTED_SHAPES = [(256, 8, 256, 64, 64), (33, 5, 320, 64, 128), (8, 8, 128, 64, 64), (16, 1, 128, 128, 64)]
ROUTED_VARIANTS = [(key, 0) for key in ROUTED] + [(("bf16", "bf16"), i) for i in (1, 2, 3)] + [(("f32", "bf16"), 1)]
ROUTED_IDS = [f"{ROUTED[key]}-shape{i}" for key, i in ROUTED_VARIANTS]


def moe_routed_args(num_experts: int, k: int, hidden: int, expert: int, shared: int, eps: float = NORM_EPS) -> bytes:
    """lily::MoeRoutedArgs (metal/lily.h): MoeArgs, f32 eps, three u32 of padding."""
    return moe_args(1, num_experts, k, hidden, expert, shared) + struct.pack("<fIII", eps, 0, 0, 0)


def gate_up_routed(layer: DecodeLayer, x: np.ndarray, norm_weight: np.ndarray, logits: np.ndarray, k: int,
                   num_experts: int, hidden: int, expert: int, shared: int, dtype: str, *, random_schedule: bool = True,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One dispatch: (expert ids, routing weights, fp32 SwiGLU hidden) from NaN/0xFFFFFFFF-poisoned buffers."""
    ids = np.full(k, 0xFFFFFFFF, np.uint32)
    weights = np.full(k, np.nan, np.float32)
    hidden_act = np.full(k * expert + shared, np.nan, np.float32)
    buffers = [moe_routed_args(num_experts, k, hidden, expert, shared), x, norm_weight,
               np.ascontiguousarray(logits, np.float32), ids, weights, *layer.gate.buffers(), *layer.up.buffers(),
               *layer.shared_gate.buffers(), *layer.shared_up.buffers(), hidden_act]
    grid = (-(-max(expert, shared) // GEMV_ROWS), k + 1, 1)
    msl.dispatch(ROUTED[dtype, layer.scales], buffers, grid, (GEMV_THREADS, 1, 1), random_schedule=random_schedule,
                 seed=seed)
    return ids, weights, hidden_act


@pytest.mark.parametrize("key,shape_index", ROUTED_VARIANTS, ids=ROUTED_IDS)
def test_moe_gate_up_swiglu_routed(key, shape_index: int, kio) -> None:
    """Against reference.moe_route on the logits and reference.rms_norm -> SwiGLU of the chosen experts; the ids and
    weights it writes for moe_down_combine must equal moe_route's."""
    dtype, scales = key
    num_experts, k, hidden, expert, shared = ROUTED_SHAPES[shape_index]
    rng = np.random.default_rng([num_experts, k, hidden, shape_index, len(ROUTED[key])])
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio, scales)
    x = kio.to_device(3.0 * rng.standard_normal(hidden), dtype)
    norm_weight = kio.to_device(1.0 + 0.3 * rng.standard_normal(hidden), dtype)
    logits = (2.0 * rng.standard_normal((1, num_experts))).astype(np.float32)
    ids, weights, out = gate_up_routed(layer, x, norm_weight, logits, k, num_experts, hidden, expert, shared, dtype)

    expected_ids, expected_weights = reference.moe_route(logits, k)
    assert np.array_equal(ids.astype(np.int64), expected_ids[0]), f"ids {ids.tolist()} != {expected_ids[0].tolist()}"
    kio.assert_close(weights, expected_weights[0], "f32", f"routed weights {ROUTED[key]}")
    normed = reference.rms_norm(kio.to_f64(x, dtype), kio.to_f64(norm_weight, dtype), NORM_EPS)
    expected = []
    for e in expected_ids[0]:
        expected.append(silu64(reference.qmatmul(normed, layer.gate.dense[e]))
                        * reference.qmatmul(normed, layer.up.dense[e]))
    expected.append(silu64(reference.qmatmul(normed, layer.shared_gate.dense)) *
                    reference.qmatmul(normed, layer.shared_up.dense))
    assert_close_dot(kio, out, np.concatenate(expected), "f32", f"{ROUTED[key]} {ROUTED_SHAPES[shape_index]}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_moe_routed_decode_matches_reference_moe(dtype: str, kio) -> None:
    """The fused chain the engine runs: router logits (inputs here) -> gate_up_routed -> down_combine in place on the
    hidden stream, against hidden + lily.reference.moe(rms_norm(hidden))."""
    num_experts, k, hidden, expert, shared = 64, 8, 256, 64, 128
    rng = np.random.default_rng(140 + len(dtype))
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    router = (rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_gate_w = (rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
    stream = kio.to_device(2.0 * rng.standard_normal(hidden), dtype)
    norm_weight = kio.to_device(1.0 + 0.2 * rng.standard_normal(hidden), dtype)
    normed = reference.rms_norm(kio.to_f64(stream, dtype)[None], kio.to_f64(norm_weight, dtype), NORM_EPS)
    # The router GEMV (qmv_norm, tested in test_qmatmul.py) writes E logits then the shared-expert gate logit.
    logits = np.concatenate([reference.qmatmul(normed, router)[0], reference.qmatmul(normed, shared_gate_w)[0]])
    ids, weights, hidden_act = gate_up_routed(layer, stream, norm_weight, logits, k, num_experts, hidden, expert,
                                              shared, dtype)
    expected = kio.to_f64(stream, dtype) + reference.moe(
        normed, layer.reference_weights(router, shared_gate_w), num_experts_per_tok=k)[0]
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    down_combine(layer, args, hidden_act, ids, weights, logits[num_experts:], stream, stream, dtype, hidden)
    assert_close_dot(kio, kio.to_f64(stream, dtype), kio.round(expected, dtype), dtype, f"fused decode MoE {dtype}")


def test_moe_gate_up_swiglu_routed_independent_of_schedule(kio) -> None:
    """Every routed simdgroup routes for itself and one thread writes ids/weights: the bits never depend on the
    fiber schedule."""
    num_experts, k, hidden, expert, shared = 40, 4, 256, 64, 64
    rng = np.random.default_rng(91)
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    x = kio.to_device(rng.standard_normal(hidden), "bf16")
    norm_weight = kio.to_device(1.0 + 0.1 * rng.standard_normal(hidden), "bf16")
    logits = rng.standard_normal((1, num_experts)).astype(np.float32)
    runs = [gate_up_routed(layer, x, norm_weight, logits, k, num_experts, hidden, expert, shared, "bf16",
                           random_schedule=random_schedule, seed=seed)
            for seed, random_schedule in ((0, False), (1, True), (2, True))]
    for run in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], run))


def test_moe_gate_up_swiglu_routed_ties_go_to_lower_expert(kio) -> None:
    """Logits from three values: most probabilities tie; every simdgroup must pick the same, lowest, ids."""
    num_experts, k, hidden, expert, shared = 64, 8, 128, 64, 64
    rng = np.random.default_rng(92)
    layer = DecodeLayer(rng, num_experts, hidden, expert, shared, kio)
    x = kio.to_device(rng.standard_normal(hidden), "f32")
    norm_weight = kio.to_device(np.ones(hidden), "f32")
    logits = rng.integers(0, 3, (1, num_experts)).astype(np.float32)
    ids, weights, out = gate_up_routed(layer, x, norm_weight, logits, k, num_experts, hidden, expert, shared, "f32")
    expected_ids, expected_weights = reference.moe_route(logits, k)
    assert np.array_equal(ids.astype(np.int64), expected_ids[0])
    kio.assert_close(weights, expected_weights[0], "f32", "tied routed weights")
    normed = reference.rms_norm(kio.to_f64(x, "f32"), np.ones(hidden, np.float32), NORM_EPS)
    e = int(expected_ids[0][k - 1])  # the last slot: its simdgroups picked it after k - 1 tie-breaks of their own
    last = silu64(reference.qmatmul(normed, layer.gate.dense[e])) * reference.qmatmul(normed, layer.up.dense[e])
    assert_close_dot(kio, out[(k - 1) * expert : k * expert], last, "f32", "tied routing, last slot")


@pytest.mark.parametrize("case", op_cases("moe"))
def test_moe_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.moe: the self-test's, on this session's device."""
    check(case, kernel_device)
