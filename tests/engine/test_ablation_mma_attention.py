"""The MMA_ATTENTION switch: off, prefill chunks of 8+ tokens run attention on the vector kernel
(`attention_prefill_*`, 8 queries per threadgroup) instead of the simdgroup-matrix kernel (`attention_prefill_mma_*`).
The engine also turns it off by itself when the device's simdgroup_matrix lane layout differs from the one the mma
kernel assumes (the `simdgroup_layout_probe` kernel, run once per engine). Both paths must give the reference's logits
(float32 mode, demo model, the Linux test runtime running the real kernels on the CPU harness).
"""

from __future__ import annotations

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.engine.test_metal_head_dims import DEMO

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


def test_mma_attention_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_MMA_ATTENTION": "1"}) == {"mma_attention": False}
