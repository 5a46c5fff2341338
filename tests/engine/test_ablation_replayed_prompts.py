"""The REPLAYED_PROMPTS switch: a prompt chunk of 2 to 8 tokens (tuning::kReplayedPromptMaxRows) runs a pass recorded
once per length and replayed at any position, as the decode step is; off, it is built and launched node by node, as
a long chunk is. Both run the same graph, so their logits are equal bit for bit, and both follow lily.reference. A
conversation's short turns at growing positions reuse one recording per length."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

from tests.engine.test_metal_head_dims import DEMO

# Turns of a conversation: lengths 5, 3, 8 and 2 (the shortest and the longest replayed), two of them repeated at
# later positions, and a 9-token turn past the limit.
TURNS = [[11, 42, 7, 300, 5], [9, 8, 7], [1, 2, 3, 4, 5], [77] * 8, [15, 16], [100, 200, 300], list(range(20, 29))]


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(DEMO)


def _run(backend, last_only: bool) -> list[np.ndarray]:
    state = backend.new_state()
    return [backend.forward(np.array(turn), state, last_only=last_only) for turn in TURNS]


@pytest.mark.parametrize("last_only", [True, False], ids=["last-row", "every-row"])
def test_replayed_prompt_passes_equal_the_built_ones(engine_backend, demo, last_only):
    replayed = engine_backend(demo, precision="float32")
    built = engine_backend(demo, precision="float32", switches={"replayed_prompts": False})
    before = replayed._engine.programs_built, built._engine.programs_built
    got, want = _run(replayed, last_only), _run(built, last_only)
    for turn, g, w in zip(TURNS, got, want):
        np.testing.assert_array_equal(g, w, err_msg=f"turn of {len(turn)} tokens")
    # One recording per replayed length (5, 3, 8, 2), whatever the position; none without the switch.
    replayed_lengths = {len(t) for t in TURNS if len(t) <= 8}
    assert replayed._engine.programs_built - before[0] == len(replayed_lengths)
    assert built._engine.programs_built == before[1]
    # And the reference: the same turns through lily.reference, row for row.
    ref = ReferenceModel(demo)
    state = ref.new_state()
    for turn, g in zip(TURNS, got):
        rows = ref.forward(np.array(turn), state)
        rows = rows[-1:] if last_only else rows
        rel = float(np.max(np.abs(g - rows)) / np.max(np.abs(rows)))
        assert rel < 1e-4, f"turn of {len(turn)} tokens: relative error {rel:.3g} against the reference"


def test_replayed_prompts_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_REPLAYED_PROMPTS": "1"}) == {"replayed_prompts": False}
