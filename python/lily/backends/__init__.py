"""The backends that run the forward pass under ``lily.Model`` (docs/architecture.md, "Backends").

``reference``: ``lily.reference.ReferenceModel``, the specification itself (numpy, float32, always available).
``metal``: ``lily.backends.metal.MetalBackend``, the compiled engine (``lily._ext``).
``cuda``: ``lily.backends.cuda.CudaBackend``, the same engine on its CUDA runtime (NVIDIA GPUs).
``cpu``: ``lily.backends.cpu.CpuBackend``, the extension's C++ forward pass on the packed weights (any machine).
"""

from __future__ import annotations

from typing import Any

NAMES = ("reference", "metal", "cuda", "cpu")


def choose(name: str) -> str:
    """The backend ``name`` stands for: "auto" is metal where the extension drives real Metal, cuda where an NVIDIA
    driver, a GPU and the CUDA kernels are present, else cpu (reference when the extension is missing)."""
    if name == "auto":
        try:
            from lily import _ext
        except ImportError:
            return "reference"
        if getattr(_ext, "platform", "") == "metal" and hasattr(_ext, "Engine"):
            return "metal"
        from lily.backends.cuda import cuda_unavailable

        if hasattr(_ext, "Engine") and cuda_unavailable(system_driver=True) is None:
            return "cuda"
        return "cpu" if hasattr(_ext, "cpu") else "reference"
    if name not in NAMES:
        raise ValueError(f"backend must be 'auto', 'reference', 'metal', 'cuda' or 'cpu'; got {name!r}")
    if name == "metal":
        from lily.backends.metal import require_metal_runtime

        require_metal_runtime()
    if name == "cuda":
        from lily.backends.cuda import require_cuda

        require_cuda()
    return name


def create(name: str, checkpoint: Any, precision: str | None = None, max_context: int | None = None,
           progress: bool = False) -> Any:
    """A backend of the chosen ``name`` ("reference", "metal", "cuda" or "cpu") over ``checkpoint``; ``precision``,
    ``max_context`` (the KV cache's limit) and ``progress`` (a load progress bar) apply to the engine backends, metal
    and cuda, and None keeps their defaults."""
    options = {key: value for key, value in (("precision", precision), ("max_context", max_context))
               if value is not None}
    options["progress"] = progress
    if name == "metal":
        from lily.backends.metal import MetalBackend

        return MetalBackend(checkpoint, **options)
    if name == "cuda":
        from lily.backends.cuda import CudaBackend

        return CudaBackend(checkpoint, **options)
    if name == "cpu":
        from lily.backends.cpu import CpuBackend

        return CpuBackend(checkpoint)
    from lily.reference import ReferenceModel

    return ReferenceModel(checkpoint)
