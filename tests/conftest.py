"""Shared pytest fixtures: tiny random checkpoints generated once per session (see fixtures.py).

Fixtures
--------
``tiny_checkpoints``  a factory, ``tiny_checkpoints.hf(variant="kv64", layout="fused",
                      dtype="float32", shards=1)``, ``tiny_checkpoints.mlx(variant="kv64",
                      bits=4, dtype="bfloat16", source_dtype="float32")`` and
                      ``tiny_checkpoints.model(variant)``; each is built once per session.
                      The directories are shared: copy one before modifying it.
``tiny_hf_model``     the transformers model (fp32) behind the kv64 checkpoints.
``tiny_hf_dir``       kv64, fused layout, fp32.
``tiny_mlx4_dir``     kv64, MLX 4-bit with bf16 scales/biases (like the mlx-community files).
``tiny_mlx4_f32_dir`` kv64, MLX 4-bit with fp32 scales/biases.
``variant_hf_dir`` / ``variant_mlx4_dir``  parametrized over every variant in ``TINY_CONFIGS``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import fixtures


class TinyCheckpoints:
    """Builds tiny checkpoints on demand under one session tmp dir, each at most once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[tuple[str, int], object] = {}
        self._dirs: dict[tuple, Path] = {}

    def model(self, variant: str = "kv64", seed: int = 0):
        """The fp32 transformers model of ``variant`` (shared; do not modify it)."""
        key = (variant, seed)
        if key not in self._models:
            self._models[key] = fixtures.build_hf_model(variant, seed)
        return self._models[key]

    def hf(
        self,
        variant: str = "kv64",
        *,
        layout: str = "fused",
        dtype: str = "float32",
        shards: int = 1,
        seed: int = 0,
    ) -> Path:
        """An HF-layout checkpoint directory (read-only: copy it before corrupting it)."""
        key = ("hf", variant, layout, dtype, shards, seed)
        if key not in self._dirs:
            out = self.root / f"hf-{variant}-{layout}-{dtype}-s{shards}-seed{seed}"
            fixtures.save_hf_checkpoint(
                self.model(variant, seed), out, layout=layout, dtype=dtype, shards=shards, seed=seed
            )
            self._dirs[key] = out
        return self._dirs[key]

    def mlx(
        self,
        variant: str = "kv64",
        *,
        bits: int = 4,
        dtype: str = "bfloat16",
        source_dtype: str = "float32",
        seed: int = 0,
    ) -> Path:
        """An ``mlx_lm.convert`` quantized checkpoint (scales in ``dtype``) of the fused HF
        checkpoint saved in ``source_dtype``."""
        key = ("mlx", variant, bits, dtype, source_dtype, seed)
        if key not in self._dirs:
            out = self.root / f"mlx{bits}-{variant}-{dtype}-from-{source_dtype}-seed{seed}"
            source = self.hf(variant, dtype=source_dtype, seed=seed)
            fixtures.save_mlx_checkpoint(source, out, bits=bits, dtype=dtype)
            self._dirs[key] = out
        return self._dirs[key]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_checkpoints: TinyCheckpoints):
    return tiny_checkpoints.model("kv64")


@pytest.fixture(scope="session")
def tiny_hf_dir(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.hf("kv64")


@pytest.fixture(scope="session")
def tiny_mlx4_dir(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.mlx("kv64", bits=4, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_mlx4_f32_dir(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.mlx("kv64", bits=4, dtype="float32")


@pytest.fixture(scope="session")
def cuda_compile_only(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """`python -m lily.selftest --device cuda --compile-only --ptx-out DIR`, once per session: every kernel compiled
    to PTX and checked by ptxas (test_cuda_build.py reads the table, test_cuda_driver.py runs the PTX on the fake
    libcuda), so CI compiles the kernels for CUDA once. Returns (exit code, stdout, the PTX folder)."""
    import contextlib
    import io

    from lily import selftest

    out = tmp_path_factory.mktemp("cuda_ptx")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = selftest.main(["--device", "cuda", "--compile-only", "--ptx-out", str(out)])
    return code, printed.getvalue(), out


@pytest.fixture(scope="session", params=sorted(fixtures.TINY_CONFIGS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def variant_hf_dir(tiny_checkpoints: TinyCheckpoints, variant: str) -> Path:
    return tiny_checkpoints.hf(variant)


@pytest.fixture(scope="session")
def variant_mlx4_dir(tiny_checkpoints: TinyCheckpoints, variant: str) -> Path:
    return tiny_checkpoints.mlx(variant, bits=4, dtype="bfloat16")


# ---- What this build of lily._ext can run; tests that need more are skipped, saying why ----
# A Mac build has real Metal and neither the MSL CPU harness (lily._ext.msl) nor the fake Metal's controls; a Linux
# build without clang or off x86-64 has no Metal runtime at all (lily._ext.platform == "none", CMakeLists.txt).
# Markers: `metal` (runs the metal backend or the Metal API: a Mac's GPU, or the Linux test runtime), `fake_metal`
# (drives the fake Metal: stage order, dispatch statistics, live Objective-C objects). Modules that import the harness
# (HARNESS_MODULES) are skipped whole where it is absent, before they are imported.
try:
    from lily import _ext
except ImportError:  # not built: every test that needs the extension says so
    _ext = None

HAS_HARNESS = _ext is not None and getattr(_ext, "msl", None) is not None
# The test doubles (src/test_doubles/) are linked only into a test build (CMakeLists.txt's LILY_TEST_BUILD).
IS_TEST_BUILD = _ext is not None and hasattr(_ext, "_test_engine")
HAS_FAKE_METAL = IS_TEST_BUILD and hasattr(_ext._test_engine, "set_stage_order")
HAS_METAL = _ext is not None and _ext.platform != "none"
HARNESS_MODULES = ("kernels/", "harness/", "test_selftest.py", "engine/test_metallib.py")
# LILY_KERNEL_DEVICE=cuda or metal-api: the kernel tests dispatch on that device (tests/kernels/conftest.py), no
# harness needed.
KERNELS_OFF_HARNESS = os.environ.get("LILY_KERNEL_DEVICE", "harness") != "harness"
SKIP_REASONS = {
    "harness": "needs the MSL CPU execution harness (lily._ext.msl): Linux test builds with clang-19 on x86-64 only",
    "fake_metal": "needs the fake Metal's controls (stage order, statistics): the Linux Metal test runtime only",
    "metal": "needs a Metal runtime: this lily._ext was built without one (on Linux: a clang-19 test build on x86-64)",
}


# Modules whose tools install on Linux only (pyproject.toml's markers), skipped whole elsewhere: a Mac runs the suite
# too (scripts/test.sh).
LINUX_MODULES = {"test_cuda_build.py": "needs the CUDA toolchain wheels (nvidia-cuda-nvcc, nvidia-nvvm): Linux only"}


class _Absent(pytest.Module):
    """A test module whose prerequisite this machine or build lacks: collected as one skip with the reason."""

    reason = ""

    def collect(self):
        pytest.skip(f"{self.path.relative_to(Path(__file__).parents[1]).as_posix()} {self.reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent):
    relative = module_path.relative_to(Path(__file__).parent).as_posix()
    off_harness = KERNELS_OFF_HARNESS and relative.startswith("kernels/")
    needs_harness = relative.startswith(HARNESS_MODULES) and not off_harness
    reason = None
    if not HAS_HARNESS and needs_harness:
        reason = SKIP_REASONS["harness"]
    elif not sys.platform.startswith("linux") and relative in LINUX_MODULES:
        reason = LINUX_MODULES[relative]
    if reason is None:
        return None
    module = _Absent.from_parent(parent, path=module_path)
    module.reason = reason
    return module


def pytest_configure(config: pytest.Config) -> None:
    if _ext is not None and not IS_TEST_BUILD:
        raise pytest.UsageError(
            "lily._ext is not a test build (it lacks the test doubles the tests drive): run scripts/test.sh, or "
            "reinstall with CXX=clang++-19 pip install '.[test]' -Ccmake.define.LILY_TEST_BUILD=ON")
    for marker in ("metal", "fake_metal"):
        config.addinivalue_line("markers", f"{marker}: {SKIP_REASONS[marker]} (skipped where absent)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = {"metal": HAS_METAL, "fake_metal": HAS_FAKE_METAL}
    for item in items:
        for marker, present in available.items():
            if not present and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASONS[marker]))
