"""Where the engine's CUDA runtime finds a driver and kernels in tests: $LILY_LIBCUDA, else the fake libcuda this
build made (the Linux test runtime: every driver call on the CPU harness, graph nodes in a seeded random order that
respects only the declared edges), else the machine's libcuda.so.1; the PTX of $LILY_CUDA_PTX_DIR, else .dev/ptx
built once by tools/cuda_kernels.py (docs/cuda.md)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_NAME = "liblily_fake_cuda.so"


def fake_libcuda() -> Path | None:
    """The fake libcuda installed beside lily._ext, when this build has one."""
    from lily import _ext

    path = Path(_ext.__file__).resolve().parent / FAKE_NAME
    return path if path.is_file() else None


def _real_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_absent() -> str | None:
    """Why no CUDA runtime can run here (no driver, no fake), or None."""
    if os.environ.get("LILY_LIBCUDA") or fake_libcuda() or _real_driver():
        return None
    return "no NVIDIA driver (libcuda.so.1) and no fake libcuda in this build (Linux builds with clang-19 have one)"


def prepare_cuda() -> None:
    """Points the engine at a driver and at PTX, building the PTX once (about a minute) when none is given."""
    if not os.environ.get("LILY_LIBCUDA") and not _real_driver():
        os.environ["LILY_LIBCUDA"] = str(fake_libcuda())
    if os.environ.get("LILY_CUDA_PTX_DIR"):
        return
    ptx = ROOT / ".dev" / "ptx"
    if not any(ptx.glob("*.ptx")):
        subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_kernels.py"), str(ptx)], check=True)
    os.environ["LILY_CUDA_PTX_DIR"] = str(ptx)
