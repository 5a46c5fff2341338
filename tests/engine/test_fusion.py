"""The decode kernel fusions (qmv_norm, qmv_residual, moe_gate_up_swiglu_routed) in the engine: the fused and the
unfused (`fusion` switch, LILY_DISABLE_FUSION) decode chains give the same logits, which match lily.reference, on a
tiny checkpoint with the model's head shapes, float32 mode, through the fake Metal running the real kernels."""

from __future__ import annotations

import numpy as np
import pytest

from lily import plan as lily_plan
from lily._ext import _test_engine as te
from lily.backends import engine
from lily.backends.metal import MetalBackend
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

from tests.engine.test_metal_backend import HEAD_SHAPES_CONFIG, relative_error
from tests.fixtures import build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

PROMPT = np.array([5, 17, 300, 2, 639, 0, 77])
# Prompts run one decode step per token, so every logit row below comes from the decode graph fusion changes.
DECODE_ONLY = {"batched_prefill": False}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fusion")
    # Seed 3 (test_metal_backend's model): in bf16 mode a router near-tie within bf16 rounding can flip an expert
    # and move the logits by tens of percent whichever chain runs; this model has none on PROMPT (measured).
    model = build_hf_model(HEAD_SHAPES_CONFIG, seed=3)
    hf = save_hf_checkpoint(model, root / "hf", dtype="bfloat16")
    hf32 = save_hf_checkpoint(model, root / "hf32", dtype="float32")
    # mlx: bf16 scales; hf32 quantized on load: f32 scales (the "_sf32" variants of the fused kernels).
    return {"mlx": load_checkpoint(save_mlx_checkpoint(hf, root / "mlx")), "hf32": load_checkpoint(hf32, quantize=4)}


@pytest.fixture(autouse=True)
def shuffled_stages():
    if not hasattr(te, "set_stage_order"):  # a real GPU: its own dispatch order
        yield
        return
    te.set_stage_order("shuffle", 5)  # a missing barrier between fused dispatches shows
    yield
    te.set_stage_order("reverse")


def cuda_decode_both_ways(cuda_engine_backend, checkpoint, precision: str, switch: str) -> dict:
    """PROMPT through the CUDA engine (the `cuda_engine_backend` fixture) decode step by decode step, with engine
    switch `switch` on and off: {on: (logits, backend)}, each backend's last step still inspectable."""
    runs = {}
    for on in (True, False):
        backend = cuda_engine_backend(checkpoint, precision=precision, switches={**DECODE_ONLY, switch: on})
        runs[on] = backend.forward(PROMPT, backend.new_state()), backend
    return runs


def decode_logits(checkpoint, switches):
    backend = MetalBackend(checkpoint, precision="float32", switches=switches)
    state = backend.new_state()
    logits = backend.forward(PROMPT, state)
    return logits, backend.last_step_counts()


@pytest.mark.parametrize("layout", ["mlx", "hf32"])
def test_fused_and_unfused_decode_give_the_same_logits(checkpoints, layout):
    checkpoint = checkpoints[layout]
    fused, fused_counts = decode_logits(checkpoint, DECODE_ONLY)
    unfused, unfused_counts = decode_logits(checkpoint, {**DECODE_ONLY, "fusion": False})
    # Same maths, different fp32 summation order (norm scale applied after the dot products, residual in the GEMV).
    assert relative_error(fused, unfused) < 1e-5
    ref = ReferenceModel(checkpoint)
    want = ref.forward(PROMPT, ref.new_state())
    assert relative_error(fused, want) < 1e-3
    assert np.array_equal(np.argmax(fused, axis=-1), np.argmax(want, axis=-1))

    layers = HEAD_SHAPES_CONFIG["num_hidden_layers"]
    fused_kernels, unfused_kernels = fused_counts["dispatches_by_kernel"], unfused_counts["dispatches_by_kernel"]
    # Per layer: the input norm, the post-attention norm (+ residual) and moe_route disappear; plus the final norm.
    assert unfused_counts["dispatches"] - fused_counts["dispatches"] == 3 * layers + 1
    assert fused_counts["stages"] == fused_counts["dispatches"]  # the decode chain stays serial
    assert not any(k.startswith("rms_norm") or k == "moe_route_f32" for k in fused_kernels)
    sf = "_sf32" if layout == "hf32" else ""
    assert fused_kernels[f"moe_gate_up_swiglu_routed_f32{sf}"] == layers
    assert unfused_kernels["moe_route_f32"] == layers


def test_bfloat16_fused_decode_follows_the_reference(checkpoints):
    """bf16 mode, fused and unfused: both within bf16 rounding of the fp32 reference (the fused chain never rounds a
    normalised row to bf16: it only lives in registers); the router logits and the logits stay f32 (the _of32
    GEMVs)."""
    checkpoint = checkpoints["mlx"]
    ref = ReferenceModel(checkpoint)
    want = ref.forward(PROMPT, ref.new_state())
    errors = {}
    for fusion in (True, False):
        backend = MetalBackend(checkpoint, precision="bfloat16", switches={**DECODE_ONLY, "fusion": fusion})
        logits = backend.forward(PROMPT, backend.new_state())
        errors[fusion] = relative_error(logits, want)
        assert np.mean(logits.argmax(-1) == want.argmax(-1)) >= 6 / 7
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        of32 = "qmv_norm_seg_q8_g64_bf16_of32" if fusion else "qmv_seg_q8_g64_bf16_of32"  # router | shared gate
        lm_head = "qmv_norm_q4_g64_bf16_of32" if fusion else "qmv_q4_g64_bf16_of32"
        assert {name for name in kernels if name.endswith("_of32")} == {of32, lm_head}
    assert errors[True] < 5e-2 and errors[False] < 5e-2, errors  # measured 1.6e-2 fused, 2.1e-2 unfused


def test_fused_decode_continues_a_batched_prefill(checkpoints):
    """Prefill (T-row kernels, never fused) then fused decode steps: greedy tokens as the reference's."""
    checkpoint = checkpoints["mlx"]
    backend = MetalBackend(checkpoint, precision="float32")
    ref = ReferenceModel(checkpoint)
    ref_state = ref.new_state()
    want = [int(np.argmax(ref.forward(PROMPT, ref_state)[-1]))]
    for _ in range(5):
        want.append(int(np.argmax(ref.forward(np.array([want[-1]]), ref_state)[-1])))
    state = backend.new_state()
    first = int(np.argmax(backend.forward(PROMPT, state)[-1]))
    assert [first] + backend.generate_greedy(state, first, 5) == want
    assert "moe_gate_up_swiglu_routed_f32" in backend.last_step_counts()["dispatches_by_kernel"]


def test_disable_fusion_environment_variable():
    """LILY_DISABLE_FUSION=1 turns the switch off (MetalBackend and `lily plan` read the environment this way)."""
    args = lily_plan.full_size_args()
    switches = engine.switches_from_env({"LILY_DISABLE_FUSION": "1"})
    assert switches == {"fusion": False}
    fused = lily_plan.plan_decode(args, context=64)["dispatches"]
    dispatches = lily_plan.plan_decode(args, context=64, switches=switches)["dispatches"]
    assert dispatches == fused + 3 * args.num_hidden_layers + 1
