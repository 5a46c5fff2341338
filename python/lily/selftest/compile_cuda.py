"""``python -m lily.selftest --device cuda --compile-only``: every kernel of metal/ through clang (CUDA) and ptxas, one
row per kernel, with no GPU."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from lily.selftest.runner import Result, table


def _cuda_kernels_tool() -> Path | None:
    """tools/cuda_kernels.py of Lily's source tree: $LILY_SOURCE_DIR, an editable install's, or the current directory
    (a checkout where `pip install .` was run); None after saying where it looked."""
    roots = [Path(__file__).resolve().parents[3], Path.cwd()]
    if os.environ.get("LILY_SOURCE_DIR"):
        roots.insert(0, Path(os.environ["LILY_SOURCE_DIR"]))
    tools = [root / "tools" / "cuda_kernels.py" for root in roots]
    tool = next((t for t in tools if t.is_file()), None)
    if tool is None:
        print("lily.selftest: --compile-only needs Lily's source tree (tools/cuda_kernels.py is not at "
              f"{', '.join(map(str, tools))}); run it in a checkout or set LILY_SOURCE_DIR. Nothing was compiled.",
              file=sys.stderr)
    return tool


def compile_cuda(ptx_out: str | None = None) -> int:
    """Compile every kernel for CUDA and check it with ptxas; print the table; return the exit code. The PTX is kept
    in ``ptx_out`` when given (a folder for LILY_CUDA_PTX_DIR)."""
    tool = _cuda_kernels_tool()
    if tool is None:
        return 2
    spec = importlib.util.spec_from_file_location("lily_cuda_kernels", tool)
    builder = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = builder  # its dataclasses look their module up
    spec.loader.exec_module(builder)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            built = builder.build(Path(ptx_out or scratch))
        except (builder.ToolchainError, RuntimeError) as exc:
            print(f"lily.selftest: {exc}", file=sys.stderr)
            return 1
    archs = " ".join(builder.CHECK_ARCHS)
    rows = [Result(k, f"{ptx} ptxas {archs}", 0.0, "compiles", True) for ptx, names in sorted(built.items())
            for k in names]
    print(table(rows))
    print(f"\n{len(rows)} kernels compiled for CUDA ({builder.DEFAULT_ARCH} PTX) and assembled by ptxas for {archs}. "
          "No GPU was used.")
    return 0
