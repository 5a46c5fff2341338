"""Cases of metal/gated_delta.metal (the fused decode step: conv, L2 norms, gated delta rule, gated RMSNorm) against
``lily.reference``'s DeltaNet pieces (``causal_conv1d``, ``l2_normalize``, ``gated_delta_rule``,
``gated_rms_norm``), and the inputs and reference the prefill op's cases share."""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, to_device, to_f64

PATTERN = re.compile(r"gated_delta_step_(f32|f16|bf16)_dk(128|64)")
TAPS = 4  # the causal conv's kernel size
EPS = 1e-6


def gated_delta_args(tokens: int, hk: int, hv: int, dv: int) -> bytes:
    return struct.pack("<IIIIffII", tokens, hk, hv, dv, EPS, EPS, 0, 0)  # lily::GatedDeltaArgs


def gated_delta_inputs(rng: np.random.Generator, dtype: str, hk: int, hv: int, dk: int, dv: int,
                       tokens: int) -> dict[str, np.ndarray]:
    """Device buffers of one DeltaNet layer's inputs; the recurrent state [Hv, dv, Dk] is fp32."""
    c = 2 * hk * dk + hv * dv
    return {
        "qkv": to_device(rng.standard_normal((tokens, c)), dtype),
        "z": to_device(rng.standard_normal((tokens, hv * dv)), dtype),
        "b": to_device(rng.standard_normal((tokens, hv)), dtype),
        "a": to_device(4.0 * rng.standard_normal((tokens, hv)), dtype),
        "conv_weight": to_device(0.5 * rng.standard_normal((c, TAPS)), dtype),
        "a_log": np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32),
        "dt_bias": rng.standard_normal(hv).astype(np.float32),
        "norm_weight": to_device(1.0 + 0.2 * rng.standard_normal(dv), dtype),
        "conv_state": to_device(rng.standard_normal((TAPS - 1, c)), dtype),
        "state": np.ascontiguousarray(0.3 * rng.standard_normal((hv, dv, dk)), np.float32),
    }


def gated_delta_expected(inp: dict[str, np.ndarray], dtype: str, hk: int, hv: int, dk: int, dv: int):
    """lily.reference's DeltaNet pieces: outputs [T, Hv*dv], conv output [T, C], state [Hv, dv, Dk]."""
    qkv = to_f64(inp["qkv"], dtype)
    t = qkv.shape[0]
    mixed, _ = reference.causal_conv1d(qkv, to_f64(inp["conv_weight"], dtype), to_f64(inp["conv_state"], dtype))
    key_dim = hk * dk
    q = reference.l2_normalize(mixed[:, :key_dim].reshape(t, hk, dk)) * np.float32(dk**-0.5)
    k = reference.l2_normalize(mixed[:, key_dim : 2 * key_dim].reshape(t, hk, dk))
    v = mixed[:, 2 * key_dim :].reshape(t, hv, dv)
    beta = 1.0 / (1.0 + np.exp(-to_f64(inp["b"], dtype)))
    g = -np.exp(inp["a_log"].astype(np.float64)) * np.logaddexp(0.0, to_f64(inp["a"], dtype) + inp["dt_bias"])
    o, state = reference.gated_delta_rule(q, k, v, g, beta, inp["state"].transpose(0, 2, 1))
    z = to_f64(inp["z"], dtype).reshape(t, hv, dv)
    y = reference.gated_rms_norm(o, z, to_f64(inp["norm_weight"], dtype), EPS).reshape(t, hv * dv)
    return y, mixed, state.transpose(0, 2, 1)


def _step(run: Run, kernel: str, hk: int, hv: int, dk: int, dv: int) -> None:
    """One token, one threadgroup per key head."""
    dtype = dtype_of(kernel)
    inp = gated_delta_inputs(run.rng, dtype, hk, hv, dk, dv, 1)
    y, _, state = gated_delta_expected(inp, dtype, hk, hv, dk, dv)
    out = poisoned((1, hv * dv), dtype)
    run.dispatch(kernel, [gated_delta_args(1, hk, hv, dv), inp["qkv"], inp["z"], inp["b"], inp["a"],
                          inp["conv_weight"], inp["a_log"], inp["dt_bias"], inp["norm_weight"], inp["conv_state"],
                          inp["state"], out], hk, 1024)
    run.compare("out", to_f64(out, dtype), y, REL_RMS[dtype])
    run.compare("state", inp["state"], state, REL_RMS["f32"])


def cases(kernel: str) -> list[Case]:
    """Every case of one DeltaNet step kernel: one key head with 2 value heads, the model's (dk = dv = 128, 256 state
    rows) or the demo model's (dk = dv = 64)."""
    dk = int(re.search(r"_dk(\d+)$", kernel).group(1))
    return [Case(kernel, f"T=1 Hk=1 Hv=2 dk={dk} dv={dk}", partial(_step, kernel=kernel, hk=1, hv=2, dk=dk, dv=dk),
                 quick=True)]
