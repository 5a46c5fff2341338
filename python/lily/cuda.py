"""Lily's Metal kernels on NVIDIA GPUs: the PTX built from ``metal/`` (``tools/cuda_kernels.py``, docs/cuda.md), loaded
and launched by the extension's CUDA driver layer (``lily._ext.cuda``, src/lily_ext/cuda/driver.h), which opens the
driver at run time (``libcuda.so.1``, or ``$LILY_LIBCUDA``): the same install runs with or without an NVIDIA driver.

``Runner`` has the CPU harness's calling convention: ``dispatch(kernel, args, threadgroups, threads_per_threadgroup)``
with ``args[i]`` binding ``[[buffer(i)]]`` (a numpy array is a device buffer, written back in place; bytes are
setBytes data), a Metal grid of threadgroups, and the byte length of each ``[[threadgroup(i)]]`` parameter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["CudaError", "Runner", "ptx_dir"]

try:
    from lily._ext import cuda as _driver
except ImportError:  # the extension is not built: Runner() says so
    _driver = None

if _driver is not None:
    CudaError = _driver.CudaError
else:
    class CudaError(RuntimeError):
        """A CUDA driver call failed; the message names the call, the kernel where there is one, and CUDA's error."""


def ptx_dir() -> Path:
    """Where the PTX files are: $LILY_CUDA_PTX_DIR, else the package's ``cuda_kernels`` folder (built at install);
    the extension's rule, which is what loads them."""
    if _driver is None:  # nothing can load PTX without the extension: the folder an install would have
        return Path(__file__).resolve().parent / "cuda_kernels"
    return Path(_driver.default_ptx_dir())


class Runner:
    """One CUDA context on GPU `ordinal` with every kernel of the PTX files in `ptx` (default ``ptx_dir()``)."""

    def __init__(self, ptx: Path | None = None, ordinal: int = 0) -> None:
        if _driver is None:
            raise CudaError("lily.cuda needs Lily's extension (lily._ext), which is not built in this install")
        self._device = _driver.Device(None if ptx is None else str(ptx), ordinal)
        self.device_name: str = self._device.device_name
        self.compute_capability: tuple[int, int] = tuple(self._device.compute_capability)

    # ---- memory ----

    def alloc(self, nbytes: int) -> int:
        return self._device.alloc(max(int(nbytes), 1))

    def free(self, ptr: int) -> None:
        self._device.free(ptr)

    def upload(self, ptr: int, data) -> None:
        self._device.upload(ptr, memoryview(data).cast("B"))

    def download(self, ptr: int, array: np.ndarray) -> None:
        self._device.download(ptr, array)

    def synchronize(self, kernel: str | None = None) -> None:
        try:
            self._device.synchronize()
        except CudaError as exc:
            if kernel is None:
                raise
            raise CudaError(f"kernel {kernel}: {exc}") from None

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Asynchronous device-to-device copy."""
        self._device.copy(dst, src, nbytes)

    # ---- timing (CUDA events) ----

    def time_ms(self, work, repeats: int = 50, flush: int | None = None, flush_bytes: int = 256 << 20) -> list[float]:
        """Milliseconds of each of `repeats` runs of `work()` (which enqueues launches), after one warm-up run; with
        `flush` (a device buffer of `flush_bytes`), the L2 cache is evicted by writing it before every run."""
        start, stop = _driver.Event(timing=True), _driver.Event(timing=True)
        work()
        times = []
        for _ in range(repeats):
            if flush is not None:
                self._device.fill(flush, 0, flush_bytes)
            start.record()
            work()
            stop.record()
            stop.synchronize()
            times.append(stop.elapsed_ms_since(start))
        return times

    # ---- kernels ----

    def kernel_names(self) -> list[str]:
        """Every kernel host name in the loaded PTX, sorted."""
        return self._device.kernel_names()

    def launch(self, kernel: str, buffers: list[int], threadgroups, threads_per_threadgroup,
               threadgroup_memory: list[int] | None = None, stream: int = 0) -> None:
        """One asynchronous launch with device pointers `buffers[i]` bound to [[buffer(i)]]."""
        self._device.launch(kernel, [int(p) for p in buffers], _shape(threadgroups), _shape(threads_per_threadgroup),
                            None if threadgroup_memory is None else [int(n) for n in threadgroup_memory], stream)

    def graph(self):
        """An empty explicit CUDA graph of this GPU's kernels (``lily._ext.cuda.Graph``): nodes with declared
        dependencies, instantiated once and launched as a unit."""
        return _driver.Graph(self._device)

    def parameters(self, kernel: str) -> list[tuple[int, int, int, int]]:
        """Each kernel parameter as (attribute, index, binding, size): attribute 0 is [[buffer(index)]] and 1
        [[threadgroup(index)]] (msl_rt::Attr); binding 0 pointer, 1 reference, 2 value; size of what it points to.
        Read from the ``<kernel>_msl_params`` table the CUDA target exports beside each entry point."""
        return self._device.parameters(kernel)

    def dispatch(self, kernel: str, args: list, threadgroups, threads_per_threadgroup, *,
                 threadgroup_memory: list[int] | None = None, constants: dict | None = None, **_harness_only) -> None:
        """Run `kernel` once and wait, after the CPU harness's argument checks: numpy arrays in `args` are copied to
        the GPU and back (in place), bytes are setBytes data. Harness-only options (random_schedule,
        greedy_simdgroups, seed, guard, ...) are accepted and have no effect."""
        if constants:
            raise ValueError(f"cuda: kernel {kernel}: function constants are not supported by the CUDA target")
        self._device.dispatch(kernel, list(args), _shape(threadgroups), _shape(threads_per_threadgroup),
                              None if threadgroup_memory is None else [int(n) for n in threadgroup_memory])


def _shape(v) -> tuple[int, int, int]:
    """A Metal size: three ints (zeros and sizes over 1024 threads are refused by the driver layer, naming the kernel)."""
    x, y, z = (int(n) for n in v)
    if min(x, y, z) < 0:
        raise ValueError(f"cuda: bad launch shape {[x, y, z]}: sizes are >= 1")
    return x, y, z
