"""The backends that run the forward pass under ``lily.Model`` (docs/architecture.md, "Backends").

``reference``: ``lily.reference.ReferenceModel``, the specification itself (numpy, float32, always available).
``metal``: ``lily.backends.metal.MetalBackend``, the compiled engine (``lily._ext``).
``cpu``: ``lily.backends.cpu.CpuBackend``, the extension's C++ forward pass on the packed weights (any machine).
"""

from __future__ import annotations

from typing import Any

NAMES = ("reference", "metal", "cpu")


def choose(name: str) -> str:
    """The backend ``name`` stands for: "auto" is metal where the extension drives real Metal, else cpu (reference
    when the extension is missing)."""
    if name == "auto":
        try:
            from lily import _ext
        except ImportError:
            return "reference"
        if getattr(_ext, "platform", "") == "metal" and hasattr(_ext, "Engine"):
            return "metal"
        return "cpu" if hasattr(_ext, "cpu") else "reference"
    if name not in NAMES:
        raise ValueError(f"backend must be 'auto', 'reference', 'metal' or 'cpu'; got {name!r}")
    if name == "metal":
        from lily.backends.metal import require_metal_runtime

        require_metal_runtime()
    return name


def create(name: str, checkpoint: Any, precision: str | None = None) -> Any:
    """A backend of the chosen ``name`` ("reference", "metal" or "cpu") over ``checkpoint``."""
    if name == "metal":
        from lily.backends.metal import MetalBackend

        return MetalBackend(checkpoint, **({} if precision is None else {"precision": precision}))
    if name == "cpu":
        from lily.backends.cpu import CpuBackend

        return CpuBackend(checkpoint)
    from lily.reference import ReferenceModel

    return ReferenceModel(checkpoint)
