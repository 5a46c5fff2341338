"""metal/attention_prep.metal (attention_prep) through the CPU harness, against lily.reference.attention_prep.

attention_prep splits q_proj's per-head [query | gate] rows, RMS-norms q and k over the whole head (multiplier 1+w),
applies partial rotate-half RoPE, and writes the roped key and the value into the KV cache at the token's position.
Cases: decode (1 token) at positions 0, 37 and 30001 (fp32 angles far from zero), prefill chunks of 3 and 7 tokens
continuing a cache, the model's head counts (16/2) and a small GQA layout, rotary dims 64 (the model's), 16 (pairs
across lanes) and 256 (the whole head), 1 and 3 simdgroups per threadgroup (a partial last threadgroup). The head-dim
64 instances (demo model, fixtures: 16 chunks of 4 per row, so lanes 16..31 idle) run the demo model's layout (4/2
heads, rotary 16), rotary 64 (the whole head) and 32, decode and prefill. Outputs and the written cache rows start
NaN-poisoned; the other cache rows hold random values that must survive.

The reference forms theta^(2i/R) in float64 and rounds once to fp32 (a correctly rounded powf), not with numpy's
float32 power, whose last bit depends on the CPU's SIMD (an ulp off on AVX-512 machines, which at position 30001 moves
an angle by 1e-3 rad). So the tight f32 tolerance, which is what catches an off-by-one rotary dimension, holds on every
machine (checked with and without AVX-512: NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL").
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily._ext import msl

D = 256
EPS = 1e-6
THETA = 1e7
KERNELS = {"f32": "attention_prep_f32_d256", "bf16": "attention_prep_bf16_d256"}
DTYPES = list(KERNELS)
KERNELS_D64 = {"f32": "attention_prep_f32_d64", "bf16": "attention_prep_bf16_d64"}
# The KV cache dtype of each activation dtype: f32 in float32 mode, bf16 otherwise.
CACHE_DTYPE = {"f32": "f32", "bf16": "bf16"}


def prep_args(tokens: int, heads: int, kv_heads: int, position: int, capacity: int, rotary_dim: int,
              theta: float = THETA, eps: float = EPS) -> bytes:
    """lily::AttentionPrepArgs (metal/lily.h)."""
    return struct.pack("<IIIIIIff", tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps)


def run_prep(kio, dtype: str, rng: np.random.Generator, tokens: int, heads: int, kv_heads: int, position: int,
             rotary_dim: int, simdgroups: int, theta: float = THETA, eps: float = EPS, head_dim: int = D):
    """Dispatch attention_prep (the instance for `head_dim`) on fresh random inputs; return (inputs, outputs) as
    float64 values."""
    capacity = position + tokens + 5
    q_and_gate = kio.to_device(rng.standard_normal((tokens, heads, 2 * head_dim)) * 2.0, dtype)
    k = kio.to_device(rng.standard_normal((tokens, kv_heads, head_dim)) * 2.0, dtype)
    v = kio.to_device(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    q_norm = kio.to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    k_norm = kio.to_device(1.0 + 0.3 * rng.standard_normal(head_dim), dtype)
    q_out = kio.poisoned((tokens, heads, head_dim), dtype)
    gate_out = kio.poisoned((tokens, heads, head_dim), dtype)
    # Rows outside [position, position + tokens) hold earlier tokens: random values that must stay untouched.
    cache_dtype = CACHE_DTYPE[dtype]
    k_cache = kio.to_device(rng.standard_normal((kv_heads, capacity, head_dim)), cache_dtype)
    v_cache = kio.to_device(rng.standard_normal((kv_heads, capacity, head_dim)), cache_dtype)
    k_cache[:, position : position + tokens] = kio.poisoned((kv_heads, tokens, head_dim), cache_dtype)
    v_cache[:, position : position + tokens] = kio.poisoned((kv_heads, tokens, head_dim), cache_dtype)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    rows = tokens * (heads + kv_heads)
    msl.dispatch(
        (KERNELS if head_dim == 256 else KERNELS_D64)[dtype],
        [prep_args(tokens, heads, kv_heads, position, capacity, rotary_dim, theta, eps), q_and_gate, k, v, q_norm,
         k_norm, q_out, gate_out, k_cache, v_cache],
        (-(-rows // simdgroups), 1, 1),
        (32 * simdgroups, 1, 1),
    )
    inputs = {name: kio.to_f64(buf, dtype) for name, buf in
              dict(q_and_gate=q_and_gate, k=k, v=v, q_norm=q_norm, k_norm=k_norm).items()}
    outputs = dict(q=kio.to_f64(q_out, dtype), gate=kio.to_f64(gate_out, dtype),
                   k_cache=kio.to_f64(k_cache, cache_dtype), v_cache=kio.to_f64(v_cache, cache_dtype))
    untouched = np.ones(capacity, bool)
    untouched[position : position + tokens] = False
    assert np.array_equal(k_cache[:, untouched], k_before[:, untouched]), "k_cache rows of other positions changed"
    assert np.array_equal(v_cache[:, untouched], v_before[:, untouched]), "v_cache rows of other positions changed"
    return inputs, outputs


def check_against_reference(kio, dtype: str, inputs, outputs, position: int, rotary_dim: int, theta: float = THETA,
                            eps: float = EPS):
    tokens = inputs["k"].shape[0]
    positions = np.arange(position, position + tokens)
    q, gate, k = reference.attention_prep(
        inputs["q_and_gate"], inputs["k"], inputs["q_norm"], inputs["k_norm"], positions, rotary_dim, theta, eps
    )
    what = f"{dtype} T={tokens} pos={position} R={rotary_dim}"
    kio.assert_close(outputs["q"], kio.round(q, dtype), dtype, f"q {what}")
    assert np.array_equal(outputs["gate"], gate.astype(np.float64)), f"gate must be copied exactly ({what})"
    window, cache_dtype = slice(position, position + tokens), CACHE_DTYPE[dtype]
    kio.assert_close(outputs["k_cache"][:, window], kio.round(k, cache_dtype).transpose(1, 0, 2), cache_dtype,
                     f"k cache {what}")
    v_stored = kio.round(inputs["v"], cache_dtype).transpose(1, 0, 2)  # one rounding to the cache dtype
    assert np.array_equal(outputs["v_cache"][:, window], v_stored), f"v cache row ({what})"


def test_reference_inv_freq_is_a_correctly_rounded_power() -> None:
    """reference.rope's theta^(-2i/R) equals the float64 value rounded once per fp32 step, for every exponent the
    kernels see, whatever SIMD numpy dispatches to (glibc's powf gives the same here)."""
    for theta in (THETA, 1e6):
        for rotary_dim in (16, 32, 64, 256):
            positions = np.array([30001])  # far out: an ulp of inv_freq moves the angle by up to 1e-3 rad
            x = np.zeros((1, 1, rotary_dim), np.float32)
            x[..., : rotary_dim // 2] = 1.0  # first half 1, second half 0: out = (cos a, sin a) per pair
            out = reference.rope(x, positions, rotary_dim, theta)
            exponent = (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim).astype(np.float32)
            power = (float(np.float32(theta)) ** exponent.astype(np.float64)).astype(np.float32)
            inv_freq = (1.0 / power.astype(np.float64)).astype(np.float32)
            angles = (np.float64(positions[0]) * inv_freq.astype(np.float64)).astype(np.float32)  # fp32 product
            expected = np.cos(angles.astype(np.float64)).astype(np.float32)
            np.testing.assert_array_equal(out[0, 0, : rotary_dim // 2], expected)


CASES = [
    # (tokens, heads, kv_heads, position, rotary_dim, simdgroups)
    (1, 16, 2, 0, 64, 1),  # decode, first token: RoPE is the identity at position 0
    (1, 16, 2, 37, 64, 3),  # decode with 18 rows over 3-simdgroup threadgroups
    (1, 16, 2, 38, 64, 8),  # the engine's 8 simdgroups: 18 rows over 3 threadgroups, the last with 2 rows
    (1, 4, 1, 30001, 64, 1),  # decode far out: fp32 angles up to 3e4 rad
    (3, 4, 1, 9, 16, 3),  # prefill chunk; rotary pairs (d, d+8) sit in different lanes
    (7, 16, 2, 100, 64, 3),  # prefill chunk with the model's heads; 126 rows, a partial last threadgroup
    (2, 8, 2, 5, 256, 1),  # rotary over the whole head: pairs (d, d+128) sit in the same lane
]


@pytest.mark.parametrize("tokens,heads,kv_heads,position,rotary_dim,simdgroups", CASES,
                         ids=[f"T{c[0]}-h{c[1]}x{c[2]}-p{c[3]}-r{c[4]}-sg{c[5]}" for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prep(dtype: str, tokens: int, heads: int, kv_heads: int, position: int, rotary_dim: int,
                        simdgroups: int, kio) -> None:
    rng = np.random.default_rng(100 * tokens + 10 * position + rotary_dim + DTYPES.index(dtype))
    inputs, outputs = run_prep(kio, dtype, rng, tokens, heads, kv_heads, position, rotary_dim, simdgroups)
    check_against_reference(kio, dtype, inputs, outputs, position, rotary_dim)


def test_attention_prep_reads_theta_and_eps(kio) -> None:
    """theta and eps come from the argument struct: theta 1e6 (the wrong Qwen3 value) and eps 4 (large against the
    inputs' mean square of 4) give a different result that matches the reference with the same values."""
    rng = np.random.default_rng(3)
    inputs, outputs = run_prep(kio, "f32", rng, 2, 4, 1, 50, 64, 1, theta=1e6, eps=4.0)
    check_against_reference(kio, "f32", inputs, outputs, 50, 64, theta=1e6, eps=4.0)
    for theta, eps in ((1e7, 4.0), (1e6, EPS)):
        q_other, _, _ = reference.attention_prep(inputs["q_and_gate"], inputs["k"], inputs["q_norm"], inputs["k_norm"],
                                                 np.arange(50, 52), 64, theta, eps)
        assert not np.allclose(outputs["q"], q_other, atol=1e-3), f"theta {theta}, eps {eps} must give another q"


def test_attention_prep_norm_before_rope_over_whole_head(kio) -> None:
    """Only the first rotary_dim dims rotate; the rest are the plain normalised values (norm over all D dims)."""
    rng = np.random.default_rng(4)
    position, rotary_dim = 12, 64
    inputs, outputs = run_prep(kio, "f32", rng, 1, 4, 1, position, rotary_dim, 2)
    normed = reference.rms_norm(inputs["q_and_gate"][..., :D], inputs["q_norm"], EPS)
    kio.assert_close(outputs["q"][..., rotary_dim:], normed[..., rotary_dim:], "f32", "pass-through dims")
    assert not np.allclose(outputs["q"][..., :rotary_dim], normed[..., :rotary_dim], atol=1e-3), "rotary dims rotate"


D64_CASES = [
    # (tokens, heads, kv_heads, position, rotary_dim, simdgroups)
    (1, 4, 2, 0, 16, 8),  # the demo model's decode layout (rotary 64 * 0.25) at the engine's 8 simdgroups
    (1, 4, 2, 301, 16, 3),  # decode, a partial last threadgroup
    (5, 4, 2, 7, 16, 2),  # a prefill chunk continuing a cache
    (3, 8, 2, 11, 32, 3),  # the gqa4 fixture's layout (rotary 64 * 0.5): pairs (d, d+16) in different lanes
    (2, 2, 1, 40, 64, 1),  # rotary over the whole head
]


@pytest.mark.parametrize("tokens,heads,kv_heads,position,rotary_dim,simdgroups", D64_CASES,
                         ids=[f"T{c[0]}-h{c[1]}x{c[2]}-p{c[3]}-r{c[4]}-sg{c[5]}" for c in D64_CASES])
@pytest.mark.parametrize("dtype", list(KERNELS_D64))
def test_attention_prep_d64(dtype: str, tokens: int, heads: int, kv_heads: int, position: int, rotary_dim: int,
                            simdgroups: int, kio) -> None:
    rng = np.random.default_rng(500 + 100 * tokens + 10 * position + rotary_dim + DTYPES.index(dtype))
    inputs, outputs = run_prep(kio, dtype, rng, tokens, heads, kv_heads, position, rotary_dim, simdgroups,
                               head_dim=64)
    check_against_reference(kio, dtype, inputs, outputs, position, rotary_dim)


@pytest.mark.parametrize("case", op_cases("attention_prep"))
def test_attention_prep_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.attention_prep: the self-test's, on this session's device."""
    check(case, kernel_device)
