"""``python -m lily.selftest --device cuda --compile-only``: every kernel of metal/ through clang (CUDA) and ptxas, one
row per kernel, with no GPU."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

from lily.selftest.runner import Result, table


def _cuda_kernels_tool() -> Path | None:
    """tools/cuda_kernels.py beside the kernel sources it compiles: $LILY_SOURCE_DIR, the checkout of an editable
    install, else the copy the package carries (``lily/kernel_source``); None after saying where it looked."""
    package = Path(__file__).resolve().parents[1]
    roots = [package.parents[1], package / "kernel_source"]
    if os.environ.get("LILY_SOURCE_DIR"):
        roots.insert(0, Path(os.environ["LILY_SOURCE_DIR"]))
    tools = [root / "tools" / "cuda_kernels.py" for root in roots]
    tool = next((t for t in tools if t.is_file()), None)
    if tool is None:
        print("lily.selftest: --compile-only needs the kernel sources (tools/cuda_kernels.py is not at "
              f"{', '.join(map(str, tools))}); reinstall Lily, or set LILY_SOURCE_DIR to a checkout. Nothing was "
              "compiled.", file=sys.stderr)
    return tool


def compile_cuda(ptx_out: str | None = None, kernels: str | None = None) -> int:
    """Compile every kernel for CUDA (with ``kernels``, a regular expression: the files that instantiate a match) and
    check it with ptxas; print the table; return the exit code. The PTX is kept in ``ptx_out`` when given (a folder
    for LILY_CUDA_PTX_DIR)."""
    tool = _cuda_kernels_tool()
    if tool is None:
        return 2
    spec = importlib.util.spec_from_file_location("lily_cuda_kernels", tool)
    builder = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = builder  # its dataclasses look their module up
    spec.loader.exec_module(builder)
    sources = builder.metal_sources()
    pattern = re.compile(kernels or "")  # "" matches every kernel
    if kernels:
        sources = [s for s in sources if any(pattern.search(n) for n in builder.msl2cpu.host_names(s.read_text()))]
        if not sources:
            print(f"lily.selftest: --kernels {kernels!r} matches no kernel of {tool.parents[1] / 'metal'}",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as scratch:
        try:
            built = builder.build(Path(ptx_out or scratch), sources=sources)
        except (builder.ToolchainError, RuntimeError) as exc:
            print(f"lily.selftest: {exc}", file=sys.stderr)
            return 1
    archs = " ".join(builder.CHECK_ARCHS)
    rows = [Result(k, f"{ptx} ptxas {archs}", 0.0, "compiles", True) for ptx, names in sorted(built.items())
            for k in names if pattern.search(k)]
    print(table(rows))
    print(f"\n{len(rows)} kernels compiled for CUDA ({builder.DEFAULT_ARCH} PTX) and assembled by ptxas for {archs} "
          f"from {tool.parents[1]}. No GPU was used.")
    return 0
