"""Cases of metal/moe.metal (decode: routing, the fused gate/up SwiGLU GEMVs with or without the routing and RMSNorm
folded in, down + combine) against ``lily.reference.moe_route``, ``qmatmul`` and ``rms_norm``, and the helpers the
MoE ops' cases share."""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, quantized_weight, to_device, to_f64

PATTERN = re.compile(r"moe_route_f32|moe_(gate_up_swiglu|down_combine)_(f32|f16|bf16)(_sf32)?"
                     r"|moe_gate_up_swiglu_routed_(f32|bf16)(_sf32)?")
GEMV_ROWS, GEMV_THREADS = 8, 64  # 2 simdgroups x LILY_MOE_GEMV_ROWS_PER_SIMDGROUP
# (T, E, k, H, I, Is): 70 rows x 4 slots = 280 pairs span two sort blocks; I != Is.
SHAPE = (70, 32, 4, 128, 64, 128)
EPS = 1e-6


def moe_args(rows: int, experts: int, k: int, hidden: int, expert: int, shared: int = 0, tile_rows: int = 0,
             max_tiles: int = 0) -> bytes:
    return struct.pack("<8I", rows, experts, k, hidden, expert, shared, tile_rows, max_tiles)  # lily::MoeArgs


def silu64(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _route(run: Run, kernel: str, rows: int, experts: int, k: int) -> None:
    logits = (2.0 * run.rng.standard_normal((rows, experts))).astype(np.float32)
    ids = np.full((rows, k), 0xFFFFFFFF, np.uint32)
    weights = np.full((rows, k), np.nan, np.float32)
    run.dispatch(kernel, [moe_args(rows, experts, k, 0, 0), logits, ids, weights], rows, 32)
    expected_ids, expected_weights = reference.moe_route(logits, k)
    run.compare_exact("ids", ids.astype(np.int64), expected_ids)
    run.compare("weights", weights, expected_weights, REL_RMS["f32"])


def _swiglu_pieces(x: np.ndarray, gate, up, shared_gate, shared_up, ids) -> np.ndarray:
    """The routed experts' and the shared expert's SwiGLU hidden rows, concatenated (the kernels' fp32 scratch)."""
    pairs = [(gate.dequantize()[e], up.dequantize()[e]) for e in ids] + [(shared_gate.dequantize(),
                                                                          shared_up.dequantize())]
    return np.concatenate([silu64(reference.qmatmul(x, g).astype(np.float64)) * reference.qmatmul(x, u)
                           for g, u in pairs])


def _gate_up(run: Run, kernel: str) -> None:
    dtype, rng = dtype_of(kernel), run.rng
    _, experts, k, hidden, expert, shared = SHAPE
    ids = rng.choice(experts, k, replace=False).astype(np.uint32)
    gate, gate_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
    up, up_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
    shared_gate, shared_gate_buffers = quantized_weight(kernel, (shared, hidden), rng)
    shared_up, shared_up_buffers = quantized_weight(kernel, (shared, hidden), rng)
    x = to_device(rng.standard_normal(hidden), dtype)
    h = np.full(k * expert + shared, np.nan, np.float32)  # fp32 scratch in both modes
    run.dispatch(kernel, [moe_args(1, experts, k, hidden, expert, shared), x, ids, *gate_buffers, *up_buffers,
                          *shared_gate_buffers, *shared_up_buffers, h],
                 (-(-max(expert, shared) // GEMV_ROWS), k + 1, 1), GEMV_THREADS)
    expected = _swiglu_pieces(to_f64(x, dtype).astype(np.float32), gate, up, shared_gate, shared_up, ids)
    run.compare("h", h, expected, REL_RMS["f32"])


def _down_combine(run: Run, kernel: str) -> None:
    dtype, rng = dtype_of(kernel), run.rng
    _, experts, k, hidden, expert, shared = SHAPE
    ids = rng.choice(experts, k, replace=False).astype(np.uint32)
    down, down_buffers = quantized_weight(kernel, (experts, hidden, expert), rng)
    shared_down, shared_down_buffers = quantized_weight(kernel, (hidden, shared), rng)
    h = rng.standard_normal(k * expert + shared).astype(np.float32)
    weights = rng.dirichlet(np.ones(k)).astype(np.float32)
    gate_logit = np.array([0.4], np.float32)
    residual = to_device(2.0 * rng.standard_normal(hidden), dtype)
    out = poisoned((hidden,), dtype)
    run.dispatch(kernel, [moe_args(1, experts, k, hidden, expert, shared), h, ids, weights, *down_buffers,
                          *shared_down_buffers, gate_logit, residual, out], hidden // GEMV_ROWS, GEMV_THREADS)
    expected = to_f64(residual, dtype).copy()
    for slot, e in enumerate(ids):
        expected += float(weights[slot]) * reference.qmatmul(h[slot * expert : (slot + 1) * expert],
                                                            down.dequantize()[e])
    expected += reference.qmatmul(h[k * expert :], shared_down.dequantize()) / (1.0 + np.exp(-0.4))
    run.compare("out", to_f64(out, dtype), expected, REL_RMS[dtype])


def _gate_up_routed(run: Run, kernel: str) -> None:
    """Routing (softmax/top-k over f32 logits) and the RMSNorm folded into gate/up: the hidden scratch and the ids and
    weights it writes for moe_down_combine."""
    dtype, rng = dtype_of(kernel), run.rng
    _, experts, k, hidden, expert, shared = SHAPE
    gate, gate_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
    up, up_buffers = quantized_weight(kernel, (experts, expert, hidden), rng)
    shared_gate, shared_gate_buffers = quantized_weight(kernel, (shared, hidden), rng)
    shared_up, shared_up_buffers = quantized_weight(kernel, (shared, hidden), rng)
    x = to_device(2.0 * rng.standard_normal(hidden), dtype)
    norm_weight = to_device(1.0 + 0.3 * rng.standard_normal(hidden), dtype)
    logits = (2.0 * rng.standard_normal((1, experts))).astype(np.float32)
    ids = np.full(k, 0xFFFFFFFF, np.uint32)
    weights = np.full(k, np.nan, np.float32)
    h = np.full(k * expert + shared, np.nan, np.float32)
    args = moe_args(1, experts, k, hidden, expert, shared) + struct.pack("<fIII", EPS, 0, 0, 0)  # MoeRoutedArgs
    run.dispatch(kernel, [args, x, norm_weight, logits, ids, weights, *gate_buffers, *up_buffers,
                          *shared_gate_buffers, *shared_up_buffers, h],
                 (-(-max(expert, shared) // GEMV_ROWS), k + 1, 1), GEMV_THREADS)
    expected_ids, expected_weights = reference.moe_route(logits, k)
    xs = reference.rms_norm(to_f64(x, dtype), to_f64(norm_weight, dtype), EPS)
    run.compare_exact("ids", ids.astype(np.int64), expected_ids[0])
    run.compare("h", h, _swiglu_pieces(xs, gate, up, shared_gate, shared_up, expected_ids[0]), REL_RMS["f32"])
    run.compare("weights", weights, expected_weights[0], REL_RMS["f32"])


def cases(kernel: str) -> list[Case]:
    """Every case of one MoE decode kernel; the first is the self-test's."""
    _, experts, k, hidden, expert, shared = SHAPE
    shape = f"E={experts} k={k} H={hidden} I={expert} Is={shared}"
    if kernel == "moe_route_f32":
        return [Case(kernel, "T=3 E=256 k=8", partial(_route, kernel=kernel, rows=3, experts=256, k=8), quick=True)]
    body = _gate_up_routed if "_routed_" in kernel else _gate_up if "_gate_up_" in kernel else _down_combine
    return [Case(kernel, shape, partial(body, kernel=kernel), quick=True)]
