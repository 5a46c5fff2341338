"""Where the engine's CUDA runtime finds a driver and kernels in tests: $LILY_LIBCUDA, else the machine's
libcuda.so.1, else the fake libcuda this build made (the Linux test runtime: every driver call on the CPU harness,
graph nodes in a seeded random order that respects only the declared edges); the PTX of $LILY_CUDA_PTX_DIR, else the
package's (docs/cuda.md), else the session's CUDA build of the kernels (the `cuda_compile_only` fixture)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest


def fake_libcuda() -> Path | None:
    """The fake libcuda installed beside lily._ext, when this build has one."""
    from lily import _ext

    path = Path(_ext.__file__).resolve().parent / "liblily_fake_cuda.so"
    return path if path.is_file() else None


def real_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_absent() -> str | None:
    """Why no CUDA runtime can run here (no driver, no fake), or None."""
    if os.environ.get("LILY_LIBCUDA") or real_driver() or fake_libcuda():
        return None
    return "no NVIDIA driver (libcuda.so.1) and no fake libcuda in this build (Linux builds with clang-19 have one)"


def prepare_cuda(request: pytest.FixtureRequest) -> None:
    """Opens the engine's CUDA driver (once per process: the machine's, else the fake) with $LILY_LIBCUDA set only
    while it opens, so later tests' subprocesses get the environment they had; points the engine at PTX."""
    from lily import _ext
    from lily.cuda import ptx_dir

    if not real_driver() and not os.environ.get("LILY_LIBCUDA"):
        os.environ["LILY_LIBCUDA"] = str(fake_libcuda())
        try:
            _ext.cuda.driver_version()
        finally:
            del os.environ["LILY_LIBCUDA"]
    if not any(ptx_dir().glob("*.ptx")):
        code, _, folder = request.getfixturevalue("cuda_compile_only")
        assert code == 0, "the CUDA build of the kernels failed (see test_cuda_build.py)"
        os.environ["LILY_CUDA_PTX_DIR"] = str(folder)
