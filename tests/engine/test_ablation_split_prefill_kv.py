"""The SPLIT_PREFILL_KV switch: on, a prefill chunk on matrix units whose single pass would run few threadgroups over
a long context splits the keys into blocks (`attention_prefill_mma_split_*`, grid z = blocks) and merges them with
`attention_decode_combine_*` over its T x Hq rows; off, every chunk runs `attention_prefill_mma_*` in one pass.
`split_prefill_block_keys` lowers the fewest keys per block (512 by default) so that the fixtures' short contexts
split. Both must follow lily.reference turn by turn (a conversation of first, continuing and replayed chunks) in
float32 mode on the demo model, where they also agree with each other to fp32 rounding; in bf16 (the head-dim-256
fixture) the split path may stray from the reference no further than the single pass does.
"""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

from tests.engine.test_metal_backend import relative_error
from tests.engine.test_metal_head_dims import DEMO
from tests.engine.test_metal_head_dims import checkpoints as head_dim_checkpoints  # noqa: F401 (the fixture)

# A first chunk of 40 tokens, then turns of 9 (one full and one partial 8-query tile), 8 (a replayed pass) and 24;
# ids below 640, the head-dim-256 fixture's vocabulary.
TURNS = [np.arange(40) * 37 % 600 + 3, np.arange(9) * 11 + 5, np.full(8, 77), np.arange(24) * 13 % 500 + 1]
SPLIT = {"split_prefill_block_keys": 16}


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(DEMO)


def expected_blocks(heads: int, heads_per_group: int, tokens: int, keys: int) -> int:
    """tuning::attention_prefill_split_blocks at 16 keys per block (LILY_ATTN_PREFILL_SPLIT_GROUPS = 256)."""
    blocks = min(256 // (-(-tokens // 8) * heads // heads_per_group), keys // 16, 64)
    return blocks if blocks >= 2 else 0


def run_turns(backend) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    """Every row's logits of each turn, and the kernels each turn's pass dispatched."""
    state = backend.new_state()
    logits, kernels = [], []
    for turn in TURNS:
        logits.append(backend.forward(turn, state, last_only=False))
        kernels.append(backend.last_step_counts()["dispatches_by_kernel"])
    return logits, kernels


def reference_turns(checkpoint) -> list[np.ndarray]:
    ref = ReferenceModel(checkpoint)
    state = ref.new_state()
    return [ref.forward(turn, state) for turn in TURNS]


def test_split_prefill_attention_follows_the_reference(engine_backend, demo):
    """float32 on the demo model (4 query heads, 2 KV heads: 2 per threadgroup at head dim 64): each path dispatches
    its kernels and follows the reference; the two differ only in the order of fp32 sums."""
    layers = demo.args.layer_types.count("full_attention")
    want = reference_turns(demo)
    runs = {}
    for split in (True, False):
        switches = SPLIT if split else {**SPLIT, "split_prefill_kv": False}
        runs[split], kernels = run_turns(engine_backend(demo, precision="float32", switches=switches))
        position = 0
        for turn, rows, expected, used in zip(TURNS, runs[split], want, kernels):
            position += len(turn)
            assert expected_blocks(4, 2, len(turn), position) >= 2, "every turn splits at 16 keys per block"
            if split:
                assert used.get("attention_prefill_mma_split_f32_d64") == layers, sorted(used)
                assert used.get("attention_decode_combine_f32_d64") == layers, sorted(used)
                assert "attention_prefill_mma_f32_d64" not in used
            else:
                assert used.get("attention_prefill_mma_f32_d64") == layers
                assert "attention_decode_combine_f32_d64" not in used
            rel = float(np.max(np.abs(rows - expected)) / np.max(np.abs(expected)))
            assert rel < 1e-4, f"split={split}, turn of {len(turn)} at {position - len(turn)}: relative error {rel:.3g}"
    for turn, a, b in zip(TURNS, runs[True], runs[False]):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.max(np.abs(b)), err_msg=f"turn of {len(turn)}")


@pytest.mark.metal
def test_split_prefill_attention_in_bf16(head_dim_checkpoints):  # noqa: F811
    """bf16 on the head-dim-256 fixture (8 query heads per KV head: the model's threadgroup of 8 heads). A bf16
    prefill's every-row logits stray far from the float64 reference (this random fixture's routing near-ties: up to
    0.8 relative, measured; the trained demo model 0.05-0.15), so each turn of the split path must stray no further
    than the single pass does (the kernels themselves are checked against the reference in tests/kernels)."""
    from lily.backends.metal import MetalBackend

    checkpoint, attn = head_dim_checkpoints["d256"], "d256"
    want = reference_turns(checkpoint)
    errors = {}
    for split in (True, False):
        switches = SPLIT if split else {**SPLIT, "split_prefill_kv": False}
        got, kernels = run_turns(MetalBackend(checkpoint, precision="bfloat16", switches=switches))
        chosen = f"attention_prefill_mma_split_bf16_{attn}" if split else f"attention_prefill_mma_bf16_{attn}"
        assert all(chosen in used for used in kernels), [sorted(used) for used in kernels]
        errors[split] = [relative_error(g, w) for g, w in zip(got, want)]
    for turn, split_error, single_error in zip(TURNS, errors[True], errors[False]):
        assert split_error <= 1.25 * single_error + 0.02, (len(turn), split_error, single_error)


def test_split_prefill_kv_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_SPLIT_PREFILL_KV": "1"}) == {"split_prefill_kv": False}
