"""metal/dequantize.metal (the IN_GEMM_DEQUANT ablation's first pass; mm_* is test_mm.py): every case of
lily.kernel_cases.dequantize (word counts around the threadgroup, one row, several groups, extreme codes and a
zero-scale group) against lily.reference.dequantize rounded once to the output dtype."""

from __future__ import annotations

import pytest
from cases import check, op_cases


@pytest.mark.parametrize("case", op_cases("dequantize"))
def test_dequantize(case, kernel_device) -> None:
    check(case, kernel_device)
