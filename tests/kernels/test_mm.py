"""metal/mm.metal (the IN_GEMM_DEQUANT ablation's dense GEMM): every case of lily.kernel_cases.mm (M and N around
the row and column tiles, K of one and several groups, and dequantize_* + mm_* against qmm's reference)."""

from __future__ import annotations

import pytest
from cases import check, op_cases


@pytest.mark.parametrize("case", op_cases("mm"))
def test_mm(case, kernel_device) -> None:
    check(case, kernel_device)
