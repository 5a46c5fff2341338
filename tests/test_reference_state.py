"""The reference model's state: prefill, chunked prefill and decode agree; copies are snapshots.

One-shot prefill is the oracle for every other way of feeding the same tokens. Relative error is
``max|a - b| / max|b|`` with ``b`` the one-shot logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import relative_error

from lily.checkpoint import load_checkpoint
from lily.reference import KV_CACHE_MIN_CAPACITY, ReferenceModel

# The same maths on differently batched tokens; the reference accumulates matmuls in fp64, so
# only a rare last-bit rounding difference may remain.
CHUNKING_TOLERANCE = 1e-6


@pytest.fixture(scope="module", params=["kv64", "gqa4"])
def model(request, tiny_checkpoints) -> ReferenceModel:
    return ReferenceModel(load_checkpoint(tiny_checkpoints.hf(request.param)))


def random_tokens(model: ReferenceModel, seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.args.vocab_size, length)


def run_in_chunks(model: ReferenceModel, tokens: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Feed ``tokens`` in chunks of the given sizes (the last repeats) and stack the logits."""
    state, logits, start, i = model.new_state(), [], 0, 0
    while start < len(tokens):
        size = sizes[min(i, len(sizes) - 1)]
        logits.append(model.forward(tokens[start : start + size], state))
        start, i = start + size, i + 1
    assert state.position == len(tokens)
    return np.concatenate(logits)


@pytest.mark.parametrize("sizes", [[1], [7], [5, 1, 30]], ids=lambda s: "-".join(map(str, s)))
def test_chunked_prefill_and_decode_match_one_shot_prefill(model: ReferenceModel, sizes: list[int]) -> None:
    tokens = random_tokens(model, 100 + sum(sizes), 40)
    one_shot = model.forward(tokens, model.new_state())
    assert relative_error(run_in_chunks(model, tokens, sizes), one_shot) <= CHUNKING_TOLERANCE


def test_kv_cache_growth_keeps_earlier_entries(tiny_checkpoints) -> None:
    model = ReferenceModel(load_checkpoint(tiny_checkpoints.hf("kv64")))
    # A prefill just under the first capacity, a chunk across it, then decode steps.
    capacity = KV_CACHE_MIN_CAPACITY
    tokens = random_tokens(model, 200, capacity + 14)
    one_shot = model.forward(tokens, model.new_state())
    assert relative_error(run_in_chunks(model, tokens, [capacity - 6, 9, 1]), one_shot) <= CHUNKING_TOLERANCE


def test_state_copy_is_an_independent_snapshot(model: ReferenceModel) -> None:
    prompt, continuation, other = (random_tokens(model, seed, n) for seed, n in ((300, 20), (301, 6), (302, 9)))
    state = model.new_state()
    model.forward(prompt, state)
    snapshot = state.copy()
    assert snapshot.position == state.position == len(prompt)

    from_original = model.forward(continuation, state)
    model.forward(other, state)  # the original moves on; the snapshot must not notice
    from_snapshot = model.forward(continuation, snapshot)

    np.testing.assert_array_equal(from_snapshot, from_original)
    assert state.position == len(prompt) + len(continuation) + len(other)


def test_new_state_starts_empty(model: ReferenceModel) -> None:
    tokens = random_tokens(model, 400, 12)
    used = model.new_state()
    model.forward(random_tokens(model, 401, 5), used)
    fresh = model.new_state()
    assert fresh.position == 0
    np.testing.assert_array_equal(model.forward(tokens, fresh), model.forward(tokens, model.new_state()))


@pytest.mark.parametrize(
    "token_ids,message",
    [
        ([], "token_ids"),
        ([[1, 2]], "token_ids"),
        ([1.5, 2.0], "token_ids"),
        ([3, -1], "token_ids"),
        ([3, 10**6], "token_ids"),
    ],
    ids=["empty", "2-D", "float", "negative", "past-vocab"],
)
def test_bad_token_ids_raise_a_clear_error(model: ReferenceModel, token_ids, message: str) -> None:
    state = model.new_state()
    with pytest.raises(ValueError, match=message):
        model.forward(token_ids, state)
    assert state.position == 0


def test_foreign_state_is_rejected(model: ReferenceModel, tiny_checkpoints) -> None:
    # kv64 vs dk32: same layer pattern, other recurrent-state shape; gqa4 vs kv64: other pattern.
    other_variant = "dk32" if model.args.num_hidden_layers == 4 else "kv64"
    other = ReferenceModel(load_checkpoint(tiny_checkpoints.hf(other_variant)))
    with pytest.raises(ValueError, match="state"):
        model.forward([1, 2], other.new_state())
    with pytest.raises(ValueError, match="state"):
        model.forward([1, 2], None)
