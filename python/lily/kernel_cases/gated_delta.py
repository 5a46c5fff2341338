"""Cases of metal/gated_delta.metal (the decode step) against ``lily.reference.gated_delta``, and the layer fixtures,
dispatch helpers and checks the prefill op's cases share.

The reference (conv + SiLU, q/k L2 norms with q times dk^-0.5, gates, the delta rule, the gated RMSNorm) runs on the
kernel's exact inputs. Shapes keep Dk = 128 (the kernel's template parameter) and the model's head grouping (Hv/Hk =
2), with smaller dv and head counts; they also cover Hv/Hk = 1 and 4, rows that do not divide evenly over the
simdgroups and the full 256-row key head, from random conv and recurrent states, and extreme gates (softplus
thresholds, decay and beta 0 or 1, a zero key). The Dk = 64 instances (demo model and fixtures: Hk 2, Hv 4 or 6,
dv 64) run decode steps. Outputs start NaN-poisoned; the conv state must match exactly, the fp32 state within a few
ulp of its scale.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import TOLERANCES, Case, Run, Tolerance, dtype_of, poisoned, round_to, to_device, to_f64

PATTERN = re.compile(r"gated_delta_step_(f32|f16|bf16)_dk(128|64)")
K = 4  # the causal conv's kernel size
EPS = 1e-6
PREFILL_ROWS_PER_SIMDGROUP = 1  # LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP
PREFILL_ROWS_PER_THREADGROUP = 32  # LILY_GDN_PREFILL_ROWS_PER_THREADGROUP: grid (Hv, ceil(dv / 32)) of the scan
PREFILL_NORM_THREADS = 256  # tuning::kGdnPrefillNormThreads: 8 (token, head) rows per gated_delta_prefill_norm group
CONV_TOKENS = 16  # LILY_GDN_CONV_TOKENS: tokens per thread of gated_delta_conv (its grid's y)
CHUNK = 32  # LILY_GDN_CHUNK: tokens per chunk of gated_delta_chunk_prepare/_scan
CHUNK_SCAN_SIMDGROUPS = 2  # LILY_GDN_CHUNK_SCAN_SIMDGROUPS: 8 state rows each, grid (Hv, ceil(dv / 16))
CHUNK_PREPARE_THREADS = 256  # tuning::kGdnChunkPrepareThreads
# The kernels compute in fp32 from rounded inputs and round once: bf16/f16 outputs are within 1 ulp of the rounded
# reference. fp32 outputs go through ~10 dependent fp32 operations per token, so they get a few ulp, not one.
F32_CHAIN = Tolerance(rtol=3e-5, atol=3e-6, rel_rms=5e-6)
# (Hk, Hv, dv, step threads) at Dk = 128; the first is the self-test's: one full 256-row key head at 1024 threads;
# the model's grouping with small dv; Hv/Hk 1 and 4; one simdgroup for all rows; 33 rows per head over 3 simdgroups.
STEP_SHAPES_DK128 = [(1, 2, 128, 1024), (1, 2, 32, 64), (2, 4, 33, 96), (1, 1, 64, 32), (1, 4, 32, 256)]
# At Dk = 64: the demo model (2/4/64) at the engine's 8 rows per simdgroup, the gqa4 fixture (Hv/Hk = 3), one
# simdgroup for all 128 rows of a key head.
STEP_SHAPES_DK64 = [(2, 4, 64, 512), (2, 6, 64, 768), (1, 2, 64, 32)]


def gated_delta_args(num_tokens: int, hk: int, hv: int, dv: int, l2_eps: float = EPS, norm_eps: float = EPS) -> bytes:
    """lily::GatedDeltaArgs (metal/lily.h): T, Hk, Hv, dv, l2_eps, norm_eps, two u32 of padding."""
    return struct.pack("<IIIIffII", num_tokens, hk, hv, dv, l2_eps, norm_eps, 0, 0)


@dataclass
class Layer:
    """One layer's device buffers (kernel storage dtype) and its state."""

    hk: int
    hv: int
    dv: int
    dtype: str
    conv_weight: np.ndarray  # [C, K]
    a_log: np.ndarray  # [Hv] f32
    dt_bias: np.ndarray  # [Hv] f32
    norm_weight: np.ndarray  # [dv]
    conv_state: np.ndarray  # [K-1, C]
    state: np.ndarray  # [Hv, dv, Dk] f32 (kernel layout)
    dk: int = 128  # the kernel instance's key head dim

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    def kernel(self, family: str) -> str:
        """The instance of `family` ("step", "conv", "conv_state", "prefill", "prefill_blockwise", "chunk_prepare",
        "chunk_scan" or "prefill_norm", the one family without a Dk) for this layer."""
        if family == "prefill_norm":
            return f"gated_delta_prefill_norm_{self.dtype}"
        return f"gated_delta_{family}_{self.dtype}_dk{self.dk}"

    def copy(self) -> Layer:
        return replace(self, **{k: v.copy() for k, v in self.__dict__.items() if isinstance(v, np.ndarray)})


def make_layer(rng: np.random.Generator, hk: int, hv: int, dv: int, dtype: str, fresh: bool = False,
               dk: int = 128) -> Layer:
    """Random weights and (unless `fresh`) random conv and recurrent states."""
    c = 2 * hk * dk + hv * dv
    conv_state = np.zeros((K - 1, c)) if fresh else rng.standard_normal((K - 1, c))
    state = np.zeros((hv, dv, dk)) if fresh else 0.3 * rng.standard_normal((hv, dv, dk))
    return Layer(hk, hv, dv, dtype, conv_weight=to_device(0.5 * rng.standard_normal((c, K)), dtype),
                 a_log=np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32),
                 dt_bias=rng.standard_normal(hv).astype(np.float32),
                 norm_weight=to_device(1.0 + 0.2 * rng.standard_normal(dv), dtype),
                 conv_state=to_device(conv_state, dtype), state=np.ascontiguousarray(state, dtype=np.float32), dk=dk)


def make_tokens(rng: np.random.Generator, layer: Layer, num_tokens: int) -> dict[str, np.ndarray]:
    """Projection outputs of `num_tokens` tokens: raw qkv, z, b, a (a spread to reach both softplus branches)."""
    t, d = num_tokens, layer.dtype
    return {"qkv": to_device(rng.standard_normal((t, layer.channels)), d),
            "z": to_device(2.0 * rng.standard_normal((t, layer.hv * layer.dv)), d),
            "b": to_device(2.0 * rng.standard_normal((t, layer.hv)), d),
            "a": to_device(8.0 * rng.standard_normal((t, layer.hv)), d)}


def token_range(tokens: dict[str, np.ndarray], begin: int, end: int) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(x[begin:end]) for name, x in tokens.items()}


def reference_chain(layer: Layer, tokens: dict[str, np.ndarray]):
    """lily.reference.gated_delta over the widened kernel inputs: out [T, Hv*dv], conv state [K-1, C], state
    [Hv, dv, Dk] (the kernel's layout, the transpose of the reference's)."""
    d = layer.dtype
    weights = {"conv1d.weight": to_f64(layer.conv_weight, d), "A_log": layer.a_log, "dt_bias": layer.dt_bias,
               "norm.weight": to_f64(layer.norm_weight, d)}
    y, conv_state, state = reference.gated_delta(
        *(to_f64(tokens[name], d) for name in ("qkv", "z", "b", "a")), weights, to_f64(layer.conv_state, d),
        layer.state.transpose(0, 2, 1), num_k_heads=layer.hk, num_v_heads=layer.hv, head_k_dim=layer.dk,
        head_v_dim=layer.dv, eps=EPS)
    return y, conv_state, state.transpose(0, 2, 1)


def prefill_threads(layer: Layer, extra_simdgroups: int = 0) -> int:
    """gated_delta_prefill keeps at most LILY_GDN_PREFILL_ROWS_PER_SIMDGROUP (1) of a threadgroup's
    min(dv, LILY_GDN_PREFILL_ROWS_PER_THREADGROUP) rows per simdgroup."""
    rows = min(layer.dv, PREFILL_ROWS_PER_THREADGROUP)
    return 32 * (-(-rows // PREFILL_ROWS_PER_SIMDGROUP) + extra_simdgroups)


def prefill_groups(layer: Layer) -> tuple[int, int, int]:
    """gated_delta_prefill's grid: (value head, slice of LILY_GDN_PREFILL_ROWS_PER_THREADGROUP rows)."""
    return layer.hv, -(-layer.dv // PREFILL_ROWS_PER_THREADGROUP), 1


def run_prefill_norm(run: Run, layer: Layer, core_out: np.ndarray, z: np.ndarray,
                     threads: int = PREFILL_NORM_THREADS, **options) -> np.ndarray:
    """gated_delta_prefill_norm over the fp32 scan output `core_out` [T, Hv*dv]: one simdgroup per (token, value
    head) row, threads // 32 rows per threadgroup."""
    t = core_out.shape[0]
    out = poisoned((t, layer.hv * layer.dv), layer.dtype)
    run.dispatch(layer.kernel("prefill_norm"),
                 [gated_delta_args(t, layer.hk, layer.hv, layer.dv), core_out, z, layer.norm_weight, out],
                 -(-(t * layer.hv) // (threads // 32)), threads, **options)
    return out


def run_step(run: Run, layer: Layer, token: dict[str, np.ndarray], threads: int, **options) -> np.ndarray:
    """One gated_delta_step dispatch (token arrays are [1, ...]); updates layer.conv_state/state in place."""
    out = poisoned((1, layer.hv * layer.dv), layer.dtype)
    run.dispatch(layer.kernel("step"),
                 [gated_delta_args(1, layer.hk, layer.hv, layer.dv), token["qkv"], token["z"], token["b"], token["a"],
                  layer.conv_weight, layer.a_log, layer.dt_bias, layer.norm_weight, layer.conv_state, layer.state, out],
                 layer.hk, threads, **options)
    return out


def run_steps(run: Run, layer: Layer, tokens: dict[str, np.ndarray], threads: int) -> np.ndarray:
    """One step per token (each with its own fiber-schedule seed on the harness)."""
    count = tokens["qkv"].shape[0]
    return np.concatenate([run_step(run, layer, token_range(tokens, t, t + 1), threads, seed=t) for t in range(count)])


def run_conv(run: Run, layer: Layer, qkv: np.ndarray, threads: int = 64, **options) -> np.ndarray:
    """gated_delta_conv into a fresh fp32 scratch (one thread per channel and block of CONV_TOKENS tokens), then
    gated_delta_conv_state, as ops/gated_delta_prefill.cpp dispatches them; updates layer.conv_state in place."""
    t = qkv.shape[0]
    conv_out = np.full((t, layer.channels), np.nan, np.float32)
    args = gated_delta_args(t, layer.hk, layer.hv, layer.dv)
    groups = -(-layer.channels // threads)
    run.dispatch(layer.kernel("conv"), [args, qkv, layer.conv_weight, layer.conv_state, conv_out],
                 (groups, -(-t // CONV_TOKENS), 1), threads, **options)
    run.dispatch(layer.kernel("conv_state"), [args, qkv, layer.conv_state], groups, threads, **options)
    return conv_out


def run_prefill(run: Run, layer: Layer, tokens: dict[str, np.ndarray], threads: int, scan: str = "prefill",
                norm_threads: int = PREFILL_NORM_THREADS, **options) -> np.ndarray:
    """The conv (run_conv), the `scan` kernel ("prefill" or "prefill_blockwise") into an fp32 scratch, then
    gated_delta_prefill_norm over one chunk, as ops/gated_delta_prefill.cpp dispatches them; updates the layer's
    states in place."""
    t = tokens["qkv"].shape[0]
    conv_out = run_conv(run, layer, tokens["qkv"], **options)
    args = gated_delta_args(t, layer.hk, layer.hv, layer.dv)
    core_out = np.full((t, layer.hv * layer.dv), np.nan, np.float32)
    run.dispatch(layer.kernel(scan), [args, conv_out, tokens["b"], tokens["a"], layer.a_log, layer.dt_bias,
                                      layer.state, core_out], prefill_groups(layer), threads, **options)
    return run_prefill_norm(run, layer, core_out, tokens["z"], norm_threads, **options)


def chunk_scratch(layer: Layer, num_tokens: int) -> dict[str, np.ndarray]:
    """gated_delta_chunk_prepare's outputs for `num_tokens` tokens, NaN-poisoned: W, U, Qg, KdT, M, gamma_last."""
    shape = (layer.hv, -(-num_tokens // CHUNK))
    sizes = {"w": (CHUNK, layer.dk), "u": (CHUNK, layer.dv), "qg": (CHUNK, layer.dk), "kdt": (layer.dk, CHUNK),
             "m": (CHUNK, CHUNK), "gamma": ()}
    return {name: np.full(shape + size, np.nan, np.float32) for name, size in sizes.items()}


def run_chunk_scan(run: Run, layer: Layer, conv_out: np.ndarray, tokens: dict[str, np.ndarray],
                   prepare_threads: int = CHUNK_PREPARE_THREADS, scan_simdgroups: int = CHUNK_SCAN_SIMDGROUPS,
                   scratch: dict[str, np.ndarray] | None = None, **options) -> np.ndarray:
    """gated_delta_chunk_prepare then gated_delta_chunk_scan over a chunk's conv output, as ops/gated_delta_prefill.cpp
    dispatches them: the fp32 o [T, Hv*dv] (NaN-poisoned before); updates layer.state in place. `scratch`
    (chunk_scratch) receives the prepare kernel's outputs."""
    t = conv_out.shape[0]
    args = gated_delta_args(t, layer.hk, layer.hv, layer.dv)
    scratch = chunk_scratch(layer, t) if scratch is None else scratch
    operands = [scratch[name] for name in ("w", "u", "qg", "kdt", "m", "gamma")]
    run.dispatch(layer.kernel("chunk_prepare"), [args, conv_out, tokens["b"], tokens["a"], layer.a_log,
                                                 layer.dt_bias, *operands],
                 (layer.hv, -(-t // CHUNK), 1), prepare_threads, **options)
    core_out = np.full((t, layer.hv * layer.dv), np.nan, np.float32)
    run.dispatch(layer.kernel("chunk_scan"), [args, *operands, layer.state, core_out],
                 (layer.hv, -(-layer.dv // (8 * scan_simdgroups)), 1), 32 * scan_simdgroups, **options)
    return core_out


def run_chunked_prefill(run: Run, layer: Layer, tokens: dict[str, np.ndarray],
                        norm_threads: int = PREFILL_NORM_THREADS, **options) -> np.ndarray:
    """The conv (run_conv), the chunked scan (run_chunk_scan) and gated_delta_prefill_norm over one chunk, as the
    engine runs a prefill chunk with CHUNKED_SCAN on; updates the layer's states in place."""
    conv_out = run_conv(run, layer, tokens["qkv"], **options)
    core_out = run_chunk_scan(run, layer, conv_out, tokens, **options)
    return run_prefill_norm(run, layer, core_out, tokens["z"], norm_threads, **options)


def check_layer(run: Run, layer: Layer, start: Layer, tokens, outputs: np.ndarray) -> None:
    """The outputs, conv state (exact) and recurrent state of `layer` after `tokens`, from `start`, against the
    reference."""
    y, conv_state, state = reference_chain(start, tokens)
    tol = F32_CHAIN if layer.dtype == "f32" else TOLERANCES[layer.dtype]
    run.compare("out", to_f64(outputs, layer.dtype), round_to(y, layer.dtype), tol)
    run.compare_exact("conv state", to_f64(layer.conv_state, layer.dtype), conv_state)
    # fp32 state against an fp32 reference with fp64 sums: a few ulp of the state's scale, over up to 0.5 M elements.
    scale = float(np.sqrt(np.mean(state.astype(np.float64) ** 2)))
    run.compare("state", layer.state, state, Tolerance(rtol=4e-6, atol=2e-5 * scale, rel_rms=math.inf))


def _steps(run: Run, kernel: str, hk: int, hv: int, dv: int, threads: int, num_tokens: int = 2) -> None:
    """Decode steps from random states against the reference over the same tokens."""
    layer = make_layer(run.rng, hk, hv, dv, dtype_of(kernel), dk=int(kernel.rsplit("_dk", 1)[1]))
    start = layer.copy()
    tokens = make_tokens(run.rng, layer, num_tokens)
    check_layer(run, layer, start, tokens, run_steps(run, layer, tokens, threads))


def _extreme_gates(run: Run, kernel: str) -> None:
    """Large |a| and |b| (softplus threshold, decay 0 or 1, beta 0 or 1) and a zero key stay finite and right."""
    layer = make_layer(run.rng, 1, 2, 32, dtype_of(kernel))
    tokens = make_tokens(run.rng, layer, 1)
    tokens["a"][:] = to_device(np.array([[40.0, -40.0]]), layer.dtype)
    tokens["b"][:] = to_device(np.array([[30.0, -30.0]]), layer.dtype)
    tokens["qkv"][0, layer.dk : 2 * layer.dk] = 0  # all-zero key channels: the L2 eps keeps k finite (zero write)
    layer.conv_state[:, layer.dk : 2 * layer.dk] = 0
    start = layer.copy()
    check_layer(run, layer, start, tokens, run_step(run, layer, tokens, 64))


def cases(kernel: str) -> list[Case]:
    """Every case of one DeltaNet step kernel; the first is the self-test's."""
    shapes = STEP_SHAPES_DK128 if kernel.endswith("_dk128") else STEP_SHAPES_DK64
    found = [Case(kernel, f"T=2 Hk={hk} Hv={hv} dv={dv} threads={t}",
                  partial(_steps, kernel=kernel, hk=hk, hv=hv, dv=dv, threads=t), quick=i == 0)
             for i, (hk, hv, dv, t) in enumerate(shapes)]
    if kernel == "gated_delta_step_f32_dk128":
        found.append(Case(kernel, "T=1 Hk=1 Hv=2 dv=32 extreme-gates", partial(_extreme_gates, kernel=kernel)))
    return found
