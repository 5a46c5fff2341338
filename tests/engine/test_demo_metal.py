"""The engine on the embedded demo model (`lily:demo`: head dim 64, DeltaNet dk = dv = 64) through
`lily.Model.load(backend=...)`, on each runtime ("metal", "cuda": `engine_runtime`, tests/engine/conftest.py), against
`lily.reference` (numpy fp32) on held-out Shakespeare text.

The Must-show check of the default mode (bf16 activations, fp32 accumulation and DeltaNet state, bf16 KV cache):
teacher-forced top-1 agreement with the reference >= 99 % over 256 positions and perplexity within 0.5 %. The
first 216 positions run as one prefill chunk (T-row kernels), the last 40 as one decode step per token (the
per-token chain generation uses), so both graphs are measured.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lily import Model


HELDOUT = Path(__file__).resolve().parents[2] / "scripts" / "demo" / "heldout_sample.txt"
POSITIONS = 256
PREFILL_POSITIONS = 216  # the other 40 run as decode steps (the harness runs a step in 0.1-0.2 s)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    return float(np.exp(-log_softmax(logits)[np.arange(len(targets)), targets].mean()))


@pytest.fixture(scope="module")
def reference() -> Model:
    return Model.load("lily:demo", backend="reference", progress=False)


@pytest.fixture(scope="module")
def heldout_ids(reference) -> np.ndarray:
    ids = np.asarray(reference.encode(HELDOUT.read_text(encoding="utf-8")))
    assert len(ids) > POSITIONS
    return ids[: POSITIONS + 1]


def test_default_mode_agrees_with_the_reference_on_heldout_text(engine_runtime, reference, heldout_ids):
    model = Model.load("lily:demo", backend=engine_runtime, progress=False)
    assert model.backend.precision == "bfloat16"  # the default mode
    inputs, targets = heldout_ids[:-1], heldout_ids[1:]
    want = reference.backend.forward(inputs, reference.backend.new_state())

    state = model.backend.new_state()
    got = [model.backend.forward(inputs[:PREFILL_POSITIONS], state)]
    assert model.backend.last_step_counts()["dispatches_by_kernel"].get("moe_sort_scatter_u32")  # the prefill graph
    got += [model.backend.forward(inputs[t : t + 1], state) for t in range(PREFILL_POSITIONS, POSITIONS)]
    got = np.concatenate(got)
    assert got.shape == want.shape and np.isfinite(got).all()

    agreement = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    want_ppl, got_ppl = perplexity(want, targets), perplexity(got, targets)
    assert agreement >= 0.99, f"top-1 agreement {agreement:.4f}"  # 0.988 with bf16 logits; f32 logits: 0.996
    assert abs(got_ppl / want_ppl - 1) <= 0.005, f"perplexity {got_ppl:.4f} vs reference {want_ppl:.4f}"
    # Each part separately: neither graph may hide behind the other.
    for part in (slice(0, PREFILL_POSITIONS), slice(PREFILL_POSITIONS, POSITIONS)):
        assert np.mean(got[part].argmax(-1) == want[part].argmax(-1)) >= 0.97


def test_model_load_prefill_and_greedy_decode_match_the_reference(engine_runtime, reference, tmp_path):
    prompt = "KING HENRY:\nWhat say you, my lords?"
    model = Model.load("lily:demo", backend=engine_runtime, precision="float32", progress=False)
    assert model.backend_name == engine_runtime and model.backend.precision == "float32"
    want = reference.generate(prompt, max_tokens=8, temperature=0, use_cache=False)
    got = model.generate(prompt, max_tokens=8, temperature=0)
    assert got.token_ids == want.token_ids and got.text == want.text

    # The prompt cache holds the engine's snapshots: the same prompt again restores one and continues identically.
    assert len(model.prompt_cache) > 0 and model.prompt_cache.nbytes > 0
    again = model.generate(prompt, max_tokens=8, temperature=0)
    assert again.stats.cached_tokens > 0 and again.token_ids == want.token_ids

    # A saved session continues exactly as the live one in a freshly loaded model.
    session = model.prefill(prompt, use_cache=False)
    path = tmp_path / "session.safetensors"
    session.save(path)
    live = [t.id for t in session.decode(max_tokens=4, temperature=0)]
    other = Model.load("lily:demo", backend=engine_runtime, precision="float32", progress=False)
    restored = type(session).load(path, other)
    assert [t.id for t in restored.decode(max_tokens=4, temperature=0)] == live

    # A session saved in float32 mode does not fit the bfloat16 engine's state: one clear error.
    bf16 = Model.load("lily:demo", backend=engine_runtime, precision="bfloat16", progress=False)
    mismatched = type(session).load(path, bf16)
    with pytest.raises(ValueError, match="state snapshot holds"):
        list(mismatched.decode(max_tokens=2, temperature=0))  # the second token runs the model


@pytest.mark.metal
def test_precision_is_checked_against_the_backend():
    with pytest.raises(ValueError, match="reference backend computes in float32 only"):
        Model.load("lily:demo", backend="reference", precision="bfloat16", progress=False)
    with pytest.raises(ValueError, match="precision must be one of"):
        Model.load("lily:demo", backend="metal", precision="float16", progress=False)
