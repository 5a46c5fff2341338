"""The SPLIT_STEPS switch: on the CUDA runtime (staged GEMVs) a decode step's staged GEMVs whose K spans more than
one step (2,048 codes at 4 bits, 1,024 at 8: the attention o_proj, the DeltaNet out_proj and, in bf16 mode, the 8-bit
router | shared gate) run threadgroups of (128, 2) threads, row y of simdgroups taking steps y, y + 2, ... of the same
output rows and slot 0 adding the slots' sums (tuning::qmv_step_slots); off, (128, 1): one simdgroup takes a row's
steps in turn. The sums are added in another fp32 order, so the logits agree to rounding, not bit for bit, and the
float32 greedy tokens are the same. The model is the fusion tests' with the full model's o_proj and out_proj K = 4096
(16 heads of 256, 32 value heads of 128: two steps) and a hidden size of 1,088 (the 8-bit router's two steps, the
second partial); the fake libcuda runs the real kernels on the harness, with the graph's early-start rule on both."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.checkpoint import load_checkpoint
from lily.sampling import SamplingParams

from tests.engine.test_early_start import check_graph
from tests.engine.test_fusion import PROMPT
from tests.engine.test_metal_backend import HEAD_SHAPES_CONFIG, relative_error
from tests.fixtures import build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

CONFIG = copy.deepcopy(HEAD_SHAPES_CONFIG)
# Two layers (a DeltaNet layer, then attention) hold every split GEMV: the engine runs these shapes slowly here.
CONFIG.update(num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
              hidden_size=1088, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
SPLIT = ("qmv_residual_staged", "qmv_gated_norm_residual_staged", "qmv_norm_seg_staged_q8")
STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("split_steps")
    hf = save_hf_checkpoint(build_hf_model(CONFIG, seed=3), root / "hf", dtype="bfloat16")
    return load_checkpoint(save_mlx_checkpoint(hf, root / "mlx"))  # bf16 scales: the staged GEMVs


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_split_steps_run_two_step_slots_and_agree_to_rounding(checkpoint, cuda_engine_backend, precision):
    runs = {}
    for on in (True, False):
        backend = cuda_engine_backend(checkpoint, precision=precision, switches={"split_steps": on})
        state = backend.new_state()
        last = backend.forward(PROMPT, state)[-1]
        tokens = list(backend.decode_tokens(state, last, SamplingParams(temperature=0.0), max_tokens=STEPS))
        runs[on] = tokens, backend.last_logits(state)
        nodes = [n for n in check_graph(backend.last_step_graph()) if n["kernel"].startswith(SPLIT)]
        # The staged 8-bit router runs in bf16 mode only (its f32 logits out of bf16 activations).
        expected = SPLIT if precision == "bfloat16" else SPLIT[:2]
        assert {p for p in SPLIT for n in nodes if n["kernel"].startswith(p)} == set(expected), nodes
        assert all(n["threads"] == (128, 2 if on else 1, 1) for n in nodes), nodes[0]["threads"]
    # fp32: the fusion tests' bound for another summation order (measured 2.0e-6); bf16: a few roundings of the hidden
    # stream flipped by one unit, MMA_GEMV's bound (measured 4.0e-3).
    assert relative_error(runs[True][1], runs[False][1]) < (1e-5 if precision == "float32" else 2e-2)
    if precision == "float32":
        assert runs[True][0] == runs[False][0]


def test_split_steps_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_SPLIT_STEPS": "1"}) == {"split_steps": False}
