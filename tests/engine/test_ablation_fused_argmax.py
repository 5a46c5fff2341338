"""The FUSED_ARGMAX switch: on, a greedy decode step on staged GEMVs (the CUDA runtime) has no argmax_partial dispatch:
its lm_head (`qmv_norm_argmax_staged_*`) keeps each streaming threadgroup's best logit as it writes the logits, and
argmax_final reduces those partials; off, argmax_partial reads the logits back first. The argmax order is total, so
both choose the same tokens, and the logits are the same bits (one GEMV body). Checked through `decode_tokens` (what
Session.decode runs) on the fake libcuda, against lily.reference's greedy tokens in float32; sampled and penalised
choices keep argmax_partial / the sampler (they read other logits than the lm_head's)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.reference import ReferenceModel
from lily.sampling import SamplingParams

from tests.engine.test_fusion import PROMPT, checkpoints  # noqa: F401 (the fixture)

STEPS = 6


def _greedy(backend, params: SamplingParams) -> tuple[list[int], np.ndarray, dict]:
    state = backend.new_state()
    last = backend.forward(PROMPT, state)[-1]
    tokens = list(backend.decode_tokens(state, last, params, max_tokens=STEPS))
    return tokens, backend.last_logits(state), backend.last_step_counts()["dispatches_by_kernel"]


def _argmax_kernels(kernels) -> set[str]:
    return {name for name in kernels if "argmax" in name}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_fused_argmax_chooses_the_unfused_tokens(checkpoints, cuda_engine_backend, precision):  # noqa: F811
    checkpoint = checkpoints["mlx"]
    dtype = "f32" if precision == "float32" else "bf16_of32"
    runs = {}
    for fused in (True, False):
        backend = cuda_engine_backend(checkpoint, precision=precision, switches={"fused_argmax": fused})
        runs[fused] = _greedy(backend, SamplingParams(temperature=0.0))
        lm_head = {name for name in runs[fused][2] if re.match(r"qmv_norm_(argmax_)?staged_q4", name)}
        assert lm_head <= {f"qmv_norm_{'argmax_' if fused else ''}staged_q4_g64_{dtype}{a16}" for a16 in ("", "_a16")}
        assert lm_head, sorted(runs[fused][2])
        want = {"argmax_final_f32"} | (set() if fused else {"argmax_partial_f32"})
        assert _argmax_kernels(runs[fused][2]) - lm_head == want, sorted(runs[fused][2])
    assert runs[True][0] == runs[False][0]
    assert np.array_equal(runs[True][1].view(np.uint32), runs[False][1].view(np.uint32))
    if precision == "float32":
        ref = ReferenceModel(checkpoint)
        ref_state = ref.new_state()
        want = [int(np.argmax(ref.forward(PROMPT, ref_state)[-1]))]
        for _ in range(STEPS - 1):
            want.append(int(np.argmax(ref.forward(np.array([want[-1]]), ref_state)[-1])))
        assert runs[True][0] == want


def test_sampled_and_penalised_choices_keep_their_kernels(checkpoints, cuda_engine_backend):  # noqa: F811
    backend = cuda_engine_backend(checkpoints["mlx"], precision="bfloat16", switches={"fused_argmax": True})
    _, _, kernels = _greedy(backend, SamplingParams(temperature=0.0, presence_penalty=1.5))
    assert "argmax_partial_f32" in kernels and not [k for k in kernels if "qmv_norm_argmax" in k], sorted(kernels)
    _, _, kernels = _greedy(backend, SamplingParams(temperature=0.7, top_k=20, seed=3))
    assert not _argmax_kernels(kernels) and [k for k in kernels if k.startswith("sample")], sorted(kernels)


def test_fused_argmax_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_FUSED_ARGMAX": "1"}) == {"fused_argmax": False}
