"""Cases of metal/attention_prep.metal against ``lily.reference.attention_prep``: q/k RMSNorm and partial rotary
embedding, q and the gate written out, k and v written into the cache at their positions."""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.attention import CACHE_DTYPE, attention_layout
from lily.kernel_cases.common import REL_RMS, Case, Run, dtype_of, poisoned, to_device, to_f64

PATTERN = re.compile(r"attention_prep_(f32|f16|bf16)_d(256|64)")


def attention_prep_args(tokens: int, heads: int, kv_heads: int, position: int, capacity: int, rotary_dim: int,
                        theta: float, eps: float) -> bytes:
    return struct.pack("<IIIIIIff", tokens, heads, kv_heads, position, capacity, rotary_dim, theta,
                       eps)  # lily::AttentionPrepArgs


def _prep(run: Run, kernel: str, tokens: int, kv_heads: int, position: int, rotary_dim: int) -> None:
    dtype = dtype_of(kernel)
    cache_dtype = CACHE_DTYPE[dtype]
    d, _, heads = attention_layout(kernel)
    theta, eps, capacity, rng = 1e7, 1e-6, position + tokens + 2, run.rng
    q_and_gate = to_device(2.0 * rng.standard_normal((tokens, heads, 2 * d)), dtype)
    k = to_device(2.0 * rng.standard_normal((tokens, kv_heads, d)), dtype)
    v = to_device(rng.standard_normal((tokens, kv_heads, d)), dtype)
    q_norm = to_device(1.0 + 0.3 * rng.standard_normal(d), dtype)
    k_norm = to_device(1.0 + 0.3 * rng.standard_normal(d), dtype)
    q_out, gate_out = poisoned((tokens, heads, d), dtype), poisoned((tokens, heads, d), dtype)
    k_cache = poisoned((kv_heads, capacity, d), cache_dtype)
    v_cache = poisoned((kv_heads, capacity, d), cache_dtype)
    args = attention_prep_args(tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps)
    rows = tokens * (heads + kv_heads)  # one simdgroup per (token, head) row
    run.dispatch(kernel, [args, q_and_gate, k, v, q_norm, k_norm, q_out, gate_out, k_cache, v_cache],
                 -(-rows // 2), 64)
    q_ref, gate_ref, k_ref = reference.attention_prep(
        to_f64(q_and_gate, dtype), to_f64(k, dtype), to_f64(q_norm, dtype), to_f64(k_norm, dtype),
        np.arange(position, position + tokens), rotary_dim, theta, eps)
    window = slice(position, position + tokens)
    run.compare("q", to_f64(q_out, dtype), q_ref, REL_RMS[dtype])
    run.compare("gate", to_f64(gate_out, dtype), gate_ref, REL_RMS[dtype])
    run.compare("k cache rows", to_f64(k_cache, cache_dtype)[:, window], k_ref.transpose(1, 0, 2), REL_RMS[cache_dtype])
    run.compare("v cache rows", to_f64(v_cache, cache_dtype)[:, window], to_f64(v, dtype).transpose(1, 0, 2),
                REL_RMS[cache_dtype])


def cases(kernel: str) -> list[Case]:
    """Every case of one attention_prep kernel; the first is the self-test's (partial rotary factor 0.25)."""
    d, _, heads = attention_layout(kernel)
    return [Case(kernel, f"T=3 Hq={heads} Hkv=2 pos=37 R={d // 4} D={d}",
                 partial(_prep, kernel=kernel, tokens=3, kv_heads=2, position=37, rotary_dim=d // 4), quick=True)]
