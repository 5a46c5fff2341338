"""Shared helpers for kernel tests: the device the cases run on, dtype conversion, NaN-poisoned outputs, the per-dtype
tolerance table.

The cases of each op are defined once in ``lily.kernel_cases.<op>`` (``tests/kernels/cases.py`` parametrizes over
them); the tests here that are not cases (dispatch and host logic, schedule independence, chains of kernels) call
``msl.dispatch`` directly. Kernels run on the device ``LILY_KERNEL_DEVICE`` names (``lily.selftest.device``): the
CPU execution harness by default (``lily._ext.msl``, docs/harness.md), ``cuda`` (an NVIDIA GPU, docs/cuda.md) or
``metal-api`` (the Metal API: a Mac's GPU, the fake Metal on Linux); off the harness, ``msl.dispatch`` goes to that
device too. Device buffers are numpy arrays in the kernel's storage type: float32, float16, or bf16 held as uint16
bits. Tests use the ``kio`` fixture (an instance of ``KernelIO``) and ``kernel_device``.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from lily.kernel_cases import common
from lily.kernel_cases.common import TOLERANCES
from lily.selftest.device import KernelDevice, open_device

KERNEL_DEVICE = os.environ.get("LILY_KERNEL_DEVICE", "harness")
_opened: list[KernelDevice] = []


def kernel_device_in_use() -> KernelDevice:
    """The device of this session (opened once)."""
    if not _opened:
        _opened.append(open_device(KERNEL_DEVICE))
    return _opened[0]


def _dispatch_on_the_device() -> None:
    """Off the harness, the tests' ``msl.dispatch`` runs on the chosen device, which counts the executions for the
    registry's coverage line. Where the extension (or its harness) is absent, as on the GPU machine without clang or
    on a Mac, a stand-in ``lily._ext.msl`` is installed."""
    device = kernel_device_in_use()
    try:
        from lily._ext import msl
    except ImportError:
        msl = types.ModuleType("lily._ext.msl")
        msl.test_kernel_names = lambda: []
        try:
            from lily import _ext
        except ImportError:  # no extension at all: the package itself stands in
            _ext = sys.modules["lily._ext"] = types.ModuleType("lily._ext")
        _ext.msl = msl
        sys.modules["lily._ext.msl"] = msl
    msl.dispatch = device.dispatch
    msl.executions = lambda: dict(device.runs)
    msl.kernel_names = lambda: sorted(device.kernels)
    if device.kind == "cuda":
        from lily import cuda

        msl.KernelError = cuda.CudaError
    else:
        msl.KernelError = RuntimeError


if KERNEL_DEVICE != "harness":
    _dispatch_on_the_device()


def pytest_collection_modifyitems(items) -> None:
    """The registry's execution check goes last: it counts the kernels every other test of the session ran. On CUDA,
    the Metal 4 tensor-op kernels (qmm_nax) are not built (their #if is false there): their cases skip."""
    last = [item for item in items if item.name == "test_every_kernel_was_executed"]
    items[:] = [item for item in items if item not in last] + last
    if KERNEL_DEVICE == "cuda":
        for item in items:
            if "qmm_nax" in item.name:
                item.add_marker(pytest.mark.skip(reason="qmm_nax (Metal 4 tensor ops) has no CUDA build"))


class KernelIO:
    """Converts between float64/float32 test values and a kernel's storage dtype (``lily.kernel_cases.common``)."""

    tolerances = TOLERANCES

    def to_device(self, values: np.ndarray, dtype: str) -> np.ndarray:
        """A C-contiguous buffer of `values` rounded to `dtype` ("f32", "f16" or "bf16")."""
        return common.to_device(values, dtype)

    def to_f64(self, buffer: np.ndarray, dtype: str) -> np.ndarray:
        """The values held by a device buffer, widened exactly."""
        return common.to_f64(buffer, dtype)

    def round(self, values: np.ndarray, dtype: str) -> np.ndarray:
        """`values` rounded once to `dtype`, as float64."""
        return common.round_to(values, dtype)

    def poisoned(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An output buffer filled with NaN, so elements the kernel does not write are caught."""
        return common.poisoned(shape, dtype)

    def assert_close(self, actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
        """NaN/Inf positions first, then the relative RMS error, then element-wise tolerance (the cases' rule)."""
        result = common.compare_values(what, actual, expected, TOLERANCES[dtype])
        assert result.passed, f"{what}: max error {result.max_error:.3g}, relative RMS error {result.error:.3g}, " \
                              f"tolerance {result.tolerance} ({dtype}); {result.detail}"


@pytest.fixture(scope="session")
def kio() -> KernelIO:
    """Conversion and comparison helpers for kernel tests."""
    return KernelIO()


@pytest.fixture(scope="session")
def kernel_device() -> KernelDevice:
    """The device the kernel cases run on (LILY_KERNEL_DEVICE, default the CPU harness)."""
    return kernel_device_in_use()




def pytest_sessionfinish(session) -> None:
    """With LILY_KERNEL_EXECUTIONS set, write this session's kernel executions there (JSON: name -> runs)."""
    import json
    import os

    path = os.environ.get("LILY_KERNEL_EXECUTIONS")
    if path:
        from lily._ext import msl

        with open(path, "w", encoding="utf-8") as f:
            json.dump(msl.executions(), f)


def pytest_terminal_summary(terminalreporter) -> None:
    """Print the kernel coverage count at the end of every run that collected the kernel tests."""
    from lily import _ext

    if getattr(_ext, "msl", None) is None:  # a build without the harness: the kernel tests were skipped
        return
    from test_registry import kernel_test_coverage

    names, executed = kernel_test_coverage()
    terminalreporter.write_line(f"instantiated kernels: {len(names)}, executed by tests: {len(executed)}")
