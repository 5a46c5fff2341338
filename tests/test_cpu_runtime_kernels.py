"""The CPU runtime's kernel table (src/lily_ext/cpu/, backend="cpu") against lily.reference: every case of
lily.kernel_cases for every kernel the table runs (fresh seeded inputs, float64 references, the cases' f32
tolerances), on the "cpu" device of lily.selftest.device. The table covers what the graph builder emits in float32
mode on the CPU runtime; a kernel it lacks is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from lily import kernel_cases
from lily._ext import cpu
from lily.selftest.device import open_device

DEVICE = open_device("cpu")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in kernel_cases.cases(DEVICE.kernels)])
def test_kernel_case(case):
    outcome = case.run(DEVICE)
    assert outcome.passed, outcome.message()


def test_every_kernel_of_the_table_has_cases():
    assert all(kernel_cases.cases([name]) for name in DEVICE.kernels), [n for n in DEVICE.kernels
                                                                        if not kernel_cases.cases([n])]


def test_a_kernel_the_table_lacks_is_refused_by_name():
    with pytest.raises(RuntimeError, match="no CPU kernel qmv_q4_g64_bf16"):
        cpu.dispatch("qmv_q4_g64_bf16", [b"\0" * 16, np.zeros(4, np.float32)], (1, 1, 1), (32, 1, 1))
