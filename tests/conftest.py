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


@pytest.fixture(scope="session", params=sorted(fixtures.TINY_CONFIGS))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def variant_hf_dir(tiny_checkpoints: TinyCheckpoints, variant: str) -> Path:
    return tiny_checkpoints.hf(variant)


@pytest.fixture(scope="session")
def variant_mlx4_dir(tiny_checkpoints: TinyCheckpoints, variant: str) -> Path:
    return tiny_checkpoints.mlx(variant, bits=4, dtype="bfloat16")
