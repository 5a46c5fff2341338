"""Dummy weights for benchmarks: ``Model.load(source, load_format="dummy")``, ``lily bench --dummy-weights``.

As vLLM's ``load_format="dummy"``: a checkpoint-free model of a configuration's real shapes with random weights, in
the form ``lily.checkpoint`` produces for a 4-bit MLX checkpoint (packed uint32 codes, float32 scales and biases that
hold bf16 values, group 64; the router and the shared-expert gate at 8 bits; norms, conv1d, A_log and dt_bias dense),
so every backend runs it unchanged. The weights are random but keep routing realistic:

* zero mean: codes uniform in [0, 2^bits - 1] and ``bias = -scale * (2^bits - 1) / 2`` exactly (a scale has few
  enough significant bits that this bias is exact in bf16). Weights of non-zero mean add one common vector to every
  token's hidden state, which takes it over, and every token then routes to the same experts (performance.md §11).
* scales from the fan-in: each projection keeps its input's RMS, so the hidden state neither blows up nor collapses
  over 40 layers (tests/test_dummy.py measures both, and the expert load spread).

A tensor is generated when a backend asks for it, from its own seed (its name and the model's seed: asked for again,
it is the same), its codes in chunks spread over the CPUs; nothing is kept, so building the 19.5 GB full-size model
holds one tensor beyond what the backend keeps.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

import numpy as np

from lily import hub
from lily.checkpoint import (
    _EIGHT_BIT,
    Checkpoint,
    CheckpointError,
    Weights,
    _generation_config,
    _is_quantizable,
    _with_generation_eos,
    canonical_shapes,
)
from lily.config import ModelArgs, full_size_args
from lily.quant import QuantizedTensor, round_to_dtype

LOAD_FORMATS = ("auto", "dummy")
#: The ``source`` that stands for the built-in Qwen3.6-35B-A3B configuration (``lily.config.FULL_SIZE_CONFIG``).
FULL_SIZE = "full-size"
GROUP_SIZE = 64
# Storage dtype of scales, biases and dense tensors, as in mlx-community's 4-bit checkpoints.
_DTYPE = "bfloat16"
# Packed words generated per chunk: each chunk has its own random stream, so the values do not depend on the threads.
_CHUNK_WORDS = 1 << 22

Source = Union[str, os.PathLike, Mapping[str, Any], ModelArgs]


def dummy_checkpoint(source: Source, *, seed: int = 0) -> Checkpoint:
    """A ``Checkpoint`` of random weights with the shapes of ``source``'s configuration.

    ``source``: a checkpoint directory (its config.json; its tokenizer and generation_config.json if present), a
    config.json file, a config dict, ``"full-size"`` (Qwen3.6-35B-A3B), ``"lily:demo"`` or a ``ModelArgs``. No weight
    file is read. Raises ValueError (``lily.config.ConfigError``, ``CheckpointError``) naming what is wrong.
    """
    args, directory = _dummy_args(source)
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
    sources: dict[str, Any] = {}
    for name, shape in canonical_shapes(args).items():
        key = zlib.crc32(name.encode())
        if _is_quantizable(name, shape, GROUP_SIZE):
            bits = 8 if _EIGHT_BIT.search(name) else 4
            if bits != 4:
                quantization[f"language_model.model.{name.removesuffix('.weight')}"] = {"group_size": GROUP_SIZE,
                                                                                        "bits": bits}
            sources[name] = _RandomQuantized(shape, bits, GROUP_SIZE, _value_std(name, shape), seed, key)
        else:
            kind = _dense_kind(name)
            dtype = "float32" if name.endswith(("A_log", "dt_bias")) else _DTYPE  # as MLX checkpoints store them
            sources[name] = _RandomDense(shape, kind, dtype, seed, key)
    generation = _generation_config(directory) if directory is not None else {}
    if directory is not None:
        args = _with_generation_eos(args, generation, directory)
    has_tokenizer = directory is not None and (directory / "tokenizer.json").is_file()
    template = directory / "chat_template.jinja" if directory is not None else None
    return Checkpoint(
        path=directory if directory is not None else Path(f"<dummy weights, {_label(source)}>"),
        args=replace(args, quantization=quantization),
        weights=Weights(sources),
        format="dummy",
        files=(),
        tokenizer_dir=directory if has_tokenizer else None,
        chat_template_path=template if template is not None and template.is_file() else None,
        generation_config=generation,
    )


def _label(source: Source) -> str:
    if isinstance(source, ModelArgs):
        return "configuration"
    return "config dict" if isinstance(source, Mapping) else os.fspath(source)


def _dummy_args(source: Source) -> tuple[ModelArgs, Path | None]:
    """The configuration of ``source`` and the directory it came from (None for a dict, args or full-size)."""
    if isinstance(source, ModelArgs):
        return source, None
    if isinstance(source, Mapping):
        return ModelArgs.from_dict(source, source="config dict (load_format='dummy')"), None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError("load_format='dummy' takes a checkpoint directory, a config.json path, a config dict or "
                        f"'{FULL_SIZE}'; got {type(source).__name__}")
    text = os.fspath(source)
    if text == FULL_SIZE:
        return full_size_args(), None
    path = hub.resolve(text) if text.startswith("lily:") else Path(text).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise CheckpointError(f"{path}: missing config.json (load_format='dummy' reads the configuration only)")
        return ModelArgs.from_file(config), path
    if path.is_file():
        return ModelArgs.from_file(path), path.parent
    raise CheckpointError(f"{text}: not found; load_format='dummy' takes a checkpoint directory, a config.json path, "
                          f"a config dict or '{FULL_SIZE}' (a Hugging Face repo id is not downloaded for dummy "
                          "weights)")


# --- what each tensor holds --------------------------------------------------------------------------------------


def _value_std(name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of a quantized tensor's values: unit RMS rows for the embedding table (a token's hidden
    state starts at RMS 1), 1/sqrt(fan-in) for every projection (its output keeps its input's RMS)."""
    return 1.0 if name == "embed_tokens.weight" else 1.0 / math.sqrt(shape[-1])


def _dense_kind(name: str) -> str:
    """What a dense tensor holds: norm multipliers are ones, as are dt_bias (HF's initialisation); A_log is
    log(uniform(1, 16)) (HF's); conv1d taps are normal with variance 1/K, so the conv keeps its input's RMS."""
    if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
        return "ones"
    if name.endswith("A_log"):
        return "a_log"
    if name.endswith("conv1d.weight"):
        return "conv"
    raise CheckpointError(f"{name}: no dummy recipe for this dense tensor")


def _generator(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=key)))


def _random_words(count: int, seed: int, key: int) -> np.ndarray:
    """``count`` uniform uint32 words; chunk i from stream (key, 0, i), filled on several threads."""
    out = np.empty(count, np.uint32)

    def fill(start: int) -> None:
        stop = min(start + _CHUNK_WORDS, count)
        out[start:stop] = _generator(seed, key, 0, start // _CHUNK_WORDS).integers(
            0, 1 << 32, size=stop - start, dtype=np.uint32)

    starts = range(0, count, _CHUNK_WORDS)
    if len(starts) == 1:
        fill(0)
    else:
        with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
            list(pool.map(fill, starts))
    return out


def _exact_scales(values: np.ndarray, bits: int) -> np.ndarray:
    """Positive float32 ``values`` rounded in place to ``max(1, 8 - bits)`` significant bits (half up, on the bit
    pattern), so that ``scale * (2^bits - 1) / 2`` has at most 8 and is exact in bf16: the zero-mean bias stays
    exact."""
    dropped = 24 - max(1, 8 - bits)  # of float32's 24 significant bits
    raw = values.view(np.uint32)
    raw += np.uint32(1 << (dropped - 1))
    raw &= np.uint32((0xFFFFFFFF << dropped) & 0xFFFFFFFF)
    return values


@dataclass(frozen=True)
class _RandomQuantized:
    """A quantized tensor of uniform codes and zero-mean groups whose values have standard deviation ``std``."""

    shape: tuple[int, ...]
    bits: int
    group_size: int
    std: float
    seed: int
    key: int
    dtype: str = _DTYPE

    def load(self) -> QuantizedTensor:
        *lead, inputs = self.shape
        words = _random_words(math.prod(lead) * inputs * self.bits // 32, self.seed, self.key)
        levels = (1 << self.bits) - 1
        code_std = math.sqrt(((levels + 1) ** 2 - 1) / 12)  # of a code uniform in [0, levels]
        scales = _generator(self.seed, self.key, 1).random((*lead, inputs // self.group_size), np.float32)
        scales *= np.float32(0.5 * self.std / code_std)
        scales += np.float32(0.75 * self.std / code_std)  # uniform in [0.75, 1.25] x the mean scale
        _exact_scales(scales, self.bits)
        biases = scales * np.float32(-levels / 2)  # exact: the group's values are symmetric about zero
        return QuantizedTensor(words.reshape(*lead, inputs * self.bits // 32), scales, biases, self.bits,
                               self.group_size, self.dtype)

    def locations(self) -> None:
        return None


@dataclass(frozen=True)
class _RandomDense:
    """A dense tensor: ``kind`` from ``_dense_kind``, its values rounded to its storage ``dtype``."""

    shape: tuple[int, ...]
    kind: str
    dtype: str
    seed: int
    key: int

    def load(self) -> np.ndarray:
        if self.kind == "ones":
            return np.ones(self.shape, np.float32)
        rng = _generator(self.seed, self.key, 1)
        if self.kind == "a_log":
            values = np.log(rng.uniform(1.0, 16.0, size=self.shape))
        else:
            values = rng.normal(0.0, 1.0 / math.sqrt(self.shape[-1]), size=self.shape)
        return round_to_dtype(values.astype(np.float32), self.dtype)

    def locations(self) -> None:
        return None
