"""`python -m lily.selftest` in a subprocess: the JSON rows, the exit codes, and that a wrong case fails."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys

import pytest

from lily import selftest
from lily._ext import msl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
# Families whose selftest cases this test pins (other families are still being written).
OWN_FAMILIES = r"^(rms_norm|gated_delta|argmax|sample)"


def run_selftest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lily.selftest", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


def rows_of(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert set(row) == {"kernel", "shape", "error", "passed"}, row
        assert isinstance(row["kernel"], str) and isinstance(row["shape"], str) and isinstance(row["passed"], bool)
        assert row["error"] is None or isinstance(row["error"], (int, float))
    return rows


def test_every_kernel_has_a_row_and_the_exit_code_follows_the_rows() -> None:
    proc = run_selftest("--json")
    rows = rows_of(proc)
    assert [r["kernel"] for r in rows] == msl.kernel_names()
    assert proc.returncode == (0 if all(r["passed"] for r in rows) else 1), proc.stderr


def test_families_with_cases_pass() -> None:
    proc = run_selftest("--json", "--kernels", OWN_FAMILIES)
    rows = rows_of(proc)
    assert proc.returncode == 0, [r for r in rows if not r["passed"]]
    assert {r["kernel"] for r in rows} >= {"gated_delta_step_bf16_dk128", "sample_f32", "argmax_final_f32",
                                          "rms_norm_f16"}
    assert all(r["passed"] and r["error"] is not None and math.isfinite(r["error"]) for r in rows)


def test_a_wrong_case_fails() -> None:
    proc = run_selftest("--json", "--kernels", r"^(rms_norm_f32|sample_bf16)$", "--corrupt", "rms_norm_f32",
                        "--corrupt", "sample_bf16")
    rows = {r["kernel"]: r for r in rows_of(proc)}
    assert proc.returncode == 1
    assert not rows["rms_norm_f32"]["passed"] and rows["rms_norm_f32"]["error"] > 1e-3
    assert not rows["sample_bf16"]["passed"] and rows["sample_bf16"]["error"] == 4


def test_table_output_and_bad_arguments() -> None:
    proc = run_selftest("--kernels", "^rms_norm_bf16$")
    assert proc.returncode == 0
    assert "rms_norm_bf16" in proc.stdout and "1/1 kernels passed" in proc.stdout and "no GPU is tested" in proc.stdout
    proc = run_selftest("--kernels", "no_such_kernel_name")
    assert proc.returncode == 2 and "matches no instantiated kernel" in proc.stderr
    proc = run_selftest("--kernels", "^rms_norm_bf16$", "--corrupt", "rms_norm_f32")
    assert proc.returncode == 2 and "rms_norm_f32" in proc.stderr


def test_a_kernel_without_a_case_fails() -> None:
    (result,) = selftest.run(["rms_norm_f32"], cases=[])
    assert result.kernel == "rms_norm_f32" and not result.passed and result.shape == "no selftest case"
    (result,) = selftest.run(["rms_norm_f32"])
    assert result.passed


def test_mac_without_harness_says_nothing_was_tested(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def missing_harness():
        raise ImportError("No module named 'lily._ext.msl'")

    monkeypatch.setattr(selftest, "_msl", missing_harness)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert selftest.main(["--json"]) == 2
    err = capsys.readouterr().err
    assert "harness" in err and "no GPU is tested" in err and "Nothing was tested" in err
