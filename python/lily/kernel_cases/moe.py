"""Cases of metal/moe.metal (decode MoE) against ``lily.reference.moe_route``, ``qmatmul`` and ``rms_norm``, and the
weights, routings and checks the MoE ops' cases share.

Shapes keep the model's structure (up to 256 experts, top-k up to 16, a shared expert of its own width) at small
sizes: H = 128 (half the lanes idle), 256 (one K step) and 320 (a partial second K step), I and Is multiples of 64
with Is != I; routing over E = 1 to 256 with ties (the lower expert wins) and logits in the hundreds. Weights are
MLX affine 4-bit, group 64, bf16 (or f32) scales and biases, in the stacked switch_mlp layout; the references run on
their exact fp32 dequantisation. Outputs start NaN-poisoned; down + combine also runs in place over the residual.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import cached_property, partial

import numpy as np

from lily import quant, reference
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, round_to, scale_dtype_of, to_device, to_f64

PATTERN = re.compile(r"moe_route_f32|moe_(gate_up_swiglu|down_combine)_(f32|f16|bf16)(_sf32)?"
                     r"|moe_gate_up_swiglu_routed_(f32|bf16)(_sf32)?"
                     r"|moe_gate_up_swiglu_routed_staged_(f32|bf16)(_a16)?"
                     r"|moe_down_combine_staged_(late_)?(f32|bf16)(_a16)?")
GEMV_ROWS, GEMV_THREADS = 8, 64  # gate/up: 2 simdgroups x LILY_MOE_GEMV_ROWS_PER_SIMDGROUP
DOWN_ROWS, DOWN_THREADS = 8, 128  # down + combine: 4 simdgroups x LILY_MOE_DOWN_ROWS_PER_SIMDGROUP
# The staged kernels take any multiple of 32 threads: LILY_QMV_ROWS_PER_SIMDGROUP (4) gate/up rows and
# LILY_MOE_DOWN_ROWS_PER_SIMDGROUP (2) down rows per simdgroup; the host runs gate/up on 128 (tuning::kQmvStagedThreads).
STAGED_THREADS = (128, 64, 256)
STAGE_MAX_K = 4608  # LILY_MOE_STAGE_MAX_K: k * I + Is of moe_down_combine_staged
NORM_EPS = 1e-6
# fp32 sums of K products differ from the fp64 reference by a few ulp of the output's typical size, not of each
# element: an element that cancels to near zero keeps the absolute error of its terms. The element-wise bound adds
# this fraction of the output's RMS to the fp32 table's rtol (32 ulp of the RMS at 2^-23).
F32_DOT_RMS_FRACTION = 4e-6
# (E, k, H, I, Is) of the gate/up and down kernels: every kernel on the first, bf16-scale kernels on all. The last
# takes two pack steps in both kernels, the second partial (gate/up: H / 32 = 66 packs per row, 64 per step; down:
# k * I / 32 + Is / 32 = 166 packs per output row, 160 per step), so packs past the row must weigh nothing.
SHAPES = [(16, 4, 128, 64, 128), (64, 8, 256, 128, 64), (32, 5, 320, 64, 64), (16, 8, 2112, 640, 192)]
# (rows, E, k) of the router: the model's 256/8 first.
ROUTE_SHAPES = [(rows, e, k) for e, k in [(256, 8), (64, 8), (40, 16), (33, 5), (16, 4), (8, 8), (1, 1)]
                for rows in (3, 1)]
# (E, k, H, I, Is) of the routed gate/up: the model's 256 experts and top-8; E not a multiple of 32 (idle lanes);
# k = E; Is != I; H with a partial second pack step (66 packs per row, 64 per step).
ROUTED_SHAPES = [(256, 8, 256, 64, 64), (33, 5, 320, 64, 128), (8, 8, 128, 64, 64), (16, 1, 128, 128, 64),
                 (24, 3, 2112, 64, 64)]


def moe_args(num_rows: int, num_experts: int, top_k: int, hidden: int, expert: int, shared: int = 0,
             tile_rows: int = 0, max_tiles: int = 0) -> bytes:
    """lily::MoeArgs (metal/lily.h): eight u32 fields."""
    return struct.pack("<8I", num_rows, num_experts, top_k, hidden, expert, shared, tile_rows, max_tiles)


def silu64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid64(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


@dataclass
class QWeight:
    """One quantized weight: device buffers (uint32 codes; scales and biases as bf16 bits or f32) and its tensor."""

    tensor: quant.QuantizedTensor
    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray

    def buffers(self) -> list[np.ndarray]:
        return [self.codes, self.scales, self.biases]

    @cached_property
    def dense(self) -> np.ndarray:
        """The exact fp32 dequantisation scale·q + bias, [..., out, in]."""
        return self.tensor.dequantize()


def quantized_weight(rng: np.random.Generator, shape: tuple[int, ...], scales: str = "bf16") -> QWeight:
    """A random 4-bit weight [..., out, in]: uniform codes, `scales` ("bf16" or "f32") scales and biases, W·x of
    about unit variance for unit x. Drawn directly in the quantized layout (every code value 0..15 occurs), which is
    all the kernels see and is much faster than quantizing a float weight."""
    out_in = shape[-1]
    groups = shape[:-1] + (out_in // 64,)
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    scale = rng.uniform(0.5, 1.5, groups) * (0.4 / np.sqrt(out_in))  # codes have variance 21.25: 0.4^2 x 21 ~ 1
    bias = -7.5 * scale * rng.uniform(0.8, 1.2, groups)  # near-symmetric weights, as quantized ones are
    scale, bias = round_to(scale, scales).astype(np.float32), round_to(bias, scales).astype(np.float32)
    tensor = quant.QuantizedTensor(quant.pack(codes, 4), scale, bias, 4, 64,
                                   {"bf16": "bfloat16", "f32": "float32"}[scales])
    return QWeight(tensor, np.ascontiguousarray(tensor.weight), to_device(scale, scales), to_device(bias, scales))


def compare_dot(run: Run, what: str, actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    """The dtype's tolerance; for fp32 outputs the element-wise bound widened by F32_DOT_RMS_FRACTION·RMS."""
    if dtype != "f32":
        run.compare(what, actual, expected, dtype)
        return
    rms = float(np.sqrt(np.mean(np.asarray(expected, np.float64) ** 2)))
    run.compare(what, actual, expected, "f32", allowance=F32_DOT_RMS_FRACTION * rms, allowance_in_rms=False)


class DecodeLayer:
    """One MoE layer's quantized weights (routed experts stacked, shared expert separate)."""

    def __init__(self, rng: np.random.Generator, num_experts: int, hidden: int, expert: int, shared: int,
                 scales: str = "bf16"):
        self.scales = scales
        self.gate = quantized_weight(rng, (num_experts, expert, hidden), scales)
        self.up = quantized_weight(rng, (num_experts, expert, hidden), scales)
        self.down = quantized_weight(rng, (num_experts, hidden, expert), scales)
        self.shared_gate = quantized_weight(rng, (shared, hidden), scales)
        self.shared_up = quantized_weight(rng, (shared, hidden), scales)
        self.shared_down = quantized_weight(rng, (hidden, shared), scales)

    def reference_weights(self, router: np.ndarray, shared_gate: np.ndarray) -> dict[str, object]:
        """The layer's tensors, with the router and shared-expert gate, by the names lily.reference.moe reads."""
        return {"gate.weight": router, "switch_mlp.gate_proj.weight": self.gate.tensor,
                "switch_mlp.up_proj.weight": self.up.tensor, "switch_mlp.down_proj.weight": self.down.tensor,
                "shared_expert.gate_proj.weight": self.shared_gate.tensor,
                "shared_expert.up_proj.weight": self.shared_up.tensor,
                "shared_expert.down_proj.weight": self.shared_down.tensor, "shared_expert_gate.weight": shared_gate}

    def swiglu_hidden(self, x: np.ndarray, ids) -> np.ndarray:
        """The routed experts' and the shared expert's SwiGLU rows for input `x`, concatenated (the fp32 scratch)."""
        pairs = [(self.gate.dense[e], self.up.dense[e]) for e in ids] + [(self.shared_gate.dense, self.shared_up.dense)]
        return np.concatenate([silu64(reference.qmatmul(x, g)) * reference.qmatmul(x, u) for g, u in pairs])


def route(run: Run, logits: np.ndarray, k: int, **options) -> tuple[np.ndarray, np.ndarray]:
    """moe_route_f32 over every row of `logits` [T, E]: ids [T, k] uint32, weights [T, k] f32."""
    rows, num_experts = logits.shape
    ids = np.full((rows, k), 0xFFFFFFFF, np.uint32)
    weights = np.full((rows, k), np.nan, np.float32)
    run.dispatch("moe_route_f32", [moe_args(rows, num_experts, k, 0, 0), np.ascontiguousarray(logits, np.float32),
                                   ids, weights], rows, 32, **options)
    return ids, weights


def gate_up(run: Run, kernel: str, layer: DecodeLayer, args: bytes, x: np.ndarray, ids: np.ndarray, k: int,
            expert: int, shared: int, **options) -> np.ndarray:
    """The fused gate/up SwiGLU GEMVs of k routed experts and the shared one: the fp32 hidden scratch."""
    hidden = np.full(k * expert + shared, np.nan, np.float32)
    run.dispatch(kernel, [args, x, ids, *layer.gate.buffers(), *layer.up.buffers(), *layer.shared_gate.buffers(),
                          *layer.shared_up.buffers(), hidden],
                 (-(-max(expert, shared) // GEMV_ROWS), k + 1, 1), GEMV_THREADS, **options)
    return hidden


def down_combine(run: Run, kernel: str, layer: DecodeLayer, args: bytes, hidden_act: np.ndarray, ids: np.ndarray,
                 weights: np.ndarray, gate_logit: np.ndarray, residual: np.ndarray, out: np.ndarray, hidden: int,
                 threads: int = DOWN_THREADS, **options) -> None:
    """The down GEMVs weighted and summed with the gated shared expert onto the residual, into `out`."""
    rows = threads // 32 * 2  # LILY_MOE_DOWN_ROWS_PER_SIMDGROUP rows per simdgroup
    run.dispatch(kernel, [args, hidden_act, ids, weights, *layer.down.buffers(), *layer.shared_down.buffers(),
                          gate_logit, residual, out], -(-hidden // rows), threads, **options)


def gate_up_routed(run: Run, kernel: str, layer: DecodeLayer, x: np.ndarray, norm_weight: np.ndarray,
                   logits: np.ndarray, k: int, num_experts: int, hidden: int, expert: int, shared: int,
                   threads: int = GEMV_THREADS, **options):
    """One dispatch: (expert ids, routing weights, fp32 SwiGLU hidden) from NaN/0xFFFFFFFF-poisoned buffers."""
    rows = threads // 32 * (4 if "_staged" in kernel else GEMV_ROWS * 32 // GEMV_THREADS)
    ids = np.full(k, 0xFFFFFFFF, np.uint32)
    weights = np.full(k, np.nan, np.float32)
    hidden_act = np.full(k * expert + shared, np.nan, np.float32)
    args = moe_args(1, num_experts, k, hidden, expert, shared) + struct.pack("<fIII", NORM_EPS, 0, 0, 0)
    run.dispatch(kernel, [args, x, norm_weight, np.ascontiguousarray(logits, np.float32), ids, weights,
                          *layer.gate.buffers(), *layer.up.buffers(), *layer.shared_gate.buffers(),
                          *layer.shared_up.buffers(), hidden_act],
                 (-(-max(expert, shared) // rows), k + 1, 1), threads, **options)
    return ids, weights, hidden_act


def _route(run: Run, kernel: str, rows: int, experts: int, k: int, logits: str = "normal") -> None:
    """Random logits; "ties": drawn from three values (the lower expert wins every tie, an all-equal row picks
    0..k-1); "large": in the hundreds (the softmax must subtract the row max)."""
    if logits == "ties":
        values = run.rng.integers(0, 3, (rows, experts)).astype(np.float32)
        values[-1] = 0.0
    elif logits == "large":
        values = (300.0 + 5.0 * run.rng.standard_normal((rows, experts))).astype(np.float32)
    else:
        values = (2.0 * run.rng.standard_normal((rows, experts))).astype(np.float32)
    ids, weights = route(run, values, k)
    expected_ids, expected_weights = reference.moe_route(values, k)
    run.compare_exact("ids", ids.astype(np.int64), expected_ids)
    run.compare("weights", weights, expected_weights, "f32")


def _gate_up(run: Run, kernel: str, shape: tuple[int, ...]) -> None:
    num_experts, k, hidden, expert, shared = shape
    dtype = dtype_of(kernel)
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared, scale_dtype_of(kernel))
    x = to_device(run.rng.standard_normal(hidden), dtype)
    ids = run.rng.choice(num_experts, k, replace=False).astype(np.uint32)
    out = gate_up(run, kernel, layer, moe_args(1, num_experts, k, hidden, expert, shared), x, ids, k, expert, shared)
    compare_dot(run, "hidden (fp32 scratch)", out, layer.swiglu_hidden(to_f64(x, dtype), ids), "f32")


def down_combine_staged(run: Run, kernel: str, layer: DecodeLayer, args: bytes, hidden_act: np.ndarray,
                        router: np.ndarray, ids: np.ndarray, weights: np.ndarray, residual: np.ndarray,
                        out: np.ndarray, hidden: int, threads: int = DOWN_THREADS, **options) -> None:
    """The staged down kernels, which take the router's output (E logits, then the gate logit) beside the ids and
    weights: the early one routes again from the logits, the late one (`_late_`) reads the ids and weights."""
    rows = threads // 32 * 2  # LILY_MOE_DOWN_ROWS_PER_SIMDGROUP rows per simdgroup
    run.dispatch(kernel, [args, hidden_act, router, ids, weights, *layer.down.buffers(), *layer.shared_down.buffers(),
                          residual, out], -(-hidden // rows), threads, **options)


def _down_combine(run: Run, kernel: str, shape: tuple[int, ...], threads: int = DOWN_THREADS,
                  ties: bool = False) -> None:
    """Against the reference, into a separate buffer and in place over the residual (same bits). The early staged
    kernel routes again from random router logits (with `ties`, drawn from three values: the lower expert wins each
    tie), so its ids and weights are reference.moe_route's, and the ids and weights it is given are poison; the others
    read random ids and weights (the late staged kernel beside logits that route elsewhere)."""
    num_experts, k, hidden, expert, shared = shape
    dtype = dtype_of(kernel)
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared, scale_dtype_of(kernel))
    h = run.rng.standard_normal(k * expert + shared).astype(np.float32)
    gate_logit = np.array([run.rng.standard_normal()], np.float32)
    residual = to_device(2.0 * run.rng.standard_normal(hidden), dtype)
    out = poisoned((hidden,), dtype)
    args = moe_args(1, num_experts, k, hidden, expert, shared)
    ids = run.rng.choice(num_experts, k, replace=False).astype(np.uint32)
    weights = run.rng.dirichlet(np.ones(k)).astype(np.float32)
    if "_staged_" in kernel:
        logits = run.rng.integers(0, 3, (1, num_experts)).astype(np.float32) if ties else \
            (2.0 * run.rng.standard_normal((1, num_experts))).astype(np.float32)
        router = np.concatenate([logits[0], gate_logit])
        if "_late_" in kernel:
            run_down = partial(down_combine_staged, run, kernel, layer, args, h, router, ids, weights)
        else:
            run_down = partial(down_combine_staged, run, kernel, layer, args, h, router,
                               np.full(k, 0xFFFFFFFF, np.uint32), np.full(k, np.nan, np.float32))
            expected_ids, expected_weights = reference.moe_route(logits, k)
            ids, weights = expected_ids[0], expected_weights[0]
    else:
        run_down = partial(down_combine, run, kernel, layer, args, h, ids, weights, gate_logit)
    run_down(residual, out, hidden, threads)
    total = to_f64(residual, dtype)
    for slot, e in enumerate(ids):
        total += float(weights[slot]) * reference.qmatmul(h[slot * expert : (slot + 1) * expert], layer.down.dense[e])
    total += sigmoid64(gate_logit[0]) * reference.qmatmul(h[k * expert :], layer.shared_down.dense)
    compare_dot(run, "out", to_f64(out, dtype), round_to(total, dtype), dtype)
    run_down(residual, residual, hidden, threads)
    run.compare_exact("in place == separate (bits)", residual.view(np.uint8), out.view(np.uint8))


def _gate_up_routed(run: Run, kernel: str, shape: tuple[int, ...], ties: bool = False,
                    threads: int = GEMV_THREADS) -> None:
    """Against reference.moe_route on the logits and reference.rms_norm -> SwiGLU of the chosen experts; the ids and
    weights it writes for moe_down_combine must equal moe_route's. With `ties`, logits from three values: every
    simdgroup must pick the same, lowest, ids."""
    num_experts, k, hidden, expert, shared = shape
    dtype = dtype_of(kernel)
    layer = DecodeLayer(run.rng, num_experts, hidden, expert, shared, scale_dtype_of(kernel))
    x = to_device(3.0 * run.rng.standard_normal(hidden), dtype)
    norm_weight = to_device(1.0 + 0.3 * run.rng.standard_normal(hidden), dtype)
    logits = run.rng.integers(0, 3, (1, num_experts)).astype(np.float32) if ties else \
        (2.0 * run.rng.standard_normal((1, num_experts))).astype(np.float32)
    ids, weights, out = gate_up_routed(run, kernel, layer, x, norm_weight, logits, k, num_experts, hidden, expert,
                                       shared, threads)
    expected_ids, expected_weights = reference.moe_route(logits, k)
    run.compare_exact("ids", ids.astype(np.int64), expected_ids[0])
    run.compare("weights", weights, expected_weights[0], "f32")
    normed = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), NORM_EPS)
    compare_dot(run, "hidden (fp32 scratch)", out, layer.swiglu_hidden(normed, expected_ids[0]), "f32")


def cases(kernel: str) -> list[Case]:
    """Every case of one MoE decode kernel; the first is the self-test's."""
    if kernel == "moe_route_f32":
        found = [Case(kernel, f"T={t} E={e} k={k}", partial(_route, kernel=kernel, rows=t, experts=e, k=k),
                      quick=i == 0) for i, (t, e, k) in enumerate(ROUTE_SHAPES)]
        return found + [Case(kernel, "T=4 E=64 k=8 ties", partial(_route, kernel=kernel, rows=4, experts=64, k=8,
                                                                   logits="ties")),
                        Case(kernel, "T=2 E=128 k=8 large-logits", partial(_route, kernel=kernel, rows=2,
                                                                           experts=128, k=8, logits="large"))]
    if "_staged_" in kernel:
        # The routed shapes (H <= LILY_QMV_STAGE_MAX_K) and the down shapes whose k I + Is the staging holds (up to
        # the model's 4608: one pack step), thread counts in turn.
        if "_gate_up_" in kernel:
            body, shapes = _gate_up_routed, ROUTED_SHAPES
        else:
            body, shapes = _down_combine, [s for s in SHAPES if s[1] * s[3] + s[4] <= STAGE_MAX_K] + [
                (16, 8, 256, 512, 512), (8, 8, 1024, 448, 384)]
        found = [Case(kernel, "E={} k={} H={} I={} Is={} threads={}".format(*s, t),
                      partial(body, kernel=kernel, shape=s, threads=t), quick=i == 0)
                 for i, (s, t) in enumerate(zip(shapes, STAGED_THREADS * len(shapes)))]
        if kernel.removesuffix("_a16").endswith("_f32"):
            body = _gate_up_routed if "_gate_up_" in kernel else _down_combine
            found.append(Case(kernel, "E=64 k=8 H=128 I=64 Is=64 ties", partial(
                body, kernel=kernel, shape=(64, 8, 128, 64, 64), ties=True, threads=128)))
        return found
    if "_routed_" in kernel:
        shapes = ROUTED_SHAPES if kernel in ("moe_gate_up_swiglu_routed_bf16", "moe_gate_up_swiglu_routed_f32") \
            else ROUTED_SHAPES[:1]
        found = [Case(kernel, "E={} k={} H={} I={} Is={}".format(*s), partial(_gate_up_routed, kernel=kernel, shape=s),
                      quick=i == 0) for i, s in enumerate(shapes)]
        if kernel == "moe_gate_up_swiglu_routed_f32":
            found.append(Case(kernel, "E=64 k=8 H=128 I=64 Is=64 ties", partial(
                _gate_up_routed, kernel=kernel, shape=(64, 8, 128, 64, 64), ties=True)))
        return found
    body = _gate_up if "_gate_up_" in kernel else _down_combine
    shapes = SHAPES[:1] if "_sf32" in kernel else SHAPES
    return [Case(kernel, "E={} k={} H={} I={} Is={}".format(*s), partial(body, kernel=kernel, shape=s), quick=i == 0)
            for i, s in enumerate(shapes)]
