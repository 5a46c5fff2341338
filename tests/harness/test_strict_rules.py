"""The harness rejects what Apple's Metal compiler rejects (tools/msl_rules.py, the shim), at build time.

Each tests/harness/strict/*.metal breaks one rule, named in its `// rule:` line; compiled for its `// metal-version:`
(default: Lily's), tools/msl2cpu.py or clang on the shim must fail with a message naming that rule. Its `// fix:`
lines (or `// fix-metal-version:`) repair it, and the repaired kernel must compile: a rule that rejected everything
would fail there. The real kernels pass under the same rules (they are built that way) and a scan of their
signatures confirms the fixes of issue 9.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import msl_rules  # noqa: E402

from lily._ext import msl  # noqa: E402

STRICT = sorted((ROOT / "tests" / "harness" / "strict").glob("*.metal"))
KERNEL_FILES = sorted((ROOT / "metal").glob("*.metal"))


def compile_for(tmp_path: Path, source: str, metal_version: int) -> subprocess.CompletedProcess:
    """What the build does with a kernel file: tools/msl2cpu.py, then clang++-19 on the shim (syntax only)."""
    src = tmp_path / "kernel.metal"
    src.write_text(source)
    rewrite = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "msl2cpu.py"), str(src), str(tmp_path), "--metal-version",
         str(metal_version)], capture_output=True, text=True)
    if rewrite.returncode != 0:
        return rewrite
    flags = ["-std=c++17", "-fsyntax-only", "-Wno-unknown-attributes", "-DMSL_CPU=1"]
    includes = [f"-I{ROOT / 'src' / 'msl_cpu' / 'include'}", f"-I{ROOT / 'src' / 'msl_cpu'}", f"-I{ROOT / 'metal'}"]
    return subprocess.run(["clang++-19", *flags, *includes, str(tmp_path / "kernel.cpp")], capture_output=True,
                          text=True)


def header(source: str, key: str) -> list[str]:
    return [m.strip() for m in re.findall(rf"^// {key}:(.*)$", source, re.M)]


def test_every_rule_has_a_broken_kernel() -> None:
    covered = {header(p.read_text(), "rule")[0] for p in STRICT}
    assert covered >= set(msl_rules.RULES) | {"simdgroup-element-types"}, sorted(set(msl_rules.RULES) - covered)


@pytest.mark.parametrize("path", STRICT, ids=[p.stem for p in STRICT])
def test_a_broken_kernel_fails_the_build_naming_its_rule(path: Path, tmp_path: Path) -> None:
    source = path.read_text()
    (rule,) = header(source, "rule")
    version = int((header(source, "metal-version") or [msl_rules.BASE_METAL_VERSION])[0])
    broken = compile_for(tmp_path, source, version)
    assert broken.returncode != 0, f"{path.name} compiled although it breaks [{rule}]"
    assert f"[{rule}]" in broken.stderr, broken.stderr
    assert "kernel.metal:" in broken.stderr, "the message must point into the .metal file"

    fixed_source, fixed_version = source, int((header(source, "fix-metal-version") or [version])[0])
    for fix in header(source, "fix"):
        old, new = (part.strip() for part in fix.split("=>"))
        body_start = fixed_source.index("#include")
        assert old in fixed_source[body_start:], f"{path.name}: fix {old!r} does not apply"
        fixed_source = fixed_source[:body_start] + fixed_source[body_start:].replace(old, new)
    assert fixed_source != source or fixed_version != version, f"{path.name} has no fix"
    fixed = compile_for(tmp_path, fixed_source, fixed_version)
    assert fixed.returncode == 0, f"{path.name}, fixed: {fixed.stderr}"


def test_metal_version_follows_the_declared_language_version(tmp_path: Path) -> None:
    source = ("#include <metal_stdlib>\nusing namespace metal;\n"
              "static_assert(__METAL_VERSION__ == EXPECTED, \"__METAL_VERSION__\");\n"
              "[[kernel]] void k(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = 1.0f; }\n")
    for version in (300, msl_rules.BASE_METAL_VERSION, msl_rules.TENSOR_OPS_METAL_VERSION):
        assert compile_for(tmp_path, source.replace("EXPECTED", str(version)), version).returncode == 0
        wrong = compile_for(tmp_path, source.replace("EXPECTED", str(version)), version + 10)
        assert wrong.returncode != 0 and "__METAL_VERSION__" in wrong.stderr


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.stem for p in KERNEL_FILES])
def test_the_real_kernels_pass_every_rule(path: Path) -> None:
    msl_rules.check_file(path)  # raises RuleViolation listing every violation


def test_no_kernel_mixes_position_attribute_widths() -> None:
    scanned = 0
    for path in KERNEL_FILES:
        for kernel, widths in msl_rules.kernel_attribute_widths(path.read_text()):
            assert len(set(widths.values())) <= 1, f"{path.name}: {kernel} mixes widths {widths}"
            assert 0 not in widths.values(), f"{path.name}: {kernel} has a position attribute of unknown type"
            scanned += 1
    assert scanned >= 30  # every kernel of metal/ (33 when this test was written)
    # The scanner itself sees a mismatch.
    assert msl_rules.kernel_attribute_widths(
        "[[kernel]] void k(uint2 g [[threadgroup_position_in_grid]], uint n [[threads_per_threadgroup]]) {}"
    ) == [("k", {"threadgroup_position_in_grid": 2, "threads_per_threadgroup": 1})]


def test_static_constexpr_members_in_metal_are_all_constant() -> None:
    found = []
    for path in [*KERNEL_FILES, *sorted((ROOT / "metal").glob("*.h"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if re.search(r"\bstatic\b(?!_)", code) and re.search(r"\bconstexpr\b", code):
                found.append(f"{path.name}:{number}")
                assert re.search(r"\bconstant\b", code), f"{path.name}:{number}: {line.strip()}"
    assert found, "metal/gemm.h's tile structs have static constexpr members"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_barrier_without_mem_threadgroup_between_threadgroup_write_and_read_is_reported(seed: int) -> None:
    n = 64
    values = np.arange(1, n + 1, dtype=np.float32)
    out = np.full(n, np.nan, np.float32)
    msl.dispatch("broken_barrier_flags", [values, out], (1, 1, 1), (n, 1, 1), constants={0: True}, seed=seed)
    np.testing.assert_array_equal(out, np.roll(values, -1))
    with pytest.raises(msl.KernelError, match="mem_flags lack mem_threadgroup"):
        msl.dispatch("broken_barrier_flags", [values, out], (1, 1, 1), (n, 1, 1), constants={0: False}, seed=seed)
