"""The STAGED_GEMV switch: on the CUDA runtime the one-row decode GEMVs (qmv_norm, qmv_residual, qmv_norm_seg) stage
x in threadgroup memory (the `*_staged_*` kernels: tuning::staged_gemv), and so do the decode experts (the routed
gate/up stages the normed x, down + combine the experts' hidden scratch: tuning::staged_moe); off, or on the Metal
runtime, they read them from device memory per simdgroup. Both must give the same logits, which follow lily.reference (the mlx checkpoint of
the fusion tests: bf16 scales, the model's head shapes; the fake libcuda running the real kernels on the harness)."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.engine.test_fusion import DECODE_ONLY, PROMPT, checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)
from tests.engine.test_metal_backend import relative_error

# With the spread DeltaNet step on (the default), the DeltaNet layers' in_proj and out_proj run its staged variants.
STAGED = {"qmv_norm_staged", "qmv_residual_staged", "qmv_norm_seg_staged", "qmv_norm_seg_conv_staged",
          "qmv_gated_norm_residual_staged", "moe_gate_up_swiglu_routed_staged", "moe_down_combine_staged"}


def _staged_ops(kernels) -> set[str]:
    return {name[:name.index("_staged_") + len("_staged")] for name in kernels if "_staged_" in name}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_staged_and_unstaged_decode_gemvs_give_the_same_logits(
        checkpoints, cuda_engine_backend, precision):  # noqa: F811 (the fixture)
    checkpoint = checkpoints["mlx"]
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoint, precision, "staged_gemv")
    for staged, (_, backend) in runs.items():
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        assert _staged_ops(kernels) == (STAGED if staged else set()), sorted(kernels)
        if staged and precision == "bfloat16":  # the 8-bit router | shared-gate GEMV with f32 out is staged too
            router = "qmv_norm_seg_staged_q8_g64_bf16_of32"
            assert {router, router + "_a16"} & set(kernels), sorted(kernels)
    logits = {staged: run[0] for staged, run in runs.items()}
    ref = ReferenceModel(checkpoint)
    want = ref.forward(PROMPT, ref.new_state())
    if precision == "float32":
        # Same maths, another fp32 summation order (pack sums by shuffles, the norm weight applied once).
        assert relative_error(logits[True], logits[False]) < 1e-5
        assert relative_error(logits[True], want) < 1e-3
    else:
        for staged, out in logits.items():  # bf16 rounding of the hidden stream, as test_fusion's bf16 bound
            assert relative_error(out, want) < 5e-2, staged
    assert np.array_equal(np.argmax(logits[True], -1), np.argmax(logits[False], -1))


def test_metal_runtime_never_stages(checkpoints):  # noqa: F811
    backend = MetalBackend(checkpoints["mlx"], precision="float32", switches=DECODE_ONLY)
    backend.forward(PROMPT, backend.new_state())
    assert not _staged_ops(backend.last_step_counts()["dispatches_by_kernel"])


def test_staged_gemv_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_STAGED_GEMV": "1"}) == {"staged_gemv": False}
