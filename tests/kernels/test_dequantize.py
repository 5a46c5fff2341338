"""metal/dequantize.metal (the IN_GEMM_DEQUANT ablation's first pass; mm_* is test_mm.py) through the CPU harness.

dequantize_* is compared with lily.reference.dequantize (exact fp32 scale * q + bias) rounded once to the output
dtype. Shapes cross the kernel's boundaries: word counts around the 256-thread threadgroup (a partial last
threadgroup), one output row, K of one and several 64-groups. Outputs start NaN-poisoned; the fiber schedule is
randomised.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from test_qmatmul import assert_matmul_close, qmatmul_args, random_weight, random_x, weight_buffers

from lily import reference
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
DEQUANTIZE_THREADS = 256  # LILY_DEQUANTIZE_THREADS


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
    expected = kio.round(reference.dequantize(qt), dtype)
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
