"""Cases of metal/mm.metal (the IN_GEMM_DEQUANT ablation's dense GEMM) against ``lily.reference.mm`` on the kernel's
exact dense weight, and dequantize_* + mm_* against qmm's reference on the same quantized weight.

Shapes cross the kernel's boundaries: one output row, M and N around the 16/32-row and 32-column tiles, K of one and
several 64-groups.
"""

from __future__ import annotations

import re
from functools import partial

import numpy as np

from lily.kernel_cases.common import Case, Run, dtype_of, poisoned, random_weight, to_device, to_f64
from lily.kernel_cases.dequantize import run_dequantize
from lily.kernel_cases.qmatmul import QMM_BN, QMM_THREADS, check_matmul, qmatmul_args

PATTERN = re.compile(r"mm_(f32|bf16)_bm(16|32|64)")
# (M, N, K): the self-test's (partial tiles in M and N); one row, partial and exact tiles, K of one and several groups.
SHAPES = [(None, 37, 256), (1, 1, 64), (5, 31, 64), (16, 32, 128), (17, 33, 192), (33, 40, 64)]


def run_mm(run: Run, kernel: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x · wᵀ by `kernel` (tiles of bm rows by 64 columns)."""
    dtype, bm = dtype_of(kernel), int(kernel[-2:])
    (m, k), n = x.shape, w.shape[0]
    y = poisoned((m, n), dtype)
    run.dispatch(kernel, [qmatmul_args(k, n, m), x, w, y], (-(-n // QMM_BN), -(-m // bm), 1), QMM_THREADS)
    return y


def _mm(run: Run, kernel: str, m: int, n: int, k: int) -> None:
    dtype = dtype_of(kernel)
    x = to_device(run.rng.standard_normal((m, k)), dtype)
    w = to_device(run.rng.standard_normal((n, k)) / np.sqrt(k), dtype)
    y = run_mm(run, kernel, x, w)
    check_matmul(run, y, dtype, to_f64(x, dtype), to_f64(w, dtype).astype(np.float32))


def _dequantize_then_mm(run: Run, kernel: str, bits: int) -> None:
    """The ablation's two passes in f32 give the in-GEMM dequantization's result (qmm), within fp32 accumulation."""
    m, n, k = 19, 37, 128
    weight = random_weight(run.rng, (n, k), bits, "bf16")
    x = to_device(run.rng.standard_normal((m, k)), "f32")
    dense = run_dequantize(run, f"dequantize_q{bits}_g64_f32", weight)
    check_matmul(run, run_mm(run, kernel, x, dense), "f32", to_f64(x, "f32"), weight)


def cases(kernel: str) -> list[Case]:
    """Every case of one mm kernel; the first is the self-test's."""
    bm = int(kernel[-2:])
    found = []
    for i, (m, n, k) in enumerate(SHAPES):
        m = bm + 3 if m is None else m
        found.append(Case(kernel, f"M={m} N={n} K={k}", partial(_mm, kernel=kernel, m=m, n=n, k=k), quick=i == 0))
    if kernel == "mm_f32_bm32":
        found += [Case(kernel, f"M=19 N=37 K=128 after dequantize_q{bits}", partial(_dequantize_then_mm,
                                                                                    kernel=kernel, bits=bits))
                  for bits in (4, 8)]
    return found
