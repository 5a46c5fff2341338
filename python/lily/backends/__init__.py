"""The backends that run the forward pass under ``lily.Model`` (docs/architecture.md, "Backends").

``reference``: ``lily.reference.ReferenceModel``, the specification itself (numpy, float32, always available).
``metal``: ``lily.backends.metal.MetalBackend``, the compiled engine (``lily._ext``).
"""

from __future__ import annotations

from typing import Any

NAMES = ("reference", "metal")


def choose(name: str) -> str:
    """The backend ``name`` stands for: "auto" is metal where the extension drives real Metal, else reference."""
    if name == "auto":
        try:
            from lily import _ext
        except ImportError:
            return "reference"
        return "metal" if getattr(_ext, "platform", "") == "metal" and hasattr(_ext, "Engine") else "reference"
    if name not in NAMES:
        raise ValueError(f"backend must be 'auto', 'reference' or 'metal'; got {name!r}")
    return name


def create(name: str, checkpoint: Any, precision: str | None = None) -> Any:
    """A backend of the chosen ``name`` ("reference" or "metal") over ``checkpoint``."""
    if name == "metal":
        from lily.backends.metal import MetalBackend

        return MetalBackend(checkpoint, **({} if precision is None else {"precision": precision}))
    from lily.reference import ReferenceModel

    return ReferenceModel(checkpoint)
