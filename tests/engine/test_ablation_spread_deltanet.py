"""The SPREAD_DELTANET_STEP switch: on the CUDA runtime (staged GEMVs) a decode token's DeltaNet runs its conv in the
in_proj GEMV, its recurrence on the prefill scan's (value head, row slice) threadgroups and its gated norm in the
out_proj GEMV (tuning::spread_deltanet_step); off, one gated_delta_step per layer (a threadgroup per key head). The
same arithmetic in the same order: every prompt token a decode step (the conv and recurrent states carried from step
to step), the logits must be the same bits, and follow lily.reference (the fake libcuda running the real kernels on
the harness)."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.reference import ReferenceModel

from tests.engine.test_fusion import DECODE_ONLY, PROMPT, checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)
from tests.engine.test_metal_backend import relative_error

SPREAD = {"qmv_norm_seg_conv_staged", "gated_delta_prefill", "qmv_gated_norm_residual_staged"}


def _deltanet_ops(kernels) -> set[str]:
    names = {name.split("_q4")[0] for name in kernels if "conv_staged" in name or "gated_norm" in name}
    return names | {name.rsplit("_", 2)[0] for name in kernels if name.startswith("gated_delta_")}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_spread_and_fused_deltanet_steps_give_the_same_bits(
        checkpoints, cuda_engine_backend, precision):  # noqa: F811 (the fixture)
    checkpoint = checkpoints["mlx"]
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoint, precision, "spread_deltanet_step")
    for spread, (_, backend) in runs.items():
        ops = _deltanet_ops(backend.last_step_counts()["dispatches_by_kernel"])
        assert ops == (SPREAD if spread else {"gated_delta_step"}), sorted(ops)
    assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32))
    ref = ReferenceModel(checkpoint)
    want = ref.forward(PROMPT, ref.new_state())
    assert relative_error(runs[True][0], want) < (1e-3 if precision == "float32" else 5e-2)


def test_spread_deltanet_step_needs_staged_gemvs(checkpoints, cuda_engine_backend):  # noqa: F811
    backend = cuda_engine_backend(checkpoints["mlx"], precision="float32",
                                  switches={**DECODE_ONLY, "staged_gemv": False})
    backend.forward(PROMPT, backend.new_state())
    assert _deltanet_ops(backend.last_step_counts()["dispatches_by_kernel"]) == {"gated_delta_step"}


def test_spread_deltanet_step_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_SPREAD_DELTANET_STEP": "1"}) == {"spread_deltanet_step": False}
