"""The MMA_ATTENTION switch: off, prefill chunks of 8+ tokens run attention on the vector kernel
(`attention_prefill_*`, 8 queries per threadgroup) instead of the simdgroup-matrix kernel (`attention_prefill_mma_*`),
and decode in bf16 mode runs on the vector kernels (`attention_decode[_partial]_*`, after `attention_prep_*`) instead
of `attention_decode_mma_*` (after `attention_prep_*`) or, split, `attention_decode_partial_prep_mma_*` (the prep fused
in: FUSED_ATTENTION_PREP). The engine also turns it off
by itself when the device's simdgroup_matrix lane layout differs from the one the mma kernels assume (the
`simdgroup_layout_probe` kernel, run once per engine). Both
paths must give the reference's logits (prefill: float32 mode, demo model; decode: bf16 mode, the demo model and the
head-dim-256 GQA-8 fixture; the Linux test runtime running the real kernels on the CPU harness).
"""

from __future__ import annotations

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.engine.test_metal_backend import relative_error
from tests.engine.test_metal_head_dims import DEMO, PROMPT as HEAD_DIMS_PROMPT, reference_logits, run_backend
from tests.engine.test_metal_head_dims import checkpoints as head_dim_checkpoints  # noqa: F401 (the fixture)

PROMPTS = [np.arange(3, 3 + n) * 37 % 1000 for n in (9, 20)]  # one partial and several 8-query tiles


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(DEMO)


@pytest.mark.metal
@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"T{len(p)}" for p in PROMPTS])
def test_vector_prefill_attention_gives_the_same_logits(demo, prompt):
    want = ReferenceModel(demo).forward(prompt, ReferenceModel(demo).new_state())
    runs = {}
    for mma in (True, False):
        backend = MetalBackend(demo, precision="float32", switches={"mma_attention": mma})
        logits = backend.forward(prompt, backend.new_state())
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        runs[mma] = logits
        rel = float(np.max(np.abs(logits - want)) / np.max(np.abs(want)))
        assert rel < 1e-4, f"mma_attention={mma}: relative error {rel:.3g} against the reference"
        layers = demo.args.layer_types.count("full_attention")
        chosen, other = ("attention_prefill_mma_f32_d64", "attention_prefill_f32_d64")[:: 1 if mma else -1]
        assert kernels.get(chosen) == layers and other not in kernels, sorted(kernels)
    np.testing.assert_allclose(runs[False], runs[True], rtol=0, atol=1e-5 * np.max(np.abs(runs[True])))


@pytest.mark.metal
@pytest.mark.parametrize("split", [False, True], ids=["single-pass", "split-kv"])
@pytest.mark.parametrize("name,attn", [("demo", "d64"), ("d256", "d256")])
def test_decode_attention_on_matrix_units_gives_the_same_logits(head_dim_checkpoints, name, attn, split):  # noqa: F811
    """Decode in bf16 mode, single pass or every step split over key blocks (split_kv_min_keys = 1): attention on
    matrix units (the whole GQA group of a KV head per threadgroup: 2 heads at head dim 64, 8 at 256) and on the
    vector kernels."""
    checkpoint = head_dim_checkpoints[name]
    decode_rows = slice(len(HEAD_DIMS_PROMPT), None)  # the logits of the decode steps after the prompt
    want = reference_logits(checkpoint)[decode_rows]
    layers = checkpoint.args.layer_types.count("full_attention")
    runs = {}
    for mma in (True, False):
        switches = {"mma_attention": mma, **({"split_kv_min_keys": 1} if split else {})}
        logits, kernels = run_backend(MetalBackend(checkpoint, precision="bfloat16", switches=switches))
        runs[mma] = logits[decode_rows]
        kind = "partial_" if split else ""
        # Split on matrix units, the prep runs inside the partial kernel (FUSED_ATTENTION_PREP, on by default).
        on_mma = f"attention_decode_partial_prep_mma_bf16_{attn}" if split else f"attention_decode_mma_bf16_{attn}"
        chosen, other = (on_mma, f"attention_decode_{kind}bf16_{attn}")[
            :: 1 if mma else -1]
        assert kernels.get(chosen) == layers and other not in kernels, sorted(kernels)
        # bf16 rounding of the hidden stream, as test_fusion's bf16 bound (the demo's decode rows: 2-4e-2).
        assert relative_error(runs[mma], want) < 5e-2, f"mma_attention={mma}"
    # The two differ by P rounded to bf16 for P·V and the order of fp32 sums (the demo: 4e-3).
    assert relative_error(runs[True], runs[False]) < 2e-2
    assert np.mean(runs[True].argmax(-1) == runs[False].argmax(-1)) >= 0.9


def test_mma_attention_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_MMA_ATTENTION": "1"}) == {"mma_attention": False}
