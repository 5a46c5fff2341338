"""metal/moe.metal (decode MoE): every case of lily.kernel_cases.moe (routing over E = 1 to 256 with ties and large
logits, the gate/up and down + combine GEMVs at H = 128/256/320, the routed gate/up with the RMSNorm folded in), then
what the cases do not cover: the chains the engine runs (route -> gate/up -> down + combine, and the fused routed
chain in place on the hidden stream) against lily.reference.moe, the model's width, a NaN router row, and the bits
independent of the fiber schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily.kernel_cases.common import Run, poisoned, round_to, to_device, to_f64
from lily.kernel_cases.moe import (DecodeLayer, compare_dot, down_combine, gate_up, gate_up_routed, moe_args, route,
                                   sigmoid64)

DTYPES = ["f32", "bf16"]


def assert_dot(run: Run, what: str, actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    compare_dot(run, what, actual, expected, dtype)
    assert run.comparisons[-1].passed, run.comparisons[-1]


@pytest.mark.parametrize("case", op_cases("moe"))
def test_moe(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_matches_reference_moe(dtype: str, kernel_device) -> None:
    """route -> gate/up -> down+combine, fed by GPU buffers only, against residual + lily.reference.moe."""
    num_experts, k, hidden, expert, shared = 64, 8, 256, 64, 128
    run = Run(kernel_device, np.random.default_rng(40 + DTYPES.index(dtype)))
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared)
    router = (run.rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_gate_w = (run.rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
    x = to_device(run.rng.standard_normal(hidden), dtype)
    residual = to_device(run.rng.standard_normal(hidden), dtype)
    xs = to_f64(x, dtype).astype(np.float32)[None]
    # The router and shared-gate GEMVs belong to the qmatmul family: their fp32 logits are this test's inputs.
    ids, weights = route(run, reference.qmatmul(xs, router), k)
    gate_logit = reference.qmatmul(xs, shared_gate_w)[0]
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    hidden_act = gate_up(run, f"moe_gate_up_swiglu_{dtype}", layer, args, x, ids[0], k, expert, shared)
    out = poisoned((hidden,), dtype)
    down_combine(run, f"moe_down_combine_{dtype}", layer, args, hidden_act, ids[0], weights[0], gate_logit, residual,
                 out, hidden)
    expected = to_f64(residual, dtype) + reference.moe(xs, layer.reference_weights(router, shared_gate_w),
                                                       num_experts_per_tok=k)[0]
    assert_dot(run, f"decode MoE {dtype}", to_f64(out, dtype), round_to(expected, dtype), dtype)


def test_moe_route_nan_row_keeps_ids_valid(kernel_device) -> None:
    """A NaN logit makes the row's softmax NaN: ids stay valid expert indices (no out-of-range weight reads in the
    expert kernels) and every weight is NaN, so the fault reaches the layer output instead of being hidden."""
    run = Run(kernel_device, np.random.default_rng(5))
    logits = run.rng.standard_normal((2, 40)).astype(np.float32)
    logits[1, 17] = np.nan
    ids, weights = route(run, logits, 6)
    assert np.array_equal(ids[0].astype(np.int64), reference.moe_route(logits[:1], 6)[0][0])
    assert not np.isnan(weights[0]).any()
    assert (ids[1] < 40).all() and len(set(ids[1].tolist())) == 6, f"ids {ids[1].tolist()}"
    assert np.isnan(weights[1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_model_width(dtype: str, kernel_device) -> None:
    """The model's H = 2048, I = Is = 512 and k = 8 (16 experts instead of 256 to keep the test small): 8 K steps for
    gate/up, 2 for down, 64 threadgroups per slot."""
    num_experts, k, hidden, expert, shared = 16, 8, 2048, 512, 512
    run = Run(kernel_device, np.random.default_rng(80 + DTYPES.index(dtype)))
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared)
    x = to_device(run.rng.standard_normal(hidden), dtype)
    residual = to_device(run.rng.standard_normal(hidden), dtype)
    ids = run.rng.choice(num_experts, k, replace=False).astype(np.uint32)
    weights = run.rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([0.3], np.float32)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    hidden_act = gate_up(run, f"moe_gate_up_swiglu_{dtype}", layer, args, x, ids, k, expert, shared)
    out = poisoned((hidden,), dtype)
    down_combine(run, f"moe_down_combine_{dtype}", layer, args, hidden_act, ids, weights, gate_logit, residual, out,
                 hidden)
    xs = to_f64(x, dtype).astype(np.float32)[None]
    routed = reference.swiglu_experts(xs, layer.gate.tensor, layer.up.tensor, layer.down.tensor,
                                      ids[None].astype(np.int64), weights[None])
    shared_y = reference.swiglu(xs, layer.shared_gate.tensor, layer.shared_up.tensor, layer.shared_down.tensor)
    expected = to_f64(residual, dtype) + routed[0] + sigmoid64(gate_logit[0]) * shared_y[0]
    assert_dot(run, f"model width {dtype}", to_f64(out, dtype), round_to(expected, dtype), dtype)


def test_moe_decode_independent_of_schedule(kernel_device) -> None:
    """Every lane's partial sums and the simd_sum order are fixed: the bits do not depend on the fiber schedule."""
    num_experts, k, hidden, expert, shared = 16, 4, 256, 64, 64
    run = Run(kernel_device, np.random.default_rng(90))
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared)
    x = to_device(run.rng.standard_normal(hidden), "bf16")
    ids = np.array([2, 9, 0, 15], np.uint32)
    weights = run.rng.dirichlet(np.ones(k)).astype(np.float32)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    results = []
    for seed, random_schedule in ((0, False), (1, True), (2, True)):
        options = dict(random_schedule=random_schedule, seed=seed)
        hidden_act = gate_up(run, "moe_gate_up_swiglu_bf16", layer, args, x, ids, k, expert, shared, **options)
        out = poisoned((hidden,), "bf16")
        down_combine(run, "moe_down_combine_bf16", layer, args, hidden_act, ids, weights, np.array([0.1], np.float32),
                     x, out, hidden, **options)
        results.append((hidden_act, out))
    for hidden_act, out in results[1:]:
        assert np.array_equal(hidden_act, results[0][0]) and np.array_equal(out, results[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_routed_decode_matches_reference_moe(dtype: str, kernel_device) -> None:
    """The fused chain the engine runs: router logits (inputs here) -> gate_up_routed -> down_combine in place on the
    hidden stream, against hidden + lily.reference.moe(rms_norm(hidden))."""
    num_experts, k, hidden, expert, shared = 64, 8, 256, 64, 128
    run = Run(kernel_device, np.random.default_rng(140 + len(dtype)))
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared)
    router = (run.rng.standard_normal((num_experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    shared_gate_w = (run.rng.standard_normal((1, hidden)) / np.sqrt(hidden)).astype(np.float32)
    stream = to_device(2.0 * run.rng.standard_normal(hidden), dtype)
    norm_weight = to_device(1.0 + 0.2 * run.rng.standard_normal(hidden), dtype)
    normed = reference.rms_norm(to_f64(stream, dtype)[None], to_f64(norm_weight, dtype), 1e-6)
    # The router GEMV (qmv_norm, in the qmatmul cases) writes E logits then the shared-expert gate logit.
    logits = np.concatenate([reference.qmatmul(normed, router)[0], reference.qmatmul(normed, shared_gate_w)[0]])
    ids, weights, hidden_act = gate_up_routed(run, f"moe_gate_up_swiglu_routed_{dtype}", layer, stream, norm_weight,
                                              logits, k, num_experts, hidden, expert, shared)
    expected = to_f64(stream, dtype) + reference.moe(normed, layer.reference_weights(router, shared_gate_w),
                                                     num_experts_per_tok=k)[0]
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    down_combine(run, f"moe_down_combine_{dtype}", layer, args, hidden_act, ids, weights, logits[num_experts:], stream,
                 stream, hidden)
    assert_dot(run, f"fused decode MoE {dtype}", to_f64(stream, dtype), round_to(expected, dtype), dtype)


def test_moe_gate_up_swiglu_routed_independent_of_schedule(kernel_device) -> None:
    """Every routed simdgroup routes for itself and one thread writes ids/weights: the bits never depend on the
    fiber schedule."""
    num_experts, k, hidden, expert, shared = 40, 4, 256, 64, 64
    run = Run(kernel_device, np.random.default_rng(91))
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared)
    x = to_device(run.rng.standard_normal(hidden), "bf16")
    norm_weight = to_device(1.0 + 0.1 * run.rng.standard_normal(hidden), "bf16")
    logits = run.rng.standard_normal((1, num_experts)).astype(np.float32)
    runs = [gate_up_routed(run, "moe_gate_up_swiglu_routed_bf16", layer, x, norm_weight, logits, k, num_experts,
                           hidden, expert, shared, random_schedule=random_schedule, seed=seed)
            for seed, random_schedule in ((0, False), (1, True), (2, True))]
    for other in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(runs[0], other))
