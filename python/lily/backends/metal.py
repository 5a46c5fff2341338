"""The ``metal`` backend: the compiled engine (``lily.backends.engine.EngineBackend``) on Metal: the GPU of a Mac, or
on Linux the test runtime (the kernels on the CPU harness, the fake Metal)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lily.backends import engine_config
from lily.backends.engine import DEFAULT_MAX_CONTEXT, EngineBackend, engine_switches, switches_from_env
from lily.config import ModelArgs


# The install that links the Metal test runtime on Linux (CMakeLists.txt: a test build, with clang-19 on x86-64).
TEST_BUILD_INSTALL = "CXX=clang++-19 pip install . -Ccmake.define.LILY_TEST_BUILD=ON"


def missing_metal_runtime() -> str:
    """Why this build runs no Metal (lily._ext.platform == "none": a Linux build other than a clang-19 test build on
    x86-64), in the build's own words and with the way to get it; "" where it runs Metal."""
    from lily import _build, _ext

    if _ext.platform != "none":
        return ""
    return f"lily was {_build.NO_METAL_RUNTIME}; reinstall with {TEST_BUILD_INSTALL} (CXX picks the compiler)"


def require_metal_runtime() -> None:
    """Raise RuntimeError, before any work, when this build cannot run the ``metal`` backend."""
    missing = missing_metal_runtime()
    if missing:
        raise RuntimeError(f"backend='metal' is unavailable: {missing}, or use backend='cpu'")


def kernel_metallib() -> str | None:
    """The path of ``lily.metallib`` when this build compiled the kernels ahead of time, else None.

    The build has one kernel-library mode: by default the kernel source embedded in
    ``_ext`` is compiled at first use; with ``-DLILY_AOT_METALLIB=ON`` the library is installed next to ``_ext`` and
    found only there. Raises FileNotFoundError naming the path when an AOT build's library is missing.
    """
    import importlib.resources

    from lily import _ext

    if not _ext.kernels.aot_metallib:
        return None
    path = importlib.resources.files("lily") / "lily.metallib"
    if not path.is_file():
        raise FileNotFoundError(
            f"lily was built with LILY_AOT_METALLIB=ON but its kernel library {path} is missing; reinstall lily"
        )
    return str(path)


class MetalBackend(EngineBackend):
    """The ``metal`` backend: ``EngineBackend`` over the Metal runtime (arguments as ``EngineBackend``'s)."""

    def _require_runtime(self) -> None:
        require_metal_runtime()

    def _runtime_arguments(self) -> dict[str, Any]:
        """The kernel library: the one built ahead of time, else the source embedded in ``_ext``."""
        return {"metallib": kernel_metallib()}

    @classmethod
    def synthetic(cls, args: ModelArgs, *, precision: str = "bfloat16", max_context: int = DEFAULT_MAX_CONTEXT,
                  switches: Mapping[str, Any] | None = None) -> "MetalBackend":
        """A backend over synthetic weights laid out as ``lily plan`` does, in reserved memory never touched: for
        host-cost runs only, where kernel execution is stubbed out (``lily bench --full-size --host-only``). The
        switches are the environment's (``LILY_DISABLE_<NAME>``) updated by ``switches``, as for a loaded model."""
        from lily import _ext

        backend = cls.__new__(cls)
        backend.args = args
        backend.weights = {}
        backend.precision = precision
        chosen = engine_switches({**switches_from_env(os.environ), **dict(switches or {})})
        backend._engine = _ext.Engine(engine_config(args), precision, chosen, max_context)
        backend._engine.bind_synthetic_weights()
        backend._engine.finish_loading()
        backend._files = {}
        backend._live = None
        backend._decoded = None
        backend._decoding = False
        backend._gpu_token = chosen.gpu_token
        return backend
