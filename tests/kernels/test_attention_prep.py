"""metal/attention_prep.metal: every case of lily.kernel_cases.attention_prep (decode and prefill positions, rotary
dims, simdgroup counts, head dims 256 and 64, theta and eps from the arguments), then what the cases do not cover:
that the reference's inv_freq is a correctly rounded power, that other theta/eps values give another q, and that
only the rotary dims rotate.

The reference forms theta^(2i/R) in float64 and rounds once to fp32 (a correctly rounded powf), not with numpy's
float32 power, whose last bit depends on the CPU's SIMD (an ulp off on AVX-512 machines, which at position 30001 moves
an angle by 1e-3 rad). So the tight f32 tolerance, which is what catches an off-by-one rotary dimension, holds on every
machine (checked with and without AVX-512: NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL").
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily import reference
from lily.kernel_cases.attention_prep import EPS, THETA, check_prep, run_prep
from lily.kernel_cases.common import Run

D = 256


@pytest.mark.parametrize("case", op_cases("attention_prep"))
def test_attention_prep(case, kernel_device) -> None:
    check(case, kernel_device)


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


def test_attention_prep_reads_theta_and_eps(kernel_device) -> None:
    """theta and eps come from the argument struct: theta 1e6 (the wrong Qwen3 value) and eps 4 (large against the
    inputs' mean square of 4) give a different result that matches the reference with the same values."""
    run = Run(kernel_device, np.random.default_rng(3))
    inputs, outputs = run_prep(run, "attention_prep_f32_d256", 2, 4, 1, 50, 64, 1, theta=1e6, eps=4.0)
    check_prep(run, "f32", inputs, outputs, 50, 64, theta=1e6, eps=4.0)
    assert all(c.passed for c in run.comparisons), [c for c in run.comparisons if not c.passed]
    for theta, eps in ((1e7, 4.0), (1e6, EPS)):
        q_other, _, _ = reference.attention_prep(inputs["q_and_gate"], inputs["k"], inputs["q_norm"], inputs["k_norm"],
                                                 np.arange(50, 52), 64, theta, eps)
        assert not np.allclose(outputs["q"], q_other, atol=1e-3), f"theta {theta}, eps {eps} must give another q"


def test_attention_prep_norm_before_rope_over_whole_head(kio, kernel_device) -> None:
    """Only the first rotary_dim dims rotate; the rest are the plain normalised values (norm over all D dims)."""
    position, rotary_dim = 12, 64
    run = Run(kernel_device, np.random.default_rng(4))
    inputs, outputs = run_prep(run, "attention_prep_f32_d256", 1, 4, 1, position, rotary_dim, 2)
    normed = reference.rms_norm(inputs["q_and_gate"][..., :D], inputs["q_norm"], EPS)
    kio.assert_close(outputs["q"][..., rotary_dim:], normed[..., rotary_dim:], "f32", "pass-through dims")
    assert not np.allclose(outputs["q"][..., :rotary_dim], normed[..., :rotary_dim], atol=1e-3), "rotary dims rotate"
