"""metal/rms_norm.metal: every case of lily.kernel_cases.rms_norm (row lengths across the SIMD width and the
threadgroup, 1 or 3 rows, the residual sum in place, a zero row), then what the cases do not cover: the bits do not
depend on the fiber schedule, and a wrong argument struct is refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, checks_arguments, op_cases

from lily import reference
from lily._ext import msl
from lily.kernel_cases.rms_norm import EPS, rms_norm_args


@pytest.mark.parametrize("case", op_cases("rms_norm"))
def test_rms_norm(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rms_norm_independent_of_schedule(seed: int, kio) -> None:
    """Every thread sums the simdgroup partials in the same order: the bits do not depend on the schedule."""
    rng = np.random.default_rng(5)
    n = 1000
    x = kio.to_device(3.0 * rng.standard_normal((2, n)), "f32")
    weight = kio.to_device(1.0 + 0.5 * rng.standard_normal(n), "f32")
    results = []
    for random_schedule in (False, True):
        out = kio.poisoned((2, n), "f32")
        msl.dispatch("rms_norm_f32", [rms_norm_args(n), x, weight, out], (2, 1, 1), (96, 1, 1),
                     random_schedule=random_schedule, seed=seed)
        results.append(out)
    assert np.array_equal(results[0], results[1])
    kio.assert_close(results[1], reference.rms_norm(x, weight, EPS), "f32", "random schedule")


@checks_arguments
def test_rms_norm_rejects_wrong_argument_struct() -> None:
    x = np.ones((1, 32), np.float32)
    with pytest.raises(ValueError, match=r"rms_norm_f32.*buffer\(0\).*16 bytes.*got 8"):
        msl.dispatch("rms_norm_f32", [struct.pack("<If", 32, EPS), x, x[0], x], (1, 1, 1), (32, 1, 1))
