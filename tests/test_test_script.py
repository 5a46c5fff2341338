"""scripts/test.sh's macOS branch, run here with stand-ins for uname, xcode-select, apt-get and python that only record
how they were called: no apt, Xcode's tools required, the self-test on the GPU and then the suite (docs/verification.md
says what only a Mac can check)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def fake_mac(bin_dir: Path, *, xcode: bool, selftest_status: int = 0) -> Path:
    """A PATH directory in which uname says Darwin and every other program the script may call logs its arguments."""
    bin_dir.mkdir()
    log = bin_dir / "calls.log"
    tools = {
        "uname": 'echo Darwin',
        "xcode-select": f'echo "xcode-select $*" >> {log}; exit {0 if xcode else 2}',
        "apt-get": f'echo "apt-get $*" >> {log}',
        "sudo": f'echo "sudo $*" >> {log}',
        "python": f'echo "python $*" >> {log}; [ "$2" = lily.selftest ] && exit {selftest_status}; exit 0',
    }
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return log


def run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args", [(), ("-k", "metal")])
def test_on_macos_it_installs_with_pip_only_then_runs_the_selftest_and_the_suite(tmp_path, args):
    log = fake_mac(tmp_path / "bin", xcode=True)
    proc = run(tmp_path / "bin", *args)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [
        "xcode-select -p",
        "python -m pip install --upgrade pip",
        "python -m pip install .[test] -Ccmake.define.LILY_TEST_BUILD=ON",
        "python -m lily.selftest",
        " ".join(["python -m pytest -q", *args]),
    ]


def test_on_macos_a_failing_selftest_still_runs_the_suite_and_fails(tmp_path):
    log = fake_mac(tmp_path / "bin", xcode=True, selftest_status=3)
    proc = run(tmp_path / "bin")
    assert proc.returncode == 3
    assert log.read_text().splitlines()[-1] == "python -m pytest -q"


def test_on_macos_without_xcode_tools_it_says_how_to_get_them(tmp_path):
    log = fake_mac(tmp_path / "bin", xcode=False)
    proc = run(tmp_path / "bin")
    assert proc.returncode == 1
    assert "xcode-select --install" in proc.stderr
    assert log.read_text().splitlines() == ["xcode-select -p"]
