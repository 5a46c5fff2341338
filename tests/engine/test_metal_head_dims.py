"""The `metal` backend at the head dims other than the model's and with the GQA-packing ablation, against
lily.reference (float32 mode, the Linux test runtime running the real kernels on the CPU harness).

Head dim 64 / DeltaNet dk = dv = 64 (the `*_d64` / `*_dk64` kernels): the embedded demo model (4 query / 2 KV heads:
a GQA group of 2, so its threadgroups pack 2 heads) and the tiny fixtures kv64 (GQA 2) and gqa4 (GQA 4, Hv/Hk = 3).
The GQA_PACKING switch off runs the `attention_decode*_unpacked_*` kernels (one query head per threadgroup) at head
dim 64 and at the model's 256. Head ratios the packing cannot split (3 and 1 at head dim 64, 3 at 256) run the
unpacked prefill and decode kernels, and `lily plan` and the debug log name the fast path left out. Head dims without
kernels are refused naming the config field, the value and the supported values.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.plan import PLAN_TARGETS, format_plan, full_size_args, plan_decode
from lily.reference import ReferenceModel

from tests.fixtures import _KV64, build_hf_model, save_hf_checkpoint, save_mlx_checkpoint

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

DEMO = Path(__file__).resolve().parents[2] / "python" / "lily" / "demo"
# The model's head shapes (head dim 256, dk = dv = 128) at a tiny width, and its GQA 8 (one prefill mma threadgroup per
# KV head and 8 queries; two decode threadgroups of 4 heads).
D256_CONFIG = copy.deepcopy(_KV64)
D256_CONFIG.update(
    vocab_size=640, hidden_size=128, head_dim=256, num_attention_heads=8, num_key_value_heads=1,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64,
)
# Head ratios the packed kernels (2 heads per threadgroup at head dim 64; 4, and 8 for prefill mma, at 256) cannot
# split: the engine falls back to the *_unpacked_* kernels for prefill and decode, and names the fast path it left out.
RATIO3_CONFIG = {**_KV64, "num_attention_heads": 6, "num_key_value_heads": 2}
RATIO1_CONFIG = {**_KV64, "num_attention_heads": 2, "num_key_value_heads": 2}
D256_RATIO3_CONFIG = {**D256_CONFIG, "num_attention_heads": 3, "num_key_value_heads": 1}
FALLBACK = ("ratio3", "ratio1", "d256-ratio3")
# 9 tokens: the prefill takes the matrix-unit attention kernel (>= 8 queries); then 3 decode steps.
PROMPT = np.array([5, 17, 300, 2, 639, 0, 77, 123, 64])
DECODE = [7, 450, 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_dims")
    out = {"demo": load_checkpoint(DEMO)}
    for name, config in (("kv64", "kv64"), ("gqa4", "gqa4"), ("d256", D256_CONFIG), ("ratio3", RATIO3_CONFIG),
                         ("ratio1", RATIO1_CONFIG), ("d256-ratio3", D256_RATIO3_CONFIG)):
        hf = save_hf_checkpoint(build_hf_model(config, seed=5), root / name, dtype="bfloat16")
        out[name] = load_checkpoint(save_mlx_checkpoint(hf, root / f"{name}-mlx"))
    return out


def reference_logits(checkpoint) -> np.ndarray:
    """Reference logits of the prompt and of each decode token after it: [len(PROMPT) + len(DECODE), V]."""
    ref = ReferenceModel(checkpoint)
    state = ref.new_state()
    rows = [ref.forward(PROMPT, state)]
    rows += [ref.forward(np.array([token]), state) for token in DECODE]
    return np.concatenate(rows)


def run_backend(backend: MetalBackend) -> tuple[np.ndarray, dict[str, int]]:
    """The backend's logits for the same tokens, and the kernels of its last decode step."""
    state = backend.new_state()
    rows = [backend.forward(PROMPT, state)]
    rows += [backend.forward(np.array([token]), state) for token in DECODE]
    return np.concatenate(rows), backend.last_step_counts()["dispatches_by_kernel"]


CASES = [
    # (checkpoint, switches, head dim suffix, DeltaNet suffix)
    ("demo", {}, "d64", "dk64"),
    ("demo", {"gqa_packing": False}, "d64", "dk64"),
    ("kv64", {"split_kv_min_keys": 1}, "d64", "dk64"),  # the split-KV decode path at head dim 64
    ("gqa4", {}, "d64", "dk64"),
    ("gqa4", {"gqa_packing": False, "split_kv_min_keys": 1}, "d64", "dk64"),
    ("d256", {"gqa_packing": False}, "d256", "dk128"),
    ("d256", {"gqa_packing": False, "split_kv_min_keys": 1}, "d256", "dk128"),
    ("ratio3", {}, "d64", "dk64"),
    ("ratio3", {"split_kv_min_keys": 1}, "d64", "dk64"),
    ("ratio1", {}, "d64", "dk64"),
    ("d256-ratio3", {}, "d256", "dk128"),
]


@pytest.mark.parametrize("name,switches,attn,gdn", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'default'}" for c in CASES])
def test_logits_match_the_reference(engine_backend, checkpoints, name, switches, attn, gdn):
    """On both runtimes (the gqa4 file also has tensors MLX left at odd offsets, which the engine realigns)."""
    checkpoint = checkpoints[name]
    want = reference_logits(checkpoint)
    got, kernels = run_backend(engine_backend(checkpoint, precision="float32", switches=switches))
    rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    assert rel < 1e-4, f"{name} {switches}: relative error {rel:.3g}"
    # The decode step ran the instances of this head dim, packed or not as the switch says.
    unpacked = "unpacked_" if switches.get("gqa_packing") is False or name in FALLBACK else ""
    split = "partial_" if "split_kv_min_keys" in switches else ""
    attention_layers = checkpoint.args.layer_types.count("full_attention")
    assert kernels.get(f"attention_decode_{split}{unpacked}f32_{attn}") == attention_layers, sorted(kernels)
    assert kernels.get(f"attention_prep_f32_{attn}") == attention_layers
    # The DeltaNet step: fused, or spread over the prefill scan's threadgroups between the GEMVs that take its conv and
    # gated norm (the CUDA runtime: tuning::spread_deltanet_step).
    spread = any(k.startswith("qmv_gated_norm_residual_staged_q4_g64_f32") for k in kernels)  # or its _a16 instance
    step = "gated_delta_prefill" if spread else "gated_delta_step"
    assert kernels.get(f"{step}_f32_{gdn}") == len(checkpoint.args.layer_types) - attention_layers
    if unpacked:
        packed = [k for k in kernels if k.startswith("attention_decode_") and "unpacked" not in k
                  and "combine" not in k]
        assert not packed, f"packed decode kernels with GQA_PACKING off: {packed}"


def test_packing_switch_changes_only_the_schedule(checkpoints):
    """Packed and unpacked decode attention agree within fp32 rounding (gqa4 fixture: GQA 4, 2 heads per group)."""
    packed, _ = run_backend(MetalBackend(checkpoints["gqa4"], precision="float32"))
    unpacked, _ = run_backend(MetalBackend(checkpoints["gqa4"], precision="float32",
                                           switches={"gqa_packing": False}))
    np.testing.assert_allclose(unpacked, packed, rtol=0, atol=1e-5 * np.max(np.abs(packed)))


@pytest.mark.parametrize("field,value", [("head_dim", 32), ("head_dim", 128), ("linear_key_head_dim", 32),
                                         ("linear_conv_kernel_dim", 3)])
def test_head_dims_without_kernels_are_refused(tmp_path, field, value):
    config = {**_KV64, field: value}
    hf = save_hf_checkpoint(build_hf_model(config, randomize=False), tmp_path / "model", dtype="bfloat16")
    with pytest.raises(ValueError, match=f"{field}: .*built for .*got {value}"):
        MetalBackend(load_checkpoint(hf, quantize=4), precision="float32")


@pytest.mark.parametrize("fields,message", [
    ({"linear_num_key_heads": 1, "linear_num_value_heads": 16, "linear_value_head_dim": 16},
     "linear_num_value_heads: the DeltaNet kernels are built for at most 8 value heads per key head; got 16 / 1"),
    ({"linear_num_key_heads": 1, "linear_num_value_heads": 8, "linear_value_head_dim": 64},
     r"linear_value_head_dim: \(Hv/Hk\) x dv must be at most 256; got \(8/1\) x 64"),
])
def test_deltanet_groups_without_kernels_are_refused(tmp_path, fields, message):
    hf = save_hf_checkpoint(build_hf_model({**_KV64, **fields}, randomize=False), tmp_path / "model", dtype="bfloat16")
    checkpoint = load_checkpoint(hf, quantize=4)
    ReferenceModel(checkpoint).forward(PROMPT[:2], ReferenceModel(checkpoint).new_state())  # the reference runs it
    with pytest.raises(ValueError, match=message):
        MetalBackend(checkpoint, precision="float32")


@pytest.mark.parametrize("name", FALLBACK)
def test_head_ratios_the_packing_cannot_split_run_greedy_as_the_reference(checkpoints, name):
    """Greedy tokens identical to the reference's over a prompt and 6 steps (float32 mode, the general kernels)."""
    checkpoint = checkpoints[name]
    ref = ReferenceModel(checkpoint)
    state = ref.new_state()
    logits = ref.forward(PROMPT, state)[-1]
    want = []
    for _ in range(6):
        want.append(int(np.argmax(logits)))
        logits = ref.forward(np.array([want[-1]]), state)[-1]
    backend = MetalBackend(checkpoint, precision="float32")
    metal_state = backend.new_state()
    first = int(np.argmax(backend.forward(PROMPT, metal_state)[-1]))
    assert [first, *backend.generate_greedy(metal_state, first, 5)] == want


def test_fast_paths_left_out_are_named_in_the_plan_and_the_debug_log(checkpoints, caplog):
    ratio3 = checkpoints["ratio3"]
    plan = plan_decode(ratio3.args, context=16, precision="float32")
    assert len(plan["fast_paths_left_out"]) == 1
    line = plan["fast_paths_left_out"][0]
    assert "GQA packing" in line and "6 / 2" in line and "multiple of 2" in line and "unpacked" in line, line
    assert f"fast path left out: {line}" in format_plan(plan, PLAN_TARGETS)
    # The plan counts the kernels the engine runs: unpacked decode attention, one threadgroup per query head.
    attention_layers = ratio3.args.layer_types.count("full_attention")
    assert plan["dispatches_by_kernel"].get("attention_decode_unpacked_f32_d64") == attention_layers
    with caplog.at_level(logging.DEBUG, logger="lily.backends.engine"):
        MetalBackend(ratio3, precision="float32")
    assert any(line in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # Shapes every fast path fits (the demo model, the packed fixtures, the full-size model) list nothing.
    for args in (checkpoints["demo"].args, checkpoints["gqa4"].args, checkpoints["d256"].args, full_size_args()):
        assert plan_decode(args, context=16)["fast_paths_left_out"] == []
    # Head ratio 4 at head dim 256: prefill's mma kernel (8) runs unpacked, decode the vector kernels (4 heads per
    # threadgroup) instead of the mma ones, and the plan says so.
    ratio4 = dataclasses.replace(full_size_args(), num_key_value_heads=4)
    plan = plan_decode(ratio4, context=16)
    [line] = plan["fast_paths_left_out"]
    assert "prefill attention" in line and "16 / 4" in line and "multiple of 8" in line and "unpacked" in line, line
    assert "decode" in line and "attention_decode[_partial]_*, 4 heads" in line, line
    assert plan["dispatches_by_kernel"].get("attention_decode_bf16_d256") == 10, sorted(plan["dispatches_by_kernel"])


def test_packing_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_GQA_PACKING": "1"}) == {"gqa_packing": False}
    assert switches_from_env({"LILY_DISABLE_GQA_PACKING": "0"}) == {}
