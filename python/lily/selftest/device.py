"""The one device abstraction the kernel cases run on: the CPU execution harness, the Metal API or CUDA.

``open_device(kind)`` returns a ``KernelDevice`` whose ``dispatch(kernel, args, threadgroups, threads_per_threadgroup,
**options)`` has the harness's calling convention (``args[i]`` binds ``[[buffer(i)]]``; numpy arrays are device
buffers written back in place, bytes are setBytes data). Options only the harness understands (``random_schedule``,
``seed``, ``guard``, ...) are ignored elsewhere. ``python -m lily.selftest --device`` and the kernel tests
(``LILY_KERNEL_DEVICE``) both open their device here.
"""

from __future__ import annotations

import collections
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DEVICE_KINDS", "KernelDevice", "open_device"]

DEVICE_KINDS = ("auto", "metal-api", "harness", "cuda", "cpu")
# Options of lily._ext.msl.dispatch that choose how the CPU harness schedules and guards a dispatch: no GPU has them.
HARNESS_ONLY_OPTIONS = {"random_schedule", "greedy_simdgroups", "seed", "guard", "poison_threadgroup_memory", "workers"}


@dataclass
class KernelDevice:
    """Where the cases' dispatches go: what it is, its dispatch function and the kernels it has."""

    kind: str  # "metal-api", "harness", "cuda" or "cpu" (the CPU runtime's kernel table, float32 kernels only)
    name: str  # the GPU's name, or "CPU execution harness"
    run: Callable[..., None]  # the executor's own dispatch
    kernels: list[str]  # the instantiated kernels it runs, sorted
    missing: list[str] = field(default_factory=list)  # instantiated in the source, not compiled for this GPU
    # Kernel families (metal/<family>.metal) whose library did not compile: {family, file, diagnostic, kernels}.
    failed_families: list[dict] = field(default_factory=list)
    runs: collections.Counter = field(default_factory=collections.Counter)  # dispatches per kernel

    def dispatch(self, kernel: str, args: list, threadgroups: tuple[int, int, int],
                 threads_per_threadgroup: tuple[int, int, int], **options) -> None:
        """Run `kernel` once and wait."""
        self.runs[kernel] += 1
        self.run(kernel, args, threadgroups, threads_per_threadgroup, **options)

    @property
    def gpu_tested(self) -> bool:
        """Whether the kernels run on a real GPU (the Metal API on a Mac or CUDA; the fake Metal elsewhere)."""
        return self.kind == "cuda" or (self.kind == "metal-api" and platform.system() == "Darwin")

    def note(self) -> str:
        """One sentence for the summary: what ran the kernels."""
        if self.kind == "cuda":
            return f"Kernels ran on the NVIDIA GPU '{self.name}' through the CUDA driver API."
        if self.kind == "harness":
            return "Kernels ran on the CPU execution harness; no GPU is tested."
        if self.kind == "cpu":
            return "Kernels ran as the CPU runtime's C++ functions (backend='cpu'); no GPU is tested."
        if self.gpu_tested:
            return f"Kernels ran on the GPU '{self.name}' through the Metal API."
        return f"Kernels ran through the Metal API on '{self.name}'; no GPU is tested."


def _msl():
    """The CPU execution harness (``lily._ext.msl``); ImportError where it is not built (macOS)."""
    from lily._ext import msl

    return msl


def _metal_runner():
    """A ``lily._ext.kernels.Runner`` over the embedded kernels: the Metal API on the default device."""
    from lily._ext import kernels
    from lily.backends.metal import kernel_metallib

    return kernels.Runner(metallib=kernel_metallib())


def _cuda_runner():
    """A ``lily.cuda.Runner`` over the PTX built from metal/ (raises lily.cuda.CudaError without a driver or PTX)."""
    from lily import cuda

    return cuda.Runner()


def _metal_dispatch(runner) -> Callable[..., None]:
    """The Metal runner's ``run`` with the harness's options: scheduling options dropped, function constants kept."""

    def dispatch(kernel: str, args: list, threadgroups, threads_per_threadgroup, *, constants=None,
                 threadgroup_memory=None, **options) -> None:
        unknown = set(options) - HARNESS_ONLY_OPTIONS
        if unknown or threadgroup_memory:
            raise ValueError(f"metal-api: kernel {kernel}: options not supported by the Metal runner: "
                             f"{sorted(unknown | ({'threadgroup_memory'} if threadgroup_memory else set()))}")
        runner.run(kernel, args, threadgroups, threads_per_threadgroup, constants=constants)

    return dispatch


def open_device(kind: str = "auto") -> KernelDevice:
    """The device of `kind`: auto (metal-api on a Mac, harness elsewhere), metal-api, harness, cuda or cpu.

    Raises ImportError when the harness or the Metal runner is not built, RuntimeError when Metal has no device or
    refuses the kernel source (lily.cuda.CudaError, a RuntimeError, without a driver or PTX), and ValueError for an
    unknown kind.
    """
    if kind == "auto":
        kind = "metal-api" if platform.system() == "Darwin" else "harness"
    if kind == "harness":
        msl = _msl()
        return KernelDevice("harness", "CPU execution harness", msl.dispatch, list(msl.kernel_names()))
    if kind == "metal-api":
        runner = _metal_runner()
        return KernelDevice("metal-api", runner.device_name, _metal_dispatch(runner), list(runner.kernel_names()),
                            list(runner.missing_kernel_names()), list(runner.library_failures()))
    if kind == "cpu":
        from lily._ext import cpu

        return KernelDevice("cpu", "CPU runtime", cpu.dispatch, list(cpu.kernel_names()))
    if kind == "cuda":
        runner = _cuda_runner()
        return KernelDevice("cuda", runner.device_name, runner.dispatch, runner.kernel_names())
    raise ValueError(f"selftest: device must be one of {', '.join(repr(k) for k in DEVICE_KINDS)}; got {kind!r}")
