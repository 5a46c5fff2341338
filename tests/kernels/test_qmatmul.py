"""metal/qmatmul.metal: every case of lily.kernel_cases.qmatmul (qmv, qmm, qmm_nax and the decode fusions at
boundary and model shapes, against lily.reference.qmatmul within the fp32 accumulation allowance), then what the
cases do not cover: one fixed summation order whatever the fiber schedule, and a wrong argument struct refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, checks_arguments, op_cases

from lily._ext import msl
from lily.kernel_cases.common import Run, random_weight, to_f64, weight_buffers
from lily.kernel_cases.qmatmul import (QMM_BN, QMV_MMA_CODE_OFFSET, QMV_MMA_ROWS, QMV_MMA_SIMDGROUPS,
                                       QMV_ROWS_PER_THREADGROUP, check_matmul, qmatmul_args)


@pytest.mark.parametrize("case", op_cases("qmatmul"))
def test_qmatmul(case, kernel_device) -> None:
    check(case, kernel_device)


@checks_arguments
def test_qmv_wrong_argument_struct() -> None:
    x = np.ones((1, 64), np.float32)
    w = np.zeros((8, 8), np.uint32)
    s = np.ones((8, 1), np.float32)
    with pytest.raises(ValueError, match=r"qmv_q4_g64_f32_sf32.*buffer\(0\).*16 bytes.*got 8"):
        msl.dispatch("qmv_q4_g64_f32_sf32", [struct.pack("<II", 64, 8), x, w, s, s, x], (1, 1, 1), (64, 1, 1))


@pytest.mark.parametrize("name", ["qmv_q4_g64_f32", "qmm_q4_g64_f32_bm32", "qmv_mma_q4_g64_bf16"])
def test_results_do_not_depend_on_the_schedule(name: str, kio, kernel_device) -> None:
    """Each output has one fixed summation order (qmv_mma: its simdgroups' partial sums added in simdgroup order after
    a barrier): FIFO and random fiber schedules give the same bits."""
    rng = np.random.default_rng(11)
    m, n, k = (40, 40, 256) if name.startswith("qmm") else (2, 20, 1024)
    qt = random_weight(rng, (n, k), 4, "bf16")
    dtype = "bf16" if name.startswith("qmv_mma") else "f32"
    x = kio.to_device(rng.standard_normal((m, k)), dtype)
    buffers = weight_buffers(qt, "bf16")
    if name.startswith("qmm"):
        grid, threads = (-(-n // QMM_BN), -(-m // 32), 1), (128, 1, 1)
    elif name.startswith("qmv_mma"):
        grid, threads = (-(-n // QMV_MMA_ROWS), -(-m // 8), 1), (32 * max(QMV_MMA_SIMDGROUPS), 1, 1)
    else:
        grid, threads = (-(-n // QMV_ROWS_PER_THREADGROUP), m, 1), (64, 1, 1)
    results = []
    for random_schedule, seed in [(False, 0), (True, 1), (True, 2)]:
        y = kio.poisoned((m, n), dtype)
        msl.dispatch(name, [qmatmul_args(k, n, m), x, *buffers, y], grid, threads, random_schedule=random_schedule,
                     seed=seed)
        results.append(y)
    assert all(np.array_equal(results[0], r) for r in results[1:])
    run = Run(kernel_device, rng)
    check_matmul(run, results[0], dtype, to_f64(x, dtype), qt,
                 code_offset=QMV_MMA_CODE_OFFSET if name.startswith("qmv_mma") else 0)
    (comparison,) = run.comparisons
    assert comparison.passed, f"{name} schedules: {comparison}"
