"""The reference on MLX 4-bit checkpoints against mlx-lm's own model (fp32).

The reference runs on the dequantized weights of the file (``scale * q + bias`` in fp32), which
is what mlx-lm's quantized matmuls compute with fp32 activations, so the two must agree to fp32
noise. Both conversions are checked: bf16 scales/biases (as the mlx-community files) and fp32.

Relative error is ``max|a - b| / max|b|`` with ``b`` mlx-lm's logits.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures import relative_error
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

LOGITS_TOLERANCE = 1e-3
PROMPT_LENGTH = 64
DECODE_PROMPT_LENGTH = 16
DECODE_STEPS = 24


@pytest.fixture(scope="module", params=["bfloat16", "float32"], ids=["bf16-scales", "f32-scales"])
def mlx_dir(request, tiny_checkpoints) -> Path:
    return tiny_checkpoints.mlx("kv64", bits=4, dtype=request.param)


@pytest.fixture(scope="module", params=["dk32", "gqa4"])
def other_variant_mlx_dir(request, tiny_checkpoints) -> Path:
    """The other tiny variants (dk != dv; more value heads per key head), bf16 scales."""
    return tiny_checkpoints.mlx(request.param, bits=4, dtype="bfloat16")


def mlx_fp32_model(path: Path):
    model, _ = load_model(path)
    model.set_dtype(mx.float32)
    return model


def mlx_logits(model, tokens: np.ndarray, cache=None) -> np.ndarray:
    logits = model(mx.array(np.asarray(tokens, dtype=np.int32))[None], cache=cache)
    return np.array(logits[0].astype(mx.float32))


def check_prefill(path: Path, seed: int) -> None:
    checkpoint = load_checkpoint(path)
    model = ReferenceModel(checkpoint)
    tokens = np.random.default_rng(seed).integers(0, checkpoint.args.vocab_size, PROMPT_LENGTH)

    logits = model.forward(tokens, model.new_state())

    assert logits.dtype == np.float32
    assert relative_error(logits, mlx_logits(mlx_fp32_model(path), tokens)) <= LOGITS_TOLERANCE


def test_prefill_logits_match_mlx_lm(mlx_dir: Path) -> None:
    check_prefill(mlx_dir, seed=31)


def test_prefill_logits_match_mlx_lm_on_other_variants(other_variant_mlx_dir: Path) -> None:
    check_prefill(other_variant_mlx_dir, seed=33)


def test_decode_matches_mlx_lm_cached_decode(mlx_dir: Path) -> None:
    checkpoint = load_checkpoint(mlx_dir)
    model = ReferenceModel(checkpoint)
    oracle = mlx_fp32_model(mlx_dir)
    prompt = np.random.default_rng(32).integers(0, checkpoint.args.vocab_size, DECODE_PROMPT_LENGTH)

    cache = make_prompt_cache(oracle)
    expected_step = mlx_logits(oracle, prompt, cache)[-1]
    state = model.new_state()
    step = model.forward(prompt, state)[-1]
    tokens, steps, expected_steps = [], [], []
    for _ in range(DECODE_STEPS):
        steps.append(step)
        expected_steps.append(expected_step)
        tokens.append(int(expected_step.argmax()))  # follow mlx-lm's greedy path
        assert int(step.argmax()) == tokens[-1], f"greedy token {len(tokens)} differs"
        expected_step = mlx_logits(oracle, tokens[-1:], cache)[0]
        step = model.forward(tokens[-1:], state)[0]

    assert relative_error(np.stack(steps), np.stack(expected_steps)) <= LOGITS_TOLERANCE
