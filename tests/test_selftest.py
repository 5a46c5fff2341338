"""`python -m lily.selftest`: the JSON rows, the exit codes, that a wrong case or a broken kernel fails (the
self-test, its tests and the kernel tests), the two devices (the CPU harness and the Metal API, which on Linux is the
fake Metal) agreeing, and the kernel runner behind ``--device metal-api``."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lily import kernel_cases, selftest
from lily.kernel_cases.sampling import STEPS
from lily._ext import kernels, msl

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from msl_text import host_names  # noqa: E402

FAKE_DEVICE = "Lily fake Metal (CPU harness)"
# Families whose selftest cases this test pins (other families are still being written).
OWN_FAMILIES = r"^(rms_norm|gated_delta|argmax|sample)"


def run_selftest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lily.selftest", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


def rows_of(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert set(row) == {"kernel", "shape", "error", "tolerance", "passed"}, row
        assert isinstance(row["kernel"], str) and isinstance(row["shape"], str) and isinstance(row["passed"], bool)
        assert row["error"] is None or isinstance(row["error"], (int, float))
    return rows


@pytest.fixture(scope="module")
def harness_rows() -> list[dict]:
    proc = run_selftest("--json", "--device", "harness")
    rows = rows_of(proc)
    assert proc.returncode == 0 and all(r["passed"] for r in rows), ([r for r in rows if not r["passed"]], proc.stderr)
    return rows


def test_every_kernel_has_a_passing_row() -> None:
    """Every instantiated kernel has a case, and every case passes with a measured error (exit code 0)."""
    proc = run_selftest("--json")  # auto: the harness on Linux
    rows = rows_of(proc)
    assert [r["kernel"] for r in rows] == msl.kernel_names()
    failed = [r for r in rows if not r["passed"] or r["error"] is None or not math.isfinite(r["error"])]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr)


def test_metal_api_path_passes_every_kernel_and_agrees_with_the_harness(harness_rows: list[dict]) -> None:
    proc = run_selftest("--json", "--device", "metal-api")
    rows = rows_of(proc)
    assert [r["kernel"] for r in rows] == msl.kernel_names()
    failed = [r for r in rows if not r["passed"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr)
    assert "not compiled for this GPU" not in proc.stderr
    # Both paths end in the same harness with the same schedule, so the outputs, hence the errors, are identical:
    # any difference is the binding, the argument convention or the copies in and out of Metal buffers.
    assert rows == harness_rows


def test_families_with_cases_pass() -> None:
    proc = run_selftest("--json", "--kernels", OWN_FAMILIES)
    rows = rows_of(proc)
    assert proc.returncode == 0, [r for r in rows if not r["passed"]]
    assert {r["kernel"] for r in rows} >= {"gated_delta_step_bf16_dk128", "sample_f32", "argmax_final_f32",
                                          "rms_norm_bf16"}
    assert all(r["passed"] and r["error"] is not None and math.isfinite(r["error"]) for r in rows)


@pytest.mark.parametrize("device", ["harness", "metal-api"])
def test_a_wrong_case_fails(device: str) -> None:
    proc = run_selftest("--json", "--device", device, "--kernels", r"^(rms_norm_f32|sample_f32)$",
                        "--corrupt", "rms_norm_f32", "--corrupt", "sample_f32")
    rows = {r["kernel"]: r for r in rows_of(proc)}
    assert proc.returncode == 1
    assert not rows["rms_norm_f32"]["passed"] and rows["rms_norm_f32"]["error"] > 1e-3
    assert not rows["sample_f32"]["passed"] and rows["sample_f32"]["error"] == STEPS  # every draw wrong


def test_table_output_and_bad_arguments() -> None:
    proc = run_selftest("--kernels", "^rms_norm_bf16$")
    assert proc.returncode == 0
    assert "rms_norm_bf16" in proc.stdout and "1/1 kernels passed" in proc.stdout and "no GPU is tested" in proc.stdout
    assert "CPU execution harness" in proc.stdout
    proc = run_selftest("--kernels", "no_such_kernel_name")
    assert proc.returncode == 2 and "matches no instantiated kernel" in proc.stderr
    proc = run_selftest("--kernels", "^rms_norm_bf16$", "--corrupt", "rms_norm_f32")
    assert proc.returncode == 2 and "rms_norm_f32" in proc.stderr
    proc = run_selftest("--device", "gpu")
    assert proc.returncode == 2 and "--device" in proc.stderr and "metal-api" in proc.stderr


def test_a_kernel_without_a_case_fails() -> None:
    (result,) = selftest.run(["rms_norm_f32"], cases=[])
    assert result.kernel == "rms_norm_f32" and not result.passed and result.shape == "no selftest case"
    (result,) = selftest.run(["rms_norm_f32"])
    assert result.passed
    (result,) = selftest.run(["rms_norm_f32"], device=selftest.open_device("metal-api"))
    assert result.passed


def test_all_runs_every_case_of_every_kernel() -> None:
    """--all: the kernel tests' whole case set, one row per case, every kernel listed. Over three families: the kernel
    tests run every case of every kernel here already (and test_registry.py checks they did)."""
    families = r"^(rms_norm|attention_decode_combine|moe_route)"
    proc = run_selftest("--json", "--all", "--kernels", families)
    rows = rows_of(proc)
    names = [n for n in msl.kernel_names() if re.match(families, n)]
    assert proc.returncode == 0 and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert sorted({r["kernel"] for r in rows}) == names and len(names) >= 6
    assert len(rows) == len(kernel_cases.cases(names)) > 2 * len(names)


# ---- a broken kernel fails the self-test, the self-test's tests and the kernel tests ----

# A kernel that writes one element of its output 64 float32 ulps off (a relative error of about 8e-6).
BREAK_RMS_NORM_F32 = """
import numpy as np
from lily._ext import msl

_dispatch = msl.dispatch


def broken(kernel, args, *rest, **options):
    _dispatch(kernel, args, *rest, **options)
    if kernel == "rms_norm_f32":
        args[-1].view(np.uint32).flat[7] += 64


msl.dispatch = broken
"""


def broken_device() -> selftest.KernelDevice:
    device = selftest.open_device("harness")
    namespace: dict = {}
    exec(BREAK_RMS_NORM_F32.replace("msl.dispatch = broken", ""), namespace)
    device.run = namespace["broken"]
    return device


def test_a_broken_kernel_fails_its_row(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    rows = selftest.run(["rms_norm_f32", "rms_norm_bf16"], device=broken_device(), all_cases=True)
    failed = {r.shape for r in rows if not r.passed}
    assert failed and all(r.kernel == "rms_norm_f32" for r in rows if not r.passed)
    assert all(r.passed for r in rows if r.kernel == "rms_norm_bf16")
    monkeypatch.setattr(selftest.device, "open_device", lambda kind: broken_device())
    assert selftest.main(["--kernels", "^rms_norm_(f32|bf16)$"]) == 1
    out = capsys.readouterr().out
    assert "1/2 kernels passed" in out and "failed: rms_norm_f32" in out


def test_the_tests_fail_when_a_kernel_is_broken(tmp_path: Path) -> None:
    """The same break, made in every Python process of a pytest run (sitecustomize): this file's row check and the
    kernel test of the case fail, naming the kernel, the shape, the error and the tolerance."""
    (tmp_path / "sitecustomize.py").write_text(BREAK_RMS_NORM_F32)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    case = "test_rms_norm[rms_norm_f32-rows=2-n=1000-threads=256]"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_selftest.py::test_every_kernel_has_a_passing_row",
                           f"tests/kernels/test_rms_norm.py::{case}"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "2 failed" in proc.stdout, proc.stdout[-3000:]
    assert "'kernel': 'rms_norm_f32'" in proc.stdout
    assert "rms_norm_f32 [rows=2 n=1000 threads=256] out: max error" in proc.stdout
    assert "NOT within tolerance (|err| <= 1e-06 + 2e-06|e|, rel RMS <= 1e-06)" in proc.stdout


# ---- on a Mac (platform.system() patched; the Metal API is the fake Metal here) ----


def test_on_a_mac_auto_runs_through_the_metal_api_and_names_the_gpu(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert selftest.main(["--kernels", "^rms_norm_(f32|bf16)$"]) == 0
    out, err = capsys.readouterr()
    assert f"running the kernels on the GPU '{FAKE_DEVICE}' through the Metal API" in err
    assert "2/2 kernels passed" in out and f"Kernels ran on the GPU '{FAKE_DEVICE}'" in out
    assert "no GPU is tested" not in out
    assert selftest.main(["--json", "--kernels", "^rms_norm_f32$", "--corrupt", "rms_norm_f32"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["kernel"] == "rms_norm_f32" and not row["passed"]


def test_on_a_mac_the_harness_is_absent_and_nothing_is_tested(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def missing_harness():
        raise ImportError("No module named 'lily._ext.msl'")

    monkeypatch.setattr(selftest.device, "_msl", missing_harness)
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert selftest.main(["--json", "--device", "harness"]) == 2
    err = capsys.readouterr().err
    assert "harness" in err and "--device metal-api" in err and "Nothing was tested" in err


def test_a_metal_device_that_cannot_open_is_reported(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(selftest.device, "_metal_runner",
                        lambda: source_runner("#error this GPU's compiler says no\n"))
    assert selftest.main(["--device", "metal-api"]) == 2
    err = capsys.readouterr().err
    assert "cannot open the Metal device" in err and "this GPU's compiler says no" in err
    assert "Nothing was tested" in err


def test_kernels_the_gpu_did_not_compile_are_named_and_not_run(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # As qmm_nax on a GPU without Metal 4 tensor ops: instantiated in the source, absent from the library.
    source = (ROOT / "metal" / "lily.h").read_text() + (ROOT / "metal" / "rms_norm.metal").read_text() + (
        "#if defined(__HAVE_A_FUTURE_GPU__)\nLILY_INSTANTIATE_KERNEL(\"rms_norm_future_f32\", rms_norm, float)\n"
        "#endif\n")
    monkeypatch.setattr(selftest.device, "_metal_runner", lambda: source_runner(source))
    assert selftest.main(["--json", "--device", "metal-api"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert [r["kernel"] for r in rows] == sorted(k for k in msl.kernel_names() if k.startswith("rms_norm_"))
    assert all(r["passed"] for r in rows)
    assert "not compiled for this GPU" in err and "rms_norm_future_f32" in err


# ---- the kernel runner (lily._ext.kernels.Runner) ----


def source_runner(source: str) -> kernels.Runner:
    """A Runner compiling `source`, listing the kernels it instantiates."""
    return kernels.Runner(source, kernel_names=host_names(source))


@pytest.fixture(scope="module")
def runner() -> kernels.Runner:
    return kernels.Runner()


@pytest.fixture(scope="module")
def test_kernels_runner() -> kernels.Runner:
    """A Runner over the harness's and the engine tests' own kernels, compiled as one library: Lily's embedded
    families hold only the kernels of metal/."""
    sources = sorted((ROOT / "tests" / "harness").glob("*.metal")) + sorted((ROOT / "tests" / "engine").glob("*.metal"))
    return source_runner("\n".join(p.read_text() for p in sources))


def test_runner_lists_the_kernels_the_source_instantiates(runner: kernels.Runner) -> None:
    assert runner.device_name == FAKE_DEVICE
    assert runner.kernel_names() == msl.kernel_names() and runner.missing_kernel_names() == []
    # The harness's own test kernels (plain kernels and host_name instantiations), as the harness registered them at
    # build time, are what tools/msl_text.py reads from the sources.
    test_sources = sorted((ROOT / "tests" / "harness").glob("*.metal")) + sorted((ROOT / "tests" / "engine").glob(
        "*.metal"))
    test_runner = source_runner("\n".join(p.read_text() for p in test_sources))
    assert test_runner.kernel_names() == msl.test_kernel_names() and test_runner.missing_kernel_names() == []
    commented = source_runner('// LILY_INSTANTIATE_KERNEL("rms_norm_x", rms_norm, float)\n'
                              '/* [[kernel]] void engine_y(device float* a) */\n'
                              'template <typename T>\n[[kernel]] void engine_scale(device T* a) {}\n'
                              'template [[host_name("engine_scale")]] [[kernel]] decltype(f<float>) f<float>;\n'
                              'LILY_INSTANTIATE_KERNEL("no_such_kernel", f, float)\n')
    assert commented.kernel_names() == ["engine_scale"] and commented.missing_kernel_names() == ["no_such_kernel"]


@pytest.mark.parametrize("count,threads", [(1, 32), (70, 32), (64, 64), (257, 128)])
@pytest.mark.parametrize("add_one", [None, True, False])
def test_runner_runs_a_kernel_with_function_constants(test_kernels_runner: kernels.Runner, count: int,
                                                      threads: int, add_one: bool | None) -> None:
    rng = np.random.default_rng(count * 7 + threads)
    x = rng.standard_normal(count + 5).astype(np.float32)
    y = np.full(count + 5, np.nan, np.float32)
    scale = np.float32(rng.uniform(0.5, 3.0))
    test_kernels_runner.run("engine_scale", [x, y, struct.pack("<f", scale), struct.pack("<I", count)],
                            (-(-count // threads), 1, 1), (threads, 1, 1),
                            constants=None if add_one is None else {0: add_one})
    expected = scale * x[:count] + np.float32(1.0 if add_one else 0.0)
    np.testing.assert_array_equal(y[:count], expected)
    assert np.isnan(y[count:]).all()  # past n: untouched, and copied back untouched


def test_runner_errors_name_the_kernel_and_the_argument(test_kernels_runner: kernels.Runner) -> None:
    x, y = np.zeros(64, np.float32), np.zeros(64, np.float32)
    n = struct.pack("<I", 64)

    def run(args, threads=32, constants=None):
        test_kernels_runner.run("engine_scale", args, (2, 1, 1), (threads, 1, 1), constants=constants)

    with pytest.raises(ValueError, match=r"kernel 'engine_scale' args\[1\]: .*not C-contiguous"):
        run([x, np.zeros(128, np.float32)[::2], struct.pack("<f", 1.0), n])
    readonly = np.zeros(64, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match=r"kernel 'engine_scale' args\[1\]: .*read-only"):
        run([x, readonly, struct.pack("<f", 1.0), n])
    with pytest.raises(TypeError, match=r"kernel 'engine_scale' args\[2\]: expected a numpy array .* got float"):
        run([x, y, 1.0, n])
    with pytest.raises(RuntimeError, match=r"kernel 'engine_scale' args\[2\]: setBytes data must be 1 to 4096 bytes"):
        run([x, y, bytes(4097), n])
    with pytest.raises(RuntimeError, match=r"threads per threadgroup must be 1 to 1024; got 2048"):
        run([x, y, struct.pack("<f", 1.0), n], threads=2048)
    with pytest.raises(TypeError, match=r"constants\[0\] must be a bool or a 64-bit int; got float"):
        run([x, y, struct.pack("<f", 1.0), n], constants={0: 0.5})
    with pytest.raises(RuntimeError, match=r"kernel 'no_such_kernel': .*was not found in the library"):
        test_kernels_runner.run("no_such_kernel", [x], (1, 1, 1), (1, 1, 1))
    with pytest.raises(RuntimeError, match=r"cannot compile the kernel library: program_source:2: error: bad"):
        source_runner("// fine\n#error bad\n")
    with pytest.raises(ValueError, match=r"kernel_source needs kernel_names, the host names it instantiates"):
        kernels.Runner("[[kernel]] void engine_x(device float* a [[buffer(0)]]) {}\n")


def test_a_failing_command_buffer_names_the_kernel_and_leaves_the_arrays(test_kernels_runner: kernels.Runner) -> None:
    x, out = np.arange(64, dtype=np.float32), np.full(64, np.nan, np.float32)
    with pytest.raises(RuntimeError, match=r"kernel 'broken_barrier_early_return': .*command buffer failed: .*"
                                           r"barrier divergence"):
        test_kernels_runner.run("broken_barrier_early_return", [x, out, struct.pack("<I", 40)], (1, 1, 1), (64, 1, 1))
    assert np.isnan(out).all()
    test_kernels_runner.run("broken_barrier_early_return", [x, out, struct.pack("<I", 64)], (1, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, x[::-1])
