"""Building Lily with any C++17 compiler (CMakeLists.txt): the compiler the user chose is the one CMake uses, a build
that is not a test build links no test double, and a machine without clang builds, installs and generates text, with
`backend="metal"` saying what the build lacks.

The full build (one, into a temporary directory, reusing ccache when present) takes minutes on a small machine.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_RUNTIME_LINE = "built without the Metal test runtime (needs clang-19 on x86-64"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the Linux build (a Mac always builds with Metal)")


def configure(tmp_path: Path, cxx: str, source: Path = ROOT, *, test_build: bool = True) -> str:
    """CMake's configure step of the project in `source` with CXX=`cxx` (a test build unless `test_build` is
    False); its output."""
    import nanobind

    env = {**os.environ, "CXX": cxx}
    proc = subprocess.run(
        ["cmake", "-G", "Ninja", "-S", str(source), "-B", str(tmp_path / "build"), "-DLILY_CUDA_KERNELS=OFF",
         f"-DLILY_TEST_BUILD={'ON' if test_build else 'OFF'}",
         f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_DIR={nanobind.cmake_dir()}"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def recorded(tmp_path: Path) -> dict:
    """What the build recorded about itself (lily._build, written at configure time)."""
    return runpy.run_path(str(tmp_path / "build" / "_build.py"))


def no_runtime_line(output: str) -> str:
    """The build's line on the missing Metal test runtime as the package keeps it (no CMake or pip framing)."""
    line = next(line for line in output.splitlines() if NO_RUNTIME_LINE in line)
    return line.split("-- Lily: ", 1)[1].removesuffix(': backend="metal" is unavailable')


def head_commit() -> str:
    """HEAD's short hash, with -dirty where tracked files differ from it (CMakeLists.txt's rule)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode == 1
    return commit + ("-dirty" if changed else "")


@pytest.mark.parametrize("cxx,compiler_id,runtime", [("g++", "GNU", False), ("clang++-19", "Clang", True)])
def test_the_compiler_the_user_chose_is_used(tmp_path, cxx, compiler_id, runtime):
    if shutil.which(cxx) is None:
        pytest.fail(f"{cxx} is not installed (scripts/test.sh installs clang-19; g++ comes with the OS)")
    out = configure(tmp_path, cxx)
    assert f"The CXX compiler identification is {compiler_id} " in out, out
    # One line says the Metal test runtime is left out, and only where it is; the package keeps it for the user.
    assert out.count(NO_RUNTIME_LINE) == (0 if runtime else 1), out
    build = recorded(tmp_path)
    assert build["NO_METAL_RUNTIME"] == ("" if runtime else no_runtime_line(out))
    assert build["COMMIT"] == head_commit()


def test_a_build_that_is_not_a_test_build_links_no_test_double(tmp_path):
    out = configure(tmp_path, "clang++-19", test_build=False)
    # The compiler that would build the Metal test runtime, but no test build: the line says what is missing.
    assert "The CXX compiler identification is Clang " in out, out
    assert "needs clang-19 on x86-64 and a test build, LILY_TEST_BUILD=ON" in recorded(tmp_path)["NO_METAL_RUNTIME"]
    ninja = (tmp_path / "build" / "build.ninja").read_text()
    for double in ("test_doubles/objc_toy", "test_doubles/cuda_fake", "test_doubles/engine_test", "lily_fake_cuda",
                   "msl_cpu/fibers"):
        assert double not in ninja, double
    # The same configure as a test build links them all.
    test_build = configure(tmp_path / "test", "clang++-19")
    assert NO_RUNTIME_LINE not in test_build
    ninja = (tmp_path / "test" / "build" / "build.ninja").read_text()
    for double in ("test_doubles/objc_toy", "test_doubles/cuda_fake", "test_doubles/engine_test", "lily_fake_cuda"):
        assert double in ninja, double


def test_a_build_from_outside_a_git_checkout_records_an_unknown_commit(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for entry in ROOT.iterdir():  # the tree without .git
        if entry.name != ".git":
            (source / entry.name).symlink_to(entry)
    configure(tmp_path, "g++", source)
    assert recorded(tmp_path)["COMMIT"] == "unknown"


def path_without_clang(bin_dir: Path) -> str:
    """A PATH of one directory linking every program on PATH except clang's."""
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = bin_dir / entry.name
            if "clang" in entry.name or target.exists() or not os.access(entry.path, os.X_OK) or entry.is_dir():
                continue
            target.symlink_to(entry.path)
    return str(bin_dir)


def make_venv(venv: Path, *, with_pip: bool = True) -> Path:
    """A venv that imports what this interpreter imports (lily's dependencies included), in a venv, a conda env or a
    plain interpreter alike: a .pth file lists this interpreter's sys.path beyond the standard library.
    `--system-site-packages` would not do: it passes on the base interpreter's packages, not those of the venv or
    conda env running the tests."""
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(venv)],
                   check=True, timeout=300)
    stdlib = subprocess.run([sys.executable, "-I", "-S", "-c", "import sys; print(*sys.path, sep='\\n')"],
                            capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    inherited = [entry for entry in sys.path if entry and entry not in stdlib and os.path.isdir(entry)]
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # Plain paths, appended after the venv's own site-packages: what is installed into the venv comes first, and
    # the .pth files of the inherited directories (an editable install's import hook) do not run.
    (Path(purelib) / "inherited.pth").write_text("\n".join(inherited) + "\n")
    return venv


def test_a_venv_made_by_a_test_imports_what_the_running_interpreter_imports(tmp_path, monkeypatch):
    # A module only this interpreter can import (as a package installed in an outer venv would be).
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "only_outside.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(outer))
    venv = make_venv(tmp_path / "venv", with_pip=False)
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import only_outside, sys; print(only_outside.VALUE,"
                            " sys.prefix)"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["7", str(venv)]


def test_a_machine_without_clang_builds_installs_and_generates(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", "CC", "CMAKE_ARGS")}
    env["PATH"] = path_without_clang(tmp_path / "bin")
    if shutil.which("ccache", path=env["PATH"]):
        env["CMAKE_CXX_COMPILER_LAUNCHER"] = "ccache"
    assert shutil.which("g++", path=env["PATH"]) and not shutil.which("clang++-19", path=env["PATH"])
    # `pip install .` as the README says, with no compiler chosen (scikit-build-core falls back to Python's, g++).
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-build-isolation", "--no-deps", "-v",
         "-w", str(tmp_path / "wheel"), f"-Cbuild-dir={tmp_path / 'build'}"],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    log = build.stdout + build.stderr
    assert "The CXX compiler identification is GNU" in log, log[-4000:]
    assert log.count(NO_RUNTIME_LINE) == 1, log[-4000:]
    assert "Lily: no CUDA kernels in this build: no clang++" in log, log[-4000:]  # one line, and the build goes on
    venv = make_venv(tmp_path / "venv")
    wheel = next((tmp_path / "wheel").glob("lily-*.whl"))
    # --ignore-installed: CI has already installed this same version into the interpreter the venv inherits, and pip
    # would otherwise call the wheel satisfied and install nothing (no venv/bin/lily).
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                    str(wheel)],
                   env=env, check=True, timeout=600)
    run_env = {**env, "HF_HUB_OFFLINE": "1"}
    generate = subprocess.run([str(venv / "bin" / "lily"), "generate", "ROMEO:", "--max-tokens", "12"],
                              cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
    assert generate.returncode == 0, generate.stderr[-3000:]
    assert len(generate.stdout.strip()) > 0, generate.stderr[-3000:]
    assert "Generation: 12 tokens" in generate.stderr
    # The metal backend says what the build lacks, in one line, before loading anything: the build's own line, which
    # pip showed only with -v.
    build_line = no_runtime_line(log)
    assert "a test build, LILY_TEST_BUILD=ON" in build_line
    # A plain build ships no test double: no fake libcuda in the wheel, no lily._ext._test_engine.
    assert not [name for name in zipfile.ZipFile(wheel).namelist() if "fake_cuda" in name]
    doubles = subprocess.run([str(venv / "bin" / "python"), "-c", "from lily import _ext; "
                              "print(hasattr(_ext, '_test_engine'), getattr(_ext, 'msl', None) is None)"],
                             cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300)
    assert doubles.stdout.split() == ["False", "True"], doubles.stderr
    metal = subprocess.run([str(venv / "bin" / "lily"), "generate", "ROMEO:", "--backend", "metal"],
                           cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
    assert metal.returncode != 0
    assert metal.stderr.strip().splitlines()[-1] == (
        f"lily: error: backend='metal' is unavailable: lily was {build_line}; reinstall with CXX=clang++-19 pip "
        "install . -Ccmake.define.LILY_TEST_BUILD=ON (CXX picks the compiler), or use backend='cpu'"
    ), metal.stderr
    assert "Traceback" not in metal.stderr
    selftest = subprocess.run([str(venv / "bin" / "python"), "-m", "lily.selftest"], cwd=tmp_path, env=run_env,
                              capture_output=True, text=True, timeout=600)
    assert selftest.returncode != 0 and f"lily was {build_line}" in selftest.stderr, selftest.stderr
    # The commit the wheel was built from, recorded at build time (the venv is no git checkout).
    version = subprocess.run([str(venv / "bin" / "lily"), "--version"], cwd=tmp_path, env=run_env,
                             capture_output=True, text=True, timeout=300)
    assert re.fullmatch(rf"lily \S+ \(build {head_commit()}\)\n", version.stdout), version.stdout + version.stderr
    # The wheel carries the kernel sources and the CUDA build tool: --compile-only builds PTX outside any checkout,
    # after saying what is missing where the toolchain is not.
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"lily/kernel_source/metal/{p.name}" for p in (ROOT / "metal").iterdir()} <= names
    assert {f"lily/kernel_source/tools/{p.name}" for p in (ROOT / "tools").glob("*.py")} <= names
    compile_only = [str(venv / "bin" / "python"), "-m", "lily.selftest", "--device", "cuda", "--compile-only",
                    "--kernels", "^rms_norm", "--ptx-out", str(tmp_path / "ptx")]
    no_clang = subprocess.run(compile_only, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)
    assert no_clang.returncode == 1 and "lily.selftest: no clang++" in no_clang.stderr, no_clang.stderr[-3000:]
    built = subprocess.run(compile_only, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert f"from {venv}" in built.stdout and "/lily/kernel_source. No GPU was used." in built.stdout, built.stdout
    assert "rms_norm" in built.stdout and (tmp_path / "ptx" / "rms_norm.ptx").is_file()
    # The CUDA driver layer is built with any compiler; without a driver it says so (LILY_LIBCUDA: no such file).
    no_driver = subprocess.run([str(venv / "bin" / "python"), "-c", "from lily import cuda\ntry:\n    cuda.Runner()\n"
                                "except cuda.CudaError as e:\n    print(e)"],
                               cwd=tmp_path, env={**run_env, "LILY_LIBCUDA": str(tmp_path / "libcuda.so.1")},
                               capture_output=True, text=True, timeout=300)
    assert no_driver.stdout.startswith(f"no NVIDIA driver: {tmp_path / 'libcuda.so.1'} cannot be loaded"), (
        no_driver.stdout + no_driver.stderr[-3000:])
