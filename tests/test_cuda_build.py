"""The CUDA target (docs/cuda.md) without a GPU: every kernel instantiation of metal/*.metal compiles to PTX for the
NVIDIA targets and ptxas accepts it (a kernel edit that breaks the NVIDIA build fails here), the compiled source is
the file in metal/, and a missing driver is a clear error. The kernels run on the GPU in tests/kernels with
LILY_KERNEL_DEVICE=cuda (docs/verification.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import cuda_kernels  # noqa: E402
import msl2cpu  # noqa: E402
import msl_text  # noqa: E402

from lily import cuda, selftest  # noqa: E402

# The Metal 4 tensor-op kernels are emulated by the CPU harness only (their #if is false for CUDA).
NOT_BUILT_FOR_CUDA = re.compile(r"qmm_nax_.*")


def source_names() -> set[str]:
    return {name for path in cuda_kernels.metal_sources() for name in msl_text.host_names(path.read_text())}


def test_selftest_compile_only_builds_every_kernel_for_cuda(cuda_compile_only) -> None:
    """`python -m lily.selftest --device cuda --compile-only`: clang + libdevice to PTX, then ptxas for sm_80 and
    sm_90; one row per kernel."""
    code, out, ptx = cuda_compile_only
    assert code == 0
    rows = {line.split()[0] for line in out.splitlines()[1:] if line.strip() and line.split()[-1] == "yes"}
    expected = {n for n in source_names() if not NOT_BUILT_FOR_CUDA.fullmatch(n)}
    assert len(expected) > 150  # the source lists hundreds: an empty or truncated scan would pass vacuously
    assert rows == expected, f"missing: {sorted(expected - rows)[:5]}; unexpected: {sorted(rows - expected)[:5]}"
    assert "assembled by ptxas for sm_80 sm_90" in out
    kept = {name for f in ptx.glob("*.ptx") for name in cuda_kernels.entry_names(f)}  # --ptx-out keeps the PTX
    assert kept == expected


PTX_FUNCTION = re.compile(r"^(?:\.visible |\.weak )?\.(entry|func)\s+(?:\([^)]*\)\s*)?(\w+)\s*\(", re.M)
PTX_CALL = re.compile(r"call\.uni\s*(?:\([^)]*\),\s*)?(\w+)")


def ptx_bodies(ptx: str) -> dict[str, tuple[str, str]]:
    """name -> (entry or func, body) for every function defined (not only declared) in a PTX module."""
    bodies = {}
    for m in PTX_FUNCTION.finditer(ptx):
        start, semicolon = ptx.find("{", m.end()), ptx.find(";", m.end())
        if semicolon != -1 and semicolon < start:
            continue  # a declaration
        bodies[m.group(2)] = (m.group(1), ptx[start:ptx.find("\n}\n", start)])
    return bodies


def test_every_cuda_kernel_waits_for_its_producers(cuda_compile_only) -> None:
    """Early start (docs/cuda.md): a kernel of a graph may start before the one it depends on has finished, so every
    sm_90 entry point runs griddepcontrol.wait, in the entry (the shim, before the kernel) or in what it calls (a
    LILY_INSTANTIATE_EARLY_KERNEL's own lily::grid_dependency_wait); the sm_80 PTX has none (no such launch there)."""
    _, _, ptx_dir = cuda_compile_only
    checked = 0
    for path in sorted(ptx_dir.glob("*.ptx")):
        bodies = ptx_bodies(path.read_text())

        def waits(name: str, seen: frozenset = frozenset()) -> bool:
            body = bodies.get(name, ("", ""))[1]
            return "griddepcontrol.wait" in body or any(
                callee not in seen and waits(callee, seen | {name}) for callee in PTX_CALL.findall(body))

        entries = [name for name, (kind, _) in bodies.items() if kind == "entry"]
        assert entries, path.name
        assert [name for name in entries if not waits(name)] == [], path.name
        checked += len(entries)
    assert checked > 150
    for path in ptx_dir.glob("check_sm_80/*.ptx"):
        assert "griddepcontrol" not in path.read_text(), path.name


def test_cuda_source_is_the_metal_file(tmp_path) -> None:
    """The generated .cu points its #line at metal/<file> and holds the file's lines, except the constructs the
    rewriter replaces in place (includes, threadgroup arrays, the kernel keyword, half literals; a comment line just
    above a threadgroup array is blanked with it)."""
    rewritten = re.compile(r'#\s*include|^\s*threadgroup\s|\bkernel\b|\[\[\s*threadgroup\s*\(|\d\.?\d*h\b|^\s*//')
    for source in cuda_kernels.metal_sources():
        cu = msl2cpu.generate_cuda(source, tmp_path).read_text()
        marker = f'#line 1 "{source.resolve()}"\n'
        assert marker in cu, source.name
        body = cu.split(marker, 1)[1].splitlines()
        original = source.read_text().splitlines()
        assert len(body) >= len(original), source.name
        changed = [i for i, line in enumerate(original) if body[i] != line]
        unexpected = [i + 1 for i in changed if not rewritten.search(original[i])]
        assert not unexpected, f"{source.name}: lines changed beyond the rewriter's constructs: {unexpected[:5]}"


def test_local_address_check_catches_the_clang19_miscompile(tmp_path) -> None:
    """A generic store through a local-window address (what clang 19 emitted for attention_prep) fails the build."""
    ptx = tmp_path / "bad.ptx"
    ptx.write_text(".version 8.5\n.visible .entry k(\n)\n{\n\tmov.u64 \t%SPL, __local_depot0;\n\tadd.u64 \t%rd4, %SPL, 64;\n"
                   "\tadd.s64 \t%rd9, %rd4, %rd8;\n\tst.f32 \t[%rd9], %f1;\n}\n")
    with pytest.raises(RuntimeError, match="generic access through a local address"):
        cuda_kernels.check_local_addresses(ptx)
    ptx.write_text(ptx.read_text().replace("st.f32", "st.local.f32"))
    cuda_kernels.check_local_addresses(ptx)


def test_no_driver_is_a_clear_error(tmp_path) -> None:
    """Without a driver library (here: $LILY_LIBCUDA names a missing file; a subprocess, since the driver is opened
    once per process), Runner and the self-test say so before any work."""
    missing = tmp_path / "libcuda.so.1"
    env = {**os.environ, "LILY_LIBCUDA": str(missing)}
    code = ("from lily import cuda\ntry:\n    cuda.Runner()\nexcept cuda.CudaError as e:\n    print(e)\n"
            "from lily import selftest\nprint('selftest', selftest.main(['--device', 'cuda']))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"no NVIDIA driver: {missing} cannot be loaded" in run.stdout
    assert "LILY_LIBCUDA names it" in run.stdout
    assert run.stdout.strip().endswith("selftest 2")
