"""Lily's Metal kernels on NVIDIA GPUs: the PTX built from ``metal/`` (``tools/cuda_kernels.py``, docs/cuda.md), loaded
and launched through the CUDA driver API, which is opened at run time (``libcuda.so.1``): the same install runs with
or without an NVIDIA driver.

``Runner`` has the CPU harness's calling convention: ``dispatch(kernel, args, threadgroups, threads_per_threadgroup)``
with ``args[i]`` binding ``[[buffer(i)]]`` (a numpy array is a device buffer, written back in place; bytes are
setBytes data), a Metal grid of threadgroups, and the byte length of each ``[[threadgroup(i)]]`` parameter.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np

__all__ = ["CudaError", "Runner", "ptx_dir"]

MAX_BUFFERS = 31  # msl_cuda_detail::Params (src/msl_cpu/include/msl_cuda_launch.h)
MAX_THREADGROUP_SLICES = 8
_ENTRY_RE = re.compile(r"^\.(?:visible|weak)?\s*\.entry\s+(\w+)\s*\(", re.M)
_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_JIT_MAX_REGISTERS = 0
_REGISTERS_FOR_1024_THREADS = 64  # 65,536 registers per multiprocessor / 1024 threads
_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call, the kernel where there is one, and CUDA's error."""


class _Params(ctypes.Structure):
    _fields_ = [("buffers", ctypes.c_void_p * MAX_BUFFERS), ("threadgroup_offsets", ctypes.c_uint32 * MAX_THREADGROUP_SLICES)]


def ptx_dir() -> Path:
    """Where the PTX files are: $LILY_CUDA_PTX_DIR, else the package's ``cuda_kernels`` folder (built at install)."""
    env = os.environ.get("LILY_CUDA_PTX_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "cuda_kernels"


def _load_driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaError(f"no NVIDIA driver: libcuda.so.1 cannot be loaded ({exc})") from None


class Runner:
    """One CUDA context on GPU `ordinal` with every kernel of the PTX files in `ptx` (default ``ptx_dir()``)."""

    def __init__(self, ptx: Path | None = None, ordinal: int = 0) -> None:
        self._cu = _load_driver()
        folder = ptx_dir() if ptx is None else Path(ptx)
        files = sorted(folder.glob("*.ptx"))
        if not files:
            raise CudaError(f"no CUDA kernels: no .ptx files in {folder} (build them with tools/cuda_kernels.py)")
        self._check("cuInit", self._cu.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._cu.cuDeviceGet(ctypes.byref(dev), ordinal))
        self._ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev))
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._ctx))
        name = ctypes.create_string_buffer(256)
        self._check("cuDeviceGetName", self._cu.cuDeviceGetName(name, 256, dev))
        self.device_name = name.value.decode()
        cc = [ctypes.c_int(), ctypes.c_int()]
        for v, attr in zip(cc, (_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)):
            self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(ctypes.byref(v), attr, dev))
        self.compute_capability = (cc[0].value, cc[1].value)
        self._images = {f.name: f.read_bytes() + b"\0" for f in files}
        self._kernel_image: dict[str, str] = {}
        for name, image in self._images.items():
            for entry in _ENTRY_RE.findall(image.decode()):
                self._kernel_image[entry] = name
        self._params: dict[str, list[tuple[int, int, int, int]]] = {}
        self._modules: dict[tuple[str, bool], ctypes.c_void_p] = {}
        self._functions: dict[tuple[str, bool], ctypes.c_void_p] = {}
        for name in self._images:
            self._module(name, False)

    def _module(self, image: str, capped: bool) -> ctypes.c_void_p:
        """The loaded module of one PTX file; `capped`: JIT-compiled with at most 64 registers per thread, so every
        kernel in it launches with up to 1024 threads per threadgroup (Metal's limit) at some cost in spills."""
        key = (image, capped)
        if key not in self._modules:
            module = ctypes.c_void_p()
            if capped:
                options = (ctypes.c_int * 1)(_JIT_MAX_REGISTERS)
                values = (ctypes.c_void_p * 1)(ctypes.c_void_p(_REGISTERS_FOR_1024_THREADS))
                code = self._cu.cuModuleLoadDataEx(ctypes.byref(module), self._images[image], 1, options, values)
            else:
                code = self._cu.cuModuleLoadData(ctypes.byref(module), self._images[image])
            self._check(f"cuModuleLoadData({image}{', 64 registers' if capped else ''})", code)
            self._modules[key] = module
        return self._modules[key]

    def _function(self, kernel: str, threads: int) -> ctypes.c_void_p:
        """`kernel` as compiled for its best speed, or register-capped where that build cannot run `threads`."""
        image = self._kernel_image.get(kernel)
        if image is None:
            raise ValueError(f"cuda: no kernel named {kernel!r} in the PTX files ({', '.join(self._images)})")
        for capped in (False, True):
            key = (kernel, capped)
            if key not in self._functions:
                fn = ctypes.c_void_p()
                self._check("cuModuleGetFunction", self._cu.cuModuleGetFunction(
                    ctypes.byref(fn), self._module(image, capped), kernel.encode()), kernel)
                self._functions[key] = fn
            limit = ctypes.c_int()
            self._check("cuFuncGetAttribute", self._cu.cuFuncGetAttribute(
                ctypes.byref(limit), _FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self._functions[key]), kernel)
            if threads <= limit.value:
                return self._functions[key]
        raise ValueError(f"cuda: kernel {kernel}: {threads} threads per threadgroup exceed its limit {limit.value}")

    # ---- errors ----

    def _error_text(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._cu.cuGetErrorName(code, ctypes.byref(name))
        self._cu.cuGetErrorString(code, ctypes.byref(text))
        return f"{(name.value or b'CUDA error').decode()} ({code}): {(text.value or b'').decode()}"

    def _check(self, what: str, code: int, kernel: str | None = None) -> None:
        if code != 0:
            where = f"kernel {kernel}: " if kernel else ""
            raise CudaError(f"{where}{what} failed: {self._error_text(code)}")

    # ---- memory ----

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check("cuMemAlloc", self._cu.cuMemAlloc_v2(ctypes.byref(ptr), max(int(nbytes), 1)))
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check("cuMemFree", self._cu.cuMemFree_v2(ctypes.c_uint64(ptr)))

    def upload(self, ptr: int, data) -> None:
        buf = memoryview(data).cast("B")
        if buf.nbytes:
            src = (ctypes.c_char * buf.nbytes).from_buffer_copy(buf) if buf.readonly else \
                (ctypes.c_char * buf.nbytes).from_buffer(buf)
            self._check("cuMemcpyHtoD", self._cu.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), src, ctypes.c_size_t(buf.nbytes)))

    def download(self, ptr: int, array: np.ndarray) -> None:
        if array.nbytes:
            self._check("cuMemcpyDtoH", self._cu.cuMemcpyDtoH_v2(array.ctypes.data_as(ctypes.c_void_p),
                                                                   ctypes.c_uint64(ptr), ctypes.c_size_t(array.nbytes)))

    def synchronize(self, kernel: str | None = None) -> None:
        self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize(), kernel)

    # ---- timing (CUDA events) ----

    def time_ms(self, work, repeats: int = 50, flush: int | None = None, flush_bytes: int = 256 << 20) -> list[float]:
        """Milliseconds of each of `repeats` runs of `work()` (which enqueues launches), after one warm-up run; with
        `flush` (a device buffer of `flush_bytes`), the L2 cache is evicted by writing it before every run."""
        start, stop = ctypes.c_void_p(), ctypes.c_void_p()
        self._check("cuEventCreate", self._cu.cuEventCreate(ctypes.byref(start), 0))
        self._check("cuEventCreate", self._cu.cuEventCreate(ctypes.byref(stop), 0))
        work()
        times = []
        for _ in range(repeats):
            if flush is not None:
                self._check("cuMemsetD8", self._cu.cuMemsetD8_v2(ctypes.c_uint64(flush), 0, ctypes.c_size_t(flush_bytes)))
            self._check("cuEventRecord", self._cu.cuEventRecord(start, None))
            work()
            self._check("cuEventRecord", self._cu.cuEventRecord(stop, None))
            self._check("cuEventSynchronize", self._cu.cuEventSynchronize(stop))
            ms = ctypes.c_float()
            self._check("cuEventElapsedTime", self._cu.cuEventElapsedTime(ctypes.byref(ms), start, stop))
            times.append(ms.value)
        self._cu.cuEventDestroy_v2(start)
        self._cu.cuEventDestroy_v2(stop)
        return times

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Asynchronous device-to-device copy."""
        self._check("cuMemcpyDtoD", self._cu.cuMemcpyDtoD_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                                             ctypes.c_size_t(nbytes)))

    # ---- kernels ----

    def kernel_names(self) -> list[str]:
        """Every kernel host name in the loaded PTX, sorted."""
        return sorted(self._kernel_image)

    def launch(self, kernel: str, buffers: list[int], threadgroups, threads_per_threadgroup,
               threadgroup_memory: list[int] | None = None, stream: int = 0) -> None:
        """One asynchronous launch with device pointers `buffers[i]` bound to [[buffer(i)]]."""
        if len(buffers) > MAX_BUFFERS:
            raise ValueError(f"cuda: kernel {kernel}: {len(buffers)} buffers; at most {MAX_BUFFERS}")
        tg = [int(n) for n in (threadgroup_memory or [])]
        if len(tg) > MAX_THREADGROUP_SLICES:
            raise ValueError(f"cuda: kernel {kernel}: {len(tg)} threadgroup slices; at most {MAX_THREADGROUP_SLICES}")
        params = _Params()
        for i, p in enumerate(buffers):
            params.buffers[i] = p
        offset = 0
        for i, n in enumerate(tg):  # 16-byte aligned slices, as Metal's threadgroup memory lengths
            params.threadgroup_offsets[i] = offset
            offset += -(-n // 16) * 16
        if offset > 48 * 1024:
            self._check("cuFuncSetAttribute", self._cu.cuFuncSetAttribute(
                fn, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, offset), kernel)
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        g, t = [int(v) for v in threadgroups], [int(v) for v in threads_per_threadgroup]
        if min(g + t) < 1 or t[0] * t[1] * t[2] > 1024:
            raise ValueError(f"cuda: kernel {kernel}: bad launch shape threadgroups={g} threads={t}")
        fn = self._function(kernel, t[0] * t[1] * t[2])
        self._check("cuLaunchKernel", self._cu.cuLaunchKernel(
            fn, g[0], g[1], g[2], t[0], t[1], t[2], offset, ctypes.c_void_p(stream), args, None), kernel)

    def parameters(self, kernel: str) -> list[tuple[int, int, int, int]]:
        """Each kernel parameter as (attribute, index, binding, size): attribute 0 is [[buffer(index)]] and 1
        [[threadgroup(index)]] (msl_rt::Attr); binding 0 pointer, 1 reference, 2 value; size of what it points to.
        Read from the ``<kernel>_msl_params`` table the CUDA target exports beside each entry point."""
        if kernel not in self._params:
            self._function(kernel, 1)
            module = self._module(self._kernel_image[kernel], False)
            ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
            self._check("cuModuleGetGlobal", self._cu.cuModuleGetGlobal_v2(
                ctypes.byref(ptr), ctypes.byref(size), module, f"{kernel}_msl_params".encode()), kernel)
            table = np.zeros(size.value // 4, np.uint32)
            self.download(ptr.value, table)
            self._params[kernel] = [tuple(int(v) for v in table[1 + 4 * i: 5 + 4 * i]) for i in range(table[0])]
        return self._params[kernel]

    def check_arguments(self, kernel: str, args: list, threadgroup_memory: list[int] | None) -> None:
        """The CPU harness's argument rules, before any GPU work: every [[buffer(i)]] bound, setBytes data for a
        struct exactly the struct, a buffer bound to one at least as long, threadgroup lengths given."""
        for p, (attr, index, binding, size) in enumerate(self.parameters(kernel)):
            if attr == 0:
                slot = f"{kernel} parameter {p} [[buffer({index})]]"
                if index >= len(args):
                    raise ValueError(f"{slot} is not bound: only {len(args)} args were given")
                a = args[index]
                got = len(a) if isinstance(a, (bytes, bytearray, memoryview)) else getattr(a, "nbytes", 0)
                exact = isinstance(a, (bytes, bytearray, memoryview))
                if binding == 1 and (got != size if exact else got < size):
                    raise ValueError(f"{slot} expects {size} bytes (one struct from metal/lily.h); got {got}")
            elif attr == 1 and (threadgroup_memory is None or index >= len(threadgroup_memory)
                                or not threadgroup_memory[index]):
                raise ValueError(f"{kernel} parameter {p} [[threadgroup({index})]] needs a threadgroup memory length")

    def dispatch(self, kernel: str, args: list, threadgroups, threads_per_threadgroup, *,
                 threadgroup_memory: list[int] | None = None, constants: dict | None = None, **_harness_only) -> None:
        """Run `kernel` once and wait: numpy arrays in `args` are copied to the GPU and back (in place), bytes are
        setBytes data. Harness-only options (random_schedule, seed, guard, ...) are accepted and have no effect."""
        if constants:
            raise ValueError(f"cuda: kernel {kernel}: function constants are not supported by the CUDA target")
        self.check_arguments(kernel, args, threadgroup_memory)
        pointers, arrays, owned = [], {}, []
        try:
            for i, a in enumerate(args):
                if isinstance(a, np.ndarray):
                    if not a.flags.c_contiguous:
                        raise ValueError(f"cuda: kernel {kernel}: argument {i} is not C-contiguous")
                    if id(a) in arrays:  # one array bound twice is one buffer (kernels that allow aliasing)
                        pointers.append(arrays[id(a)][0])
                        continue
                    ptr = self.alloc(a.nbytes)
                    owned.append(ptr)
                    pointers.append(ptr)
                    self.upload(ptr, a)
                    arrays[id(a)] = (ptr, a)
                elif isinstance(a, (bytes, bytearray, memoryview)):
                    ptr = self.alloc(len(a))
                    owned.append(ptr)
                    pointers.append(ptr)
                    self.upload(ptr, a)
                else:
                    raise ValueError(f"cuda: kernel {kernel}: argument {i}: expected a numpy array (a device buffer) "
                                     f"or bytes (setBytes data); got {type(a).__name__}")
            self.launch(kernel, pointers, threadgroups, threads_per_threadgroup, threadgroup_memory)
            self.synchronize(kernel)
            for ptr, a in arrays.values():
                if a.flags.writeable:
                    self.download(ptr, a)
        finally:
            for p in owned:
                self.free(p)
