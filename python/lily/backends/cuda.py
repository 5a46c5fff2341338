"""The ``cuda`` backend: the same compiled engine as ``metal`` (``lily._ext.Engine``), run by its CUDA runtime.

The graphs, the switches, the precision modes, the states, snapshots and GPU token choice are the engine's
(``lily.backends.engine``), as for the ``metal`` backend; only the runtime under the engine differs (docs/engine.md, "Runtimes"): weights streamed into device memory once, the
Metal kernels as PTX (``$LILY_CUDA_PTX_DIR``, else the package's ``cuda_kernels``; docs/cuda.md), the decode step an
explicit CUDA graph replayed per token.
"""

from __future__ import annotations

import ctypes
from typing import Any

from lily.backends.engine import EngineBackend
from lily.cuda import ptx_dir


def cuda_unavailable(*, system_driver: bool = False) -> str | None:
    """Why this machine cannot run the ``cuda`` backend (no driver, no GPU, no PTX), or None when it can.

    The driver is the one the engine opens, once per process: ``$LILY_LIBCUDA`` (tests point it at the fake
    libcuda), else ``libcuda.so.1``. ``system_driver``: look for ``libcuda.so.1`` only, without opening the engine's
    driver (what ``backend="auto"`` asks: does this machine have its own NVIDIA driver and GPU)."""
    if system_driver:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            return f"no NVIDIA driver: libcuda.so.1 cannot be loaded ({exc})"
        count = ctypes.c_int(0)
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return "no NVIDIA GPU: libcuda.so.1 loads but reports no device"
    else:
        from lily import _ext

        try:
            _ext.cuda.driver_version()  # opens the driver and initialises it (cuInit fails without a GPU)
        except RuntimeError as exc:
            return str(exc)
    folder = ptx_dir()
    if not any(folder.glob("*.ptx")):
        return (f"no CUDA kernels: no .ptx files in {folder} (build them with `python -m lily.selftest --device cuda "
                "--compile-only --ptx-out DIR`, then set LILY_CUDA_PTX_DIR=DIR; docs/cuda.md)")
    return None


def require_cuda() -> None:
    """Raise RuntimeError, before any work, when this machine cannot run the ``cuda`` backend."""
    reason = cuda_unavailable()
    if reason:
        raise RuntimeError(f"backend='cuda' is unavailable: {reason}")


class CudaBackend(EngineBackend):
    """The ``cuda`` backend: ``EngineBackend`` over the engine's CUDA runtime (arguments as ``EngineBackend``'s)."""

    def _require_runtime(self) -> None:
        require_cuda()

    def _runtime_arguments(self) -> dict[str, Any]:
        """The CUDA runtime and the folder of its PTX."""
        return {"runtime": "cuda", "ptx_dir": str(ptx_dir())}
