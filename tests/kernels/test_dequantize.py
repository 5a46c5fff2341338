"""metal/dequantize.metal and the dense mm_* GEMM of metal/qmatmul.metal (the IN_GEMM_DEQUANT ablation).

dequantize_* is compared with lily.quant.dequantize (exact fp32 scale * q + bias) rounded once to the output dtype;
mm_* with lily.reference.qmatmul on the kernel's exact dense weight. Shapes cross the kernels' boundaries: word counts
around the 256-thread threadgroup of dequantize (a partial last threadgroup), one output row, M and N around the
16/32-row and 32-column tiles of mm, K of one and several 64-groups. Outputs start NaN-poisoned; the fiber schedule is
randomised.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from test_qmatmul import assert_matmul_close, qmatmul_args, random_weight, random_x, weight_buffers

from lily._ext import msl
from lily.quant import QuantizedTensor, pack

# (bits, output dtype, scale dtype) -> host name
DEQUANTIZE = {
    (4, "f32", "bf16"): "dequantize_q4_g64_f32",
    (4, "bf16", "bf16"): "dequantize_q4_g64_bf16",
    (4, "f32", "f32"): "dequantize_q4_g64_f32_sf32",
    (4, "bf16", "f32"): "dequantize_q4_g64_bf16_sf32",
    (8, "f32", "bf16"): "dequantize_q8_g64_f32",
    (8, "bf16", "bf16"): "dequantize_q8_g64_bf16",
    (8, "f32", "f32"): "dequantize_q8_g64_f32_sf32",
    (8, "bf16", "f32"): "dequantize_q8_g64_bf16_sf32",
}
# (dtype, rows per tile) -> host name
MM = {
    ("f32", 16): "mm_f32_bm16",
    ("bf16", 16): "mm_bf16_bm16",
    ("f32", 32): "mm_f32_bm32",
    ("bf16", 32): "mm_bf16_bm32",
}
DEQUANTIZE_THREADS = 256  # LILY_DEQUANTIZE_THREADS
MM_BN = 32  # LILY_QMM_BN


def dequantize_args(k: int, n: int) -> bytes:
    """lily::DequantizeArgs (metal/lily.h): u32 in_features, out_features, two u32 of padding."""
    return struct.pack("<IIII", k, n, 0, 0)


def run_dequantize(name: str, qt, scale_dtype: str, dtype: str, kio) -> np.ndarray:
    n, k = qt.shape
    out = kio.poisoned((n, k), dtype)
    words = qt.weight.size
    grid = (-(-words // DEQUANTIZE_THREADS), 1, 1)
    msl.dispatch(name, [dequantize_args(k, n), *weight_buffers(qt, scale_dtype, kio), out], grid,
                 (DEQUANTIZE_THREADS, 1, 1))
    return out


# (N, K): one row of one group; word counts below, at and above one threadgroup at 4 and 8 bits; several groups.
DEQUANTIZE_SHAPES = [(1, 64), (3, 128), (32, 64), (33, 64), (5, 576)]


@pytest.mark.parametrize("n,k", DEQUANTIZE_SHAPES, ids=[f"n{n}-k{k}" for n, k in DEQUANTIZE_SHAPES])
@pytest.mark.parametrize("key", list(DEQUANTIZE), ids=list(DEQUANTIZE.values()))
def test_dequantize(key, n: int, k: int, kio) -> None:
    bits, dtype, scale_dtype = key
    rng = np.random.default_rng([bits, n, k, list(DEQUANTIZE).index(key)])
    qt = random_weight(rng, n, k, bits, scale_dtype)
    out = run_dequantize(DEQUANTIZE[key], qt, scale_dtype, dtype, kio)
    expected = kio.round(qt.dequantize(), dtype)
    kio.assert_close(kio.to_f64(out, dtype), expected, dtype, f"{DEQUANTIZE[key]} N={n} K={k}")


def test_dequantize_extreme_codes(kio) -> None:
    """All-0 and all-max codes and a zero-scale group (bias only): each code lands at its own element."""
    rng = np.random.default_rng(7)
    qt = random_weight(rng, 2, 128, 4, "f32")
    codes = np.zeros((2, 128), np.uint8)
    codes[0, 64:] = 15
    codes[1] = np.arange(128) % 16
    scales = qt.scales.copy()
    scales[1, 0] = 0.0
    qt = QuantizedTensor(pack(codes, 4), scales, qt.biases, 4, 64, qt.dtype)
    out = run_dequantize("dequantize_q4_g64_f32_sf32", qt, "f32", "f32", kio)
    kio.assert_close(kio.to_f64(out, "f32"), kio.round(qt.dequantize(), "f32"), "f32", "extreme codes")


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
