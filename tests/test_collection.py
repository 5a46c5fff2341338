"""The suite where parts of the build are absent: collected as on a Mac (no MSL CPU harness, no fake Metal controls;
tests/as_mac_build.py), every test that needs them is skipped with the reason, and nothing fails to collect."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS_MODULES = sorted(
    [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "kernels").glob("test_*.py")]
    + [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "harness").glob("test_*.py")]
    + ["tests/engine/test_metallib.py", "tests/test_selftest.py"]
)


def pytest_as_a_mac(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "as_mac_build", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_collects_as_a_mac_and_harness_modules_say_why_they_are_skipped():
    proc = pytest_as_a_mac("--collect-only", "-q", "-rs", "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # No collection error (test names may contain "error": look for pytest's own ERROR lines and error counts).
    assert not re.search(r"^ERROR |\b\d+ errors?\b", proc.stdout, re.M), proc.stdout[-3000:]
    skipped = set(re.findall(r"SKIPPED \[1\] \S+: (tests/\S+\.py) needs the MSL CPU execution harness", proc.stdout))
    assert skipped == set(HARNESS_MODULES), sorted(skipped ^ set(HARNESS_MODULES))
    # Everything else is collected: the reference, API, server and metal-backend tests.
    collected = set(re.findall(r"^(tests/\S+\.py)::", proc.stdout, flags=re.M))
    for module in ("tests/test_reference_hf.py", "tests/test_api.py", "tests/test_server.py",
                   "tests/engine/test_metal_backend.py", "tests/engine/test_metal_head_dims.py"):
        assert module in collected, module
    assert not collected & skipped


def test_fake_metal_tests_say_why_they_are_skipped_as_a_mac():
    proc = pytest_as_a_mac("-q", "-rs", "-m", "fake_metal", "tests/engine/test_fake_metal.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reasons = re.findall(r"SKIPPED \[(\d+)\] \S+: (.*)", proc.stdout)
    assert reasons and all("needs the fake Metal's controls" in why for _, why in reasons), proc.stdout[-3000:]
    assert sum(int(n) for n, _ in reasons) >= 4
    assert re.search(r"\b0 passed|\d+ skipped", proc.stdout) and " passed" not in proc.stdout.replace("0 passed", "")
