"""metal/mm.metal (the IN_GEMM_DEQUANT ablation's dense GEMM) through the CPU harness.

mm_* is compared with lily.reference.qmatmul on the kernel's exact dense weight, and dequantize_* + mm_* with qmm on
the same quantized weight. Shapes cross the kernel's boundaries: one output row, M and N around the 16/32-row and
32-column tiles, K of one and several 64-groups. Outputs start NaN-poisoned; the fiber schedule is randomised.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_dequantize import run_dequantize
from test_qmatmul import assert_matmul_close, qmatmul_args, random_weight, random_x

from lily._ext import msl

# (dtype, rows per tile) -> host name
MM = {
    ("f32", 16): "mm_f32_bm16",
    ("bf16", 16): "mm_bf16_bm16",
    ("f32", 32): "mm_f32_bm32",
    ("bf16", 32): "mm_bf16_bm32",
}
MM_BN = 32  # LILY_QMM_BN


def run_mm(name: str, bm: int, x: np.ndarray, w: np.ndarray, dtype: str, kio) -> np.ndarray:
    m, k = x.shape
    n = w.shape[0]
    y = kio.poisoned((m, n), dtype)
    grid = (-(-n // MM_BN), -(-m // bm), 1)
    msl.dispatch(name, [qmatmul_args(k, n, m), x, w, y], grid, (64 if bm == 16 else 128, 1, 1))
    return y


# (M, N, K): one row, partial and exact tiles in M around 16/32 and in N around 32, K of one and several groups.
MM_SHAPES = [(1, 1, 64), (5, 31, 64), (16, 32, 128), (17, 33, 192), (33, 40, 64)]


@pytest.mark.parametrize("m,n,k", MM_SHAPES, ids=[f"m{m}-n{n}-k{k}" for m, n, k in MM_SHAPES])
@pytest.mark.parametrize("key", list(MM), ids=list(MM.values()))
def test_mm(key, m: int, n: int, k: int, kio) -> None:
    dtype, bm = key
    rng = np.random.default_rng([m, n, k, list(MM).index(key)])
    x = random_x(rng, m, k, dtype, kio)
    w = kio.to_device(rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    y = run_mm(MM[key], bm, x, w, dtype, kio)
    assert_matmul_close(y, x, kio.to_f64(w, dtype).astype(np.float32), dtype, kio, f"{MM[key]} M={m} N={n} K={k}")


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_then_mm_matches_qmm(bits: int, kio) -> None:
    """The ablation's two passes in f32 give the in-GEMM dequantization's result (qmm), within fp32 accumulation."""
    rng = np.random.default_rng(40 + bits)
    m, n, k = 19, 37, 128
    qt = random_weight(rng, n, k, bits, "bf16")
    x = random_x(rng, m, k, "f32", kio)
    dense = run_dequantize(f"dequantize_q{bits}_g64_f32", qt, "bf16", "f32", kio)
    y = run_mm("mm_f32_bm32", 32, x, dense, "f32", kio)
    assert_matmul_close(y, x, qt, "f32", kio, f"dequantize + mm, {bits} bits")
