"""The REGISTER_SCAN switch: off, the DeltaNet prefill runs `gated_delta_prefill_blockwise_*` (the state round-trips
through memory every 16 tokens) instead of the register-resident scan. Same arithmetic, so the engine's logits must
be the same bits in both modes, at Dk = 64 (the embedded demo model) and at the model's Dk = dv = 128; and they
follow lily.reference. The graph's byte count grows by exactly the extra state round trips (what the ablation
measures on a Mac).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import SWITCHES, switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.fixtures import _KV64, build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

DEMO = Path(__file__).resolve().parents[2] / "python" / "lily" / "demo"
# The model's DeltaNet head shapes (dk = dv = 128, Hv/Hk = 2) at a tiny width.
DK128_CONFIG = copy.deepcopy(_KV64)
DK128_CONFIG.update(
    vocab_size=640, hidden_size=128, head_dim=256, num_attention_heads=4, num_key_value_heads=1,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
)
SCAN_BLOCK = 16  # LILY_GDN_SCAN_BLOCK (metal/lily.h)
# 37 prompt tokens: two full blocks and a partial third in one chunk; chunks of 20 restart the blocks mid-prompt.
PROMPT_LENGTH = 37
DECODE = [3, 101]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("scan")
    hf = save_hf_checkpoint(build_hf_model(DK128_CONFIG, seed=9), root / "dk128", dtype="bfloat16")
    return {"demo": load_checkpoint(DEMO), "dk128": load_checkpoint(save_mlx_checkpoint(hf, root / "dk128-mlx"))}


def prompt(checkpoint) -> np.ndarray:
    return np.random.default_rng(21).integers(0, checkpoint.args.vocab_size, PROMPT_LENGTH)


def run(checkpoint, precision: str, switches: dict) -> tuple[np.ndarray, dict]:
    """Logits of the prompt and of DECODE after it, and the counts of the prompt's (last chunk's) graph."""
    backend = MetalBackend(checkpoint, precision=precision, switches=switches)
    state = backend.new_state()
    rows = [backend.forward(prompt(checkpoint), state)]
    counts = backend.last_step_counts()
    rows += [backend.forward(np.array([token]), state) for token in DECODE]
    return np.concatenate(rows), counts


CASES = [("demo", "float32", {}), ("demo", "bfloat16", {"prefill_chunk": 20}), ("dk128", "float32", {}),
         ("dk128", "float32", {"prefill_chunk": 20}), ("dk128", "bfloat16", {})]


@pytest.mark.parametrize("name,precision,options", CASES,
                         ids=[f"{n}-{p}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'one_chunk'}"
                              for n, p, o in CASES])
def test_blockwise_scan_gives_the_register_scans_bits(checkpoints, name, precision, options):
    checkpoint = checkpoints[name]
    registers, register_counts = run(checkpoint, precision, options)
    blockwise, blockwise_counts = run(checkpoint, precision, {**options, "register_scan": False})
    np.testing.assert_array_equal(blockwise, registers)
    suffix = ("f32" if precision == "float32" else "bf16") + f"_dk{checkpoint.args.linear_key_head_dim}"
    deltanet_layers = checkpoint.args.layer_types.count("linear_attention")
    kernels = blockwise_counts["dispatches_by_kernel"]
    assert kernels.get(f"gated_delta_prefill_blockwise_{suffix}") == deltanet_layers, sorted(kernels)
    assert f"gated_delta_prefill_{suffix}" not in kernels
    assert register_counts["dispatches_by_kernel"].get(f"gated_delta_prefill_{suffix}") == deltanet_layers
    # The graph's bytes grow by exactly one state read and write per extra block of the (last) chunk.
    chunk = PROMPT_LENGTH
    if "prefill_chunk" in options:
        chunk -= (PROMPT_LENGTH - 1) // options["prefill_chunk"] * options["prefill_chunk"]
    a = checkpoint.args
    state_bytes = 4 * a.linear_num_value_heads * a.linear_value_head_dim * a.linear_key_head_dim
    extra = (-(-chunk // SCAN_BLOCK) - 1) * state_bytes * deltanet_layers
    assert blockwise_counts["bytes_read"] - register_counts["bytes_read"] == extra
    assert blockwise_counts["bytes_written"] - register_counts["bytes_written"] == extra
    assert blockwise_counts["dispatches"] == register_counts["dispatches"]
    if precision == "float32":  # and both follow the independent reference
        ref = ReferenceModel(checkpoint)
        state = ref.new_state()
        want = np.concatenate([ref.forward(prompt(checkpoint), state)]
                              + [ref.forward(np.array([token]), state) for token in DECODE])
        rel = float(np.max(np.abs(blockwise - want)) / np.max(np.abs(want)))
        assert rel < 1e-4, f"{name}: relative error {rel:.3g} against the reference"


def test_register_scan_switch_is_read_from_the_environment():
    assert "register_scan" in SWITCHES
    assert switches_from_env({"LILY_DISABLE_REGISTER_SCAN": "1"}) == {"register_scan": False}
    assert switches_from_env({"LILY_DISABLE_REGISTER_SCAN": "0"}) == {}
