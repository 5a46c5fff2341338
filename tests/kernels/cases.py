"""The bridge from ``lily.kernel_cases`` to pytest: every case of an op as a parameter with an explicit id, and the
check that fails with the case's message (kernel, shape, max error, tolerance)."""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib

import pytest

from lily import kernel_cases
from lily._ext import msl

# The harness and the CUDA runner refuse a wrong argument struct before running (ValueError); the Metal API does not
# check setBytes sizes at all (the fake Metal reports the harness's check as a failed command buffer).
checks_arguments = pytest.mark.skipif(os.environ.get("LILY_KERNEL_DEVICE") == "metal-api",
                                      reason="the Metal API does not check argument struct sizes")


def op_cases(op: str) -> list:
    """Every case of `op` over the kernels the session's device has, as pytest params named by the case's id."""
    found = kernel_cases.cases(msl.kernel_names(), op=op)
    assert found, f"no cases for op {op!r}"
    return [pytest.param(case, id=case.id) for case in found]


def check(case: kernel_cases.Case, device) -> None:
    """Run `case` on `device`; fail with its message unless every output is within tolerance. On the CPU harness every
    other case (by its id) runs under the greedy_simdgroups schedule, where one simdgroup runs ahead to its next
    barrier, so that threadgroup memory one simdgroup overwrites before another has read it shows; the others keep
    the random schedule, which mixes the lanes of a simdgroup."""
    if device.kind == "harness" and zlib.crc32(case.id.encode()) % 2:
        device = dataclasses.replace(device, run=functools.partial(device.run, greedy_simdgroups=True))
    outcome = case.run(device)
    assert outcome.passed, outcome.message()
