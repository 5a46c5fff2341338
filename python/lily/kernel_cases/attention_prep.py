"""Cases of metal/attention_prep.metal against ``lily.reference.attention_prep``.

attention_prep splits q_proj's per-head [query | gate] rows, RMS-norms q and k over the whole head (multiplier 1+w),
applies partial rotate-half RoPE, and writes the roped key and the value into the KV cache at the token's position.
Cases: decode (1 token) at positions 0, 37 and 30001 (fp32 angles far from zero), prefill chunks of 3 and 7 tokens
continuing a cache, the model's head counts (16/2) and a small GQA layout, rotary dims 64 (the model's), 16 (pairs
across lanes) and 256 (the whole head), 1, 3 and 8 simdgroups per threadgroup (a partial last threadgroup); theta
and eps read from the arguments. The head-dim 64 instances (demo model, fixtures: lanes 16..31 idle) run the demo
model's layout (4/2 heads, rotary 16), rotary 64 (the whole head) and 32, decode and prefill. Outputs and the
written cache rows start NaN-poisoned; the other cache rows hold random values that must survive; the gate is copied
exactly and v rounded once to the cache dtype.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.attention import CACHE_DTYPE
from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, round_to, to_device, to_f64

PATTERN = re.compile(r"attention_prep_(f32|f16|bf16)_d(256|64)")
THETA, EPS = 1e7, 1e-6
# (tokens, heads, kv_heads, position, rotary_dim, simdgroups) at head dim 256; the first is the self-test's.
SHAPES_D256 = [
    (3, 16, 2, 37, 64, 2),
    (1, 16, 2, 0, 64, 1),  # decode, first token: RoPE is the identity at position 0
    (1, 16, 2, 37, 64, 3),  # decode with 18 rows over 3-simdgroup threadgroups
    (1, 16, 2, 38, 64, 8),  # the engine's 8 simdgroups: 18 rows over 3 threadgroups, the last with 2 rows
    (1, 4, 1, 30001, 64, 1),  # decode far out: fp32 angles up to 3e4 rad
    (3, 4, 1, 9, 16, 3),  # prefill chunk; rotary pairs (d, d+8) sit in different lanes
    (7, 16, 2, 100, 64, 3),  # prefill chunk with the model's heads; 126 rows, a partial last threadgroup
    (2, 8, 2, 5, 256, 1),  # rotary over the whole head: pairs (d, d+128) sit in the same lane
]
SHAPES_D64 = [
    (1, 4, 2, 0, 16, 8),  # the demo model's decode layout (rotary 64 * 0.25) at the engine's 8 simdgroups
    (1, 4, 2, 301, 16, 3),  # decode, a partial last threadgroup
    (5, 4, 2, 7, 16, 2),  # a prefill chunk continuing a cache
    (3, 8, 2, 11, 32, 3),  # the gqa4 fixture's layout (rotary 64 * 0.5): pairs (d, d+16) in different lanes
    (2, 2, 1, 40, 64, 1),  # rotary over the whole head
]


def attention_prep_args(tokens: int, heads: int, kv_heads: int, position: int, capacity: int, rotary_dim: int,
                        theta: float = THETA, eps: float = EPS) -> bytes:
    """lily::AttentionPrepArgs (metal/lily.h)."""
    return struct.pack("<IIIIIIff", tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps)


def run_prep(run: Run, kernel: str, tokens: int, heads: int, kv_heads: int, position: int, rotary_dim: int,
             simdgroups: int, theta: float = THETA, eps: float = EPS):
    """Dispatch `kernel` on fresh random inputs; return (inputs, outputs) as float64 values. The cache rows of other
    positions are compared with their values before (they must survive)."""
    dtype, head_dim = dtype_of(kernel), int(kernel.rsplit("_d", 1)[1])
    cache_dtype, rng, capacity = CACHE_DTYPE[dtype], run.rng, position + tokens + 5
    q_and_gate = to_device(rng.standard_normal((tokens, heads, 2 * head_dim)) * 2.0, dtype)
    k = to_device(rng.standard_normal((tokens, kv_heads, head_dim)) * 2.0, dtype)
    v = to_device(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    q_norm = to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    k_norm = to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    q_out, gate_out = poisoned((tokens, heads, head_dim), dtype), poisoned((tokens, heads, head_dim), dtype)
    # Rows outside [position, position + tokens) hold earlier tokens: random values that must stay untouched.
    k_cache = to_device(rng.standard_normal((kv_heads, capacity, head_dim)), cache_dtype)
    v_cache = to_device(rng.standard_normal((kv_heads, capacity, head_dim)), cache_dtype)
    for cache in (k_cache, v_cache):
        cache[:, position : position + tokens] = poisoned((kv_heads, tokens, head_dim), cache_dtype)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    rows = tokens * (heads + kv_heads)  # one simdgroup per (token, head) row
    run.dispatch(kernel, [attention_prep_args(tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps),
                          q_and_gate, k, v, q_norm, k_norm, q_out, gate_out, k_cache, v_cache],
                 -(-rows // simdgroups), 32 * simdgroups)
    untouched = np.ones(capacity, bool)
    untouched[position : position + tokens] = False
    run.compare_exact("k cache, other rows", k_cache[:, untouched], k_before[:, untouched])
    run.compare_exact("v cache, other rows", v_cache[:, untouched], v_before[:, untouched])
    inputs = {name: to_f64(buf, dtype) for name, buf in
              dict(q_and_gate=q_and_gate, k=k, v=v, q_norm=q_norm, k_norm=k_norm).items()}
    outputs = dict(q=to_f64(q_out, dtype), gate=to_f64(gate_out, dtype), k_cache=to_f64(k_cache, cache_dtype),
                   v_cache=to_f64(v_cache, cache_dtype))
    return inputs, outputs


def check_prep(run: Run, dtype: str, inputs, outputs, position: int, rotary_dim: int, theta: float = THETA,
               eps: float = EPS) -> None:
    """q and the roped key within the dtype's tolerance; the gate copied exactly; v rounded once to the cache dtype."""
    tokens = inputs["k"].shape[0]
    q, gate, k = reference.attention_prep(inputs["q_and_gate"], inputs["k"], inputs["q_norm"], inputs["k_norm"],
                                          np.arange(position, position + tokens), rotary_dim, theta, eps)
    window, cache_dtype = slice(position, position + tokens), CACHE_DTYPE[dtype]
    run.compare("q", outputs["q"], round_to(q, dtype), dtype)
    run.compare_exact("gate (copied)", outputs["gate"], gate)
    run.compare("k cache rows", outputs["k_cache"][:, window], round_to(k, cache_dtype).transpose(1, 0, 2),
                cache_dtype)
    v_stored = round_to(inputs["v"], cache_dtype).transpose(1, 0, 2)
    run.compare_exact("v cache rows (one rounding)", outputs["v_cache"][:, window], v_stored)


def _prep(run: Run, kernel: str, tokens: int, heads: int, kv_heads: int, position: int, rotary_dim: int,
          simdgroups: int, theta: float = THETA, eps: float = EPS) -> None:
    inputs, outputs = run_prep(run, kernel, tokens, heads, kv_heads, position, rotary_dim, simdgroups, theta, eps)
    check_prep(run, dtype_of(kernel), inputs, outputs, position, rotary_dim, theta, eps)


def cases(kernel: str) -> list[Case]:
    """Every case of one attention_prep kernel; the first is the self-test's."""
    shapes = SHAPES_D256 if kernel.endswith("_d256") else SHAPES_D64
    found = [Case(kernel, f"T={t} Hq={h} Hkv={kv} pos={p} R={r} simdgroups={sg}",
                  partial(_prep, kernel=kernel, tokens=t, heads=h, kv_heads=kv, position=p, rotary_dim=r,
                          simdgroups=sg), quick=i == 0)
             for i, (t, h, kv, p, r, sg) in enumerate(shapes)]
    if kernel == "attention_prep_f32_d256":  # theta 1e6 (the wrong Qwen3 value), eps 4 (large against x^2 ~ 4)
        found.append(Case(kernel, "T=2 Hq=4 Hkv=1 pos=50 R=64 theta=1e6 eps=4",
                          partial(_prep, kernel=kernel, tokens=2, heads=4, kv_heads=1, position=50, rotary_dim=64,
                                  simdgroups=1, theta=1e6, eps=4.0)))
    return found
