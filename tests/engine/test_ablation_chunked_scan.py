"""The CHUNKED_SCAN switch: on (the default), a prefill chunk of at least 64 tokens (tuning::kGdnChunkedMinTokens)
runs the chunked DeltaNet scan (`gated_delta_chunk_prepare_*` then `gated_delta_chunk_scan_*`) instead of the
token-by-token `gated_delta_prefill_*`; off, every chunk runs the token scan. The arithmetic is ordered differently,
so the logits agree within fp32 rounding (float32 mode) or loosely (bfloat16), at Dk = 64 (the embedded demo model)
and at the model's Dk = dv = 128; both follow lily.reference; the graph counts show which scan ran.
"""

from __future__ import annotations

import numpy as np
import pytest

from lily import _ext
from lily.backends import engine_config
from lily.backends.engine import SWITCHES, engine_switches, switches_from_env
from lily.backends.metal import MetalBackend
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

from tests.engine.test_ablation_scan import DEMO, DK128_CONFIG
from tests.fixtures import build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

CHUNK, MIN_TOKENS = 32, 64  # LILY_GDN_CHUNK, tuning::kGdnChunkedMinTokens
# Two full 32-token chunks and a partial third in one prefill chunk; split as 70 + 5 tokens, the first prefill chunk
# takes the chunked scan and the second (below the minimum) the token scan, continuing its state.
PROMPT_LENGTH = 2 * CHUNK + 11
SPLIT = 70
DECODE = [3, 101]
# Largest |logit difference| over the largest |logit|, chunked against token scan, measured on the harness: float32
# 7.5e-7 (demo) and 2.5e-6 (dk128); bfloat16 3.0e-2 (demo) and 3.8e-3 (dk128), where bf16 activations round the
# scans' fp32-level differences apart layer after layer (the demo's bf16 logits are 5.4e-2 from the float32 reference
# with either scan).
FLOAT32_TOLERANCE, BFLOAT16_TOLERANCE = 1e-5, 1e-1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The demo model (Dk = 64) and a tiny model with the model's DeltaNet heads (Dk = dv = 128, Hv/Hk = 2)."""
    root = tmp_path_factory.mktemp("chunked")
    hf = save_hf_checkpoint(build_hf_model(DK128_CONFIG, seed=9), root / "dk128", dtype="bfloat16")
    return {"demo": load_checkpoint(DEMO), "dk128": load_checkpoint(save_mlx_checkpoint(hf, root / "dk128-mlx"))}


def prompt(checkpoint) -> np.ndarray:
    return np.random.default_rng(23).integers(0, checkpoint.args.vocab_size, PROMPT_LENGTH)


def run(checkpoint, precision: str, switches: dict, split: bool) -> tuple[np.ndarray, list[dict]]:
    """Logits of the prompt (in one forward, or SPLIT + the rest) and of DECODE after it, and the graph counts of
    each prompt forward."""
    backend = MetalBackend(checkpoint, precision=precision, switches=switches)
    state = backend.new_state()
    ids = prompt(checkpoint)
    rows, counts = [], []
    for part in ((ids[:SPLIT], ids[SPLIT:]) if split else (ids,)):
        rows.append(backend.forward(part, state))
        counts.append(backend.last_step_counts()["dispatches_by_kernel"])
    rows += [backend.forward(np.array([token]), state) for token in DECODE]
    return np.concatenate(rows), counts


def scans(kernels: dict, suffix: str) -> dict[str, int]:
    names = {"token": f"gated_delta_prefill_{suffix}", "prepare": f"gated_delta_chunk_prepare_{suffix}",
             "chunked": f"gated_delta_chunk_scan_{suffix}"}
    return {what: kernels.get(name, 0) for what, name in names.items()}


CASES = [("demo", "float32", False), ("demo", "bfloat16", False), ("dk128", "float32", False),
         ("dk128", "float32", True), ("dk128", "bfloat16", True)]


@pytest.mark.parametrize("name,precision,split", CASES,
                         ids=[f"{n}-{p}-{'split' if s else 'one_chunk'}" for n, p, s in CASES])
def test_chunked_scan_agrees_with_the_token_scan(checkpoints, name, precision, split):
    checkpoint = checkpoints[name]
    chunked, chunked_counts = run(checkpoint, precision, {}, split)
    token, token_counts = run(checkpoint, precision, {"chunked_scan": False}, split)
    suffix = ("f32" if precision == "float32" else "bf16") + f"_dk{checkpoint.args.linear_key_head_dim}"
    layers = checkpoint.args.layer_types.count("linear_attention")
    # The user's path takes the chunked scan for the long chunk (the first, when split) and the token scan below the
    # minimum; off, every chunk takes the token scan.
    assert scans(chunked_counts[0], suffix) == {"token": 0, "prepare": layers, "chunked": layers}, chunked_counts[0]
    if split:
        assert scans(chunked_counts[1], suffix) == {"token": layers, "prepare": 0, "chunked": 0}, chunked_counts[1]
    assert all(scans(c, suffix) == {"token": layers, "prepare": 0, "chunked": 0} for c in token_counts), token_counts
    scale = float(np.max(np.abs(token)))
    rel = float(np.max(np.abs(chunked - token))) / scale
    assert rel <= (FLOAT32_TOLERANCE if precision == "float32" else BFLOAT16_TOLERANCE), rel
    if precision == "float32":  # and both follow the independent reference
        ref = ReferenceModel(checkpoint)
        state = ref.new_state()
        want = np.concatenate([ref.forward(prompt(checkpoint), state)]
                              + [ref.forward(np.array([token]), state) for token in DECODE])
        assert float(np.max(np.abs(chunked - want))) / float(np.max(np.abs(want))) < 1e-4


def test_chunked_scan_switch_is_read_from_the_environment():
    assert "chunked_scan" in SWITCHES
    assert switches_from_env({"LILY_DISABLE_CHUNKED_SCAN": "1"}) == {"chunked_scan": False}
    assert switches_from_env({"LILY_DISABLE_CHUNKED_SCAN": "0"}) == {}


def test_a_shape_the_chunked_scan_does_not_fit_keeps_the_token_scan_and_says_so():
    """dv not a multiple of 8 (the chunked scan's 8-row state blocks): long chunks keep the token scan, and `lily plan`
    names the fast path left out; the demo's own shape fits."""
    args = load_checkpoint(DEMO).args
    demo = engine_config(args)
    assert _ext.fast_paths_left_out(demo) == []
    odd = engine_config(args)
    odd.linear_value_head_dim = 20
    lines = _ext.fast_paths_left_out(odd)
    assert len(lines) == 1 and "chunked DeltaNet scan" in lines[0] and "linear_value_head_dim = 20" in lines[0], lines
    on = engine_switches({})
    kernels = set(_ext.graph_kernels(odd, "float32", on, 4, False, [2 * MIN_TOKENS]))
    assert "gated_delta_prefill_f32_dk64" in kernels and not any("_chunk_" in k for k in kernels), sorted(kernels)
    assert "gated_delta_chunk_scan_f32_dk64" in set(_ext.graph_kernels(demo, "float32", on, 4, False, [MIN_TOKENS]))
    assert not any("_chunk_" in k for k in _ext.graph_kernels(demo, "float32", on, 4, False, [MIN_TOKENS - 1]))
