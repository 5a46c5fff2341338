"""Shared helpers for kernel tests: dtype conversion, NaN-poisoned outputs, the per-dtype tolerance table.

Kernels run through the CPU execution harness (``lily._ext.msl.dispatch``, docs/harness.md). Device
buffers are numpy arrays in the kernel's storage type: float32, float16, or bf16 held as uint16 bits.
Tests use the ``kio`` fixture (an instance of ``KernelIO``).
"""

from __future__ import annotations

import collections
import os
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

from lily.quant import bfloat16_bits_to_float32, float32_to_bfloat16_bits


def _use_cuda_for_dispatch() -> None:
    """LILY_KERNEL_DEVICE=cuda: the same test cases dispatch on the NVIDIA GPU (lily.cuda, through the extension's
    driver layer) instead of the CPU harness. Where the extension is built without the harness (g++, as on the GPU
    machine, which has no clang 19), a stand-in ``lily._ext.msl`` is installed."""
    from lily import _ext, cuda

    runner = cuda.Runner()
    try:
        from lily._ext import msl
    except ImportError:
        msl = types.ModuleType("lily._ext.msl")
        msl.test_kernel_names = lambda: []
        _ext.msl = msl
        sys.modules["lily._ext.msl"] = msl
    runs: collections.Counter[str] = collections.Counter()

    def dispatch(kernel: str, *args, **options):
        runs[kernel] += 1  # the harness counts its runs; the GPU's are counted here, for the registry's coverage line
        return runner.dispatch(kernel, *args, **options)

    msl.dispatch = dispatch
    msl.executions = lambda: dict(runs)
    msl.kernel_names = runner.kernel_names
    msl.KernelError = cuda.CudaError


if os.environ.get("LILY_KERNEL_DEVICE") == "cuda":
    _use_cuda_for_dispatch()


def pytest_collection_modifyitems(items) -> None:
    """The registry's execution check goes last: it counts the kernels every other test of the session ran. On CUDA,
    the Metal 4 tensor-op kernels (qmm_nax) are not built (their #if is false there): their cases skip."""
    last = [item for item in items if item.name == "test_every_kernel_was_executed"]
    items[:] = [item for item in items if item not in last] + last
    if os.environ.get("LILY_KERNEL_DEVICE") == "cuda":
        for item in items:
            if "qmm_nax" in item.name:
                item.add_marker(pytest.mark.skip(reason="qmm_nax (Metal 4 tensor ops) has no CUDA build"))


@dataclass(frozen=True)
class Tolerance:
    """Element-wise |actual - expected| <= atol + rtol * |expected|, plus a bound on the relative RMS error."""

    rtol: float
    atol: float
    rel_rms: float


# One rounding of a result to the dtype is 0.5 ulp; allow 1 ulp (2^-23, 2^-10, 2^-7) for fp32-vs-fp64 sums.
TOLERANCES: dict[str, Tolerance] = {
    "f32": Tolerance(rtol=2e-6, atol=1e-6, rel_rms=1e-6),
    "f16": Tolerance(rtol=1e-3, atol=1e-5, rel_rms=5e-4),
    "bf16": Tolerance(rtol=8e-3, atol=1e-4, rel_rms=4e-3),
}

STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


class KernelIO:
    """Converts between float64/float32 test values and a kernel's storage dtype."""

    tolerances = TOLERANCES

    def to_device(self, values: np.ndarray, dtype: str) -> np.ndarray:
        """A C-contiguous buffer of `values` rounded to `dtype` ("f32", "f16" or "bf16")."""
        values = np.asarray(values, dtype=np.float64)
        if dtype == "bf16":
            return np.ascontiguousarray(float32_to_bfloat16_bits(values.astype(np.float32)))
        return np.ascontiguousarray(values.astype(STORAGE[dtype]))

    def to_f64(self, buffer: np.ndarray, dtype: str) -> np.ndarray:
        """The values held by a device buffer, widened exactly."""
        if dtype == "bf16":
            return bfloat16_bits_to_float32(buffer).astype(np.float64)
        return np.asarray(buffer).astype(np.float64)

    def round(self, values: np.ndarray, dtype: str) -> np.ndarray:
        """`values` rounded once to `dtype`, as float64."""
        return self.to_f64(self.to_device(values, dtype), dtype)

    def poisoned(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An output buffer filled with NaN, so elements the kernel does not write are caught."""
        if dtype == "bf16":
            return np.full(shape, 0x7FC0, dtype=np.uint16)
        return np.full(shape, np.nan, dtype=STORAGE[dtype])

    def assert_close(self, actual: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> None:
        """NaN/Inf positions first, then the relative RMS error, then element-wise tolerance."""
        tol = TOLERANCES[dtype]
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        bad_nan = np.isnan(actual) != np.isnan(expected)
        assert not bad_nan.any(), f"{what}: NaN mismatch at {np.argwhere(bad_nan)[:5].tolist()}"
        inf = np.isinf(expected) | np.isinf(actual)
        assert np.array_equal(actual[inf], expected[inf]), f"{what}: Inf mismatch"
        finite = np.isfinite(expected)
        a, e = actual[finite], expected[finite]
        if e.size == 0:
            return
        scale = np.sqrt(np.mean(e * e))
        rel_rms = np.sqrt(np.mean((a - e) ** 2)) / scale if scale > 0 else np.sqrt(np.mean(a * a))
        assert rel_rms <= tol.rel_rms, f"{what}: relative RMS error {rel_rms:.3g} > {tol.rel_rms:g} ({dtype})"
        err = np.abs(a - e)
        limit = tol.atol + tol.rtol * np.abs(e)
        worst = int(np.argmax(err - limit))
        assert (err <= limit).all(), (
            f"{what}: max abs error {err.max():.3g}; element {worst}: got {a[worst]!r}, expected {e[worst]!r} ({dtype})"
        )


@pytest.fixture(scope="session")
def kio() -> KernelIO:
    """Conversion and comparison helpers for kernel tests."""
    return KernelIO()




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
