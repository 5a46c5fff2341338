"""The ahead-of-time kernel library path: Device/KernelRunner built from a metallib file.

No Metal compiler exists on Linux, so the fake Metal takes a stand-in metallib: the real format's "MTLB" magic
followed by MSL source, whose library holds exactly the harness kernels that source names. That is enough to show
the library really comes from the file (a kernel the file does not name is missing) and that bad files give one
clear error naming the path.
"""

from __future__ import annotations

import importlib.resources
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from lily.backends import metal
from lily._ext import kernels, msl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from msl_text import host_names  # noqa: E402

ENGINE_KERNELS = ROOT / "tests" / "engine" / "engine_kernels.metal"


def write_stand_in_metallib(path: Path, source: str) -> Path:
    path.write_bytes(b"MTLB" + source.encode())
    return path


def lily_kernel_source() -> str:
    """metal/lily.h and metal/*.metal, as the build embeds them."""
    files = [ROOT / "metal" / "lily.h"] + sorted((ROOT / "metal").glob("*.metal"))
    return "\n".join(p.read_text() for p in files)


def test_the_library_comes_from_the_file(tmp_path: Path) -> None:
    # The runner expects two kernels; the metallib holds only one of them.
    lily_kernel = msl.kernel_names()[0]
    listing = ENGINE_KERNELS.read_text() + f'\nLILY_INSTANTIATE_KERNEL("{lily_kernel}", f, float)\n'
    metallib = write_stand_in_metallib(tmp_path / "lily.metallib", ENGINE_KERNELS.read_text())
    runner = kernels.Runner(metallib=str(metallib), kernel_names=host_names(listing))
    assert runner.kernel_names() == ["engine_scale"]
    assert runner.missing_kernel_names() == [lily_kernel]
    # The same listing compiled from source finds both: the difference is the file's.
    from_source = kernels.Runner(listing, kernel_names=host_names(listing))
    assert from_source.kernel_names() == sorted(["engine_scale", lily_kernel])


@pytest.mark.parametrize("count,threads", [(1, 32), (70, 32), (257, 128)])
@pytest.mark.parametrize("add_one", [None, True])
def test_a_kernel_from_the_metallib_runs(tmp_path: Path, count: int, threads: int, add_one: bool | None) -> None:
    metallib = write_stand_in_metallib(tmp_path / "lily.metallib", ENGINE_KERNELS.read_text())
    runner = kernels.Runner(metallib=str(metallib), kernel_names=["engine_scale"])
    rng = np.random.default_rng(count * 31 + threads)
    x = rng.standard_normal(count + 3).astype(np.float32)
    y = np.full(count + 3, np.nan, np.float32)
    scale = np.float32(rng.uniform(0.5, 3.0))
    runner.run("engine_scale", [x, y, struct.pack("<f", scale), struct.pack("<I", count)],
               (-(-count // threads), 1, 1), (threads, 1, 1), constants=None if add_one is None else {0: add_one})
    np.testing.assert_array_equal(y[:count], scale * x[:count] + np.float32(1.0 if add_one else 0.0))
    assert np.isnan(y[count:]).all()


def test_a_metallib_of_lilys_kernels_serves_every_kernel(tmp_path: Path) -> None:
    # The AOT build's library from the real kernel sources, listed by the embedded host names (the runner's default).
    metallib = write_stand_in_metallib(tmp_path / "lily.metallib", lily_kernel_source())
    runner = kernels.Runner(metallib=str(metallib))
    assert runner.kernel_names() == msl.kernel_names()
    assert runner.missing_kernel_names() == []


def test_a_missing_or_corrupt_metallib_is_one_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent.metallib"
    with pytest.raises(RuntimeError, match=rf"kernel library {missing}: .*cannot be read \(No such file"):
        kernels.Runner(metallib=str(missing))
    rng = np.random.default_rng(7)
    for name, content in [("random.metallib", rng.integers(0, 256, 512, dtype=np.uint8).tobytes()),
                          ("empty.metallib", b""), ("short.metallib", b"MTL"),
                          ("source.metallib", ENGINE_KERNELS.read_bytes())]:
        corrupt = tmp_path / name
        corrupt.write_bytes(content)
        with pytest.raises(RuntimeError, match=rf"cannot load the kernel library {corrupt}: .*not a metallib"):
            kernels.Runner(metallib=str(corrupt))
    with pytest.raises(RuntimeError, match=r"cannot load the kernel library .*cannot be read \(Is a directory"):
        kernels.Runner(metallib=str(tmp_path))  # a directory is no library either


def test_kernel_metallib_follows_the_build_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This (Linux) build compiles the embedded source: no metallib is looked for.
    assert kernels.aot_metallib is False
    assert metal.kernel_metallib() is None
    # An AOT build looks in one place only, next to _ext.
    monkeypatch.setattr(kernels, "aot_metallib", True)
    monkeypatch.setattr(importlib.resources, "files", lambda package: tmp_path if package == "lily" else None)
    with pytest.raises(FileNotFoundError, match=rf"LILY_AOT_METALLIB=ON .*{tmp_path / 'lily.metallib'} is missing"):
        metal.kernel_metallib()
    write_stand_in_metallib(tmp_path / "lily.metallib", lily_kernel_source())
    path = metal.kernel_metallib()
    assert path == str(tmp_path / "lily.metallib")
    assert kernels.Runner(metallib=path).kernel_names() == msl.kernel_names()
