"""Cases of metal/dequantize.metal (the IN_GEMM_DEQUANT ablation's first pass) against ``lily.reference.dequantize``
(exact fp32 scale * q + bias) rounded once to the output dtype.

Shapes cross the kernel's boundaries: word counts around the 256-thread threadgroup (a partial last threadgroup),
one output row, K of one and several 64-groups; all-0 and all-max codes and a zero-scale group.
"""

from __future__ import annotations

import re
import struct
from functools import partial

import numpy as np

from lily import reference
from lily.kernel_cases.common import (Case, Run, dtype_of, poisoned, random_weight, round_to, scale_dtype_of, to_f64,
                                      weight_buffers, bits_of)
from lily.quant import QuantizedTensor, pack

PATTERN = re.compile(r"dequantize_q(4|8)_g64_(f32|bf16)(_sf32)?")
THREADS = 256  # LILY_DEQUANTIZE_THREADS: one packed word per thread
# (N, K): the self-test's; one row of one group; word counts below, at and above one threadgroup; several groups.
SHAPES = [(40, 512), (1, 64), (3, 128), (32, 64), (33, 64), (5, 576)]


def dequantize_args(k: int, n: int) -> bytes:
    """lily::DequantizeArgs (metal/lily.h): u32 in_features, out_features, two u32 of padding."""
    return struct.pack("<IIII", k, n, 0, 0)


def run_dequantize(run: Run, kernel: str, weight: QuantizedTensor) -> np.ndarray:
    """The kernel's dense [N, K] output buffer for `weight`."""
    n, k = weight.shape
    out = poisoned((n, k), dtype_of(kernel))
    run.dispatch(kernel, [dequantize_args(k, n), *weight_buffers(weight, scale_dtype_of(kernel)), out],
                 -(-weight.weight.size // THREADS), THREADS)
    return out


def _dequantize(run: Run, kernel: str, n: int, k: int, weight: QuantizedTensor | None = None) -> None:
    dtype = dtype_of(kernel)
    if weight is None:
        weight = random_weight(run.rng, (n, k), bits_of(kernel), scale_dtype_of(kernel))
    out = run_dequantize(run, kernel, weight)
    run.compare("w", to_f64(out, dtype), round_to(reference.dequantize(weight), dtype), dtype)


def _extreme_codes(run: Run, kernel: str) -> None:
    """All-0 and all-max codes and a zero-scale group (bias only): each code lands at its own element."""
    weight = random_weight(run.rng, (2, 128), 4, "f32")
    codes = np.zeros((2, 128), np.uint8)
    codes[0, 64:] = 15
    codes[1] = np.arange(128) % 16
    scales = weight.scales.copy()
    scales[1, 0] = 0.0
    _dequantize(run, kernel, 2, 128, QuantizedTensor(pack(codes, 4), scales, weight.biases, 4, 64, weight.dtype))


def cases(kernel: str) -> list[Case]:
    """Every case of one dequantize kernel; the first is the self-test's."""
    found = [Case(kernel, f"N={n} K={k}", partial(_dequantize, kernel=kernel, n=n, k=k), quick=i == 0)
             for i, (n, k) in enumerate(SHAPES)]
    if kernel == "dequantize_q4_g64_f32_sf32":
        found.append(Case(kernel, "N=2 K=128 extreme-codes", partial(_extreme_codes, kernel=kernel)))
    return found
