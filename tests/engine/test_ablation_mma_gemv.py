"""The MMA_GEMV switch: on the CUDA runtime a pass of up to 8 rows of bf16 activations runs its 4-bit projections and
lm_head on matrix units (qmv_mma: tuning::mma_gemv); off, or on the Metal runtime, on the vector GEMV (qmv) and the
16-row GEMM tile. The two sum in another fp32 order (qmv_mma's codes carry an offset of 128 folded into the bias), so
the prompt's logits must agree to rounding and follow lily.reference (the mlx checkpoint of the fusion tests: bf16
scales, the model's head shapes; the fake libcuda running the real kernels on the harness)."""

from __future__ import annotations

import numpy as np

from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

from tests.engine.test_fusion import PROMPT, checkpoints  # noqa: F401 (the fixture)
from tests.engine.test_metal_backend import relative_error

MMA = {"qmv_mma_q4_g64_bf16", "qmv_mma_q4_g64_bf16_of32"}


def _mma_kernels(backend) -> set[str]:
    return {k for k in backend.last_step_counts()["dispatches_by_kernel"] if k.startswith("qmv_mma")}


def test_matrix_unit_and_vector_gemvs_give_the_same_prompt_logits(checkpoints, cuda_engine_backend):  # noqa: F811
    checkpoint = checkpoints["mlx"]
    logits = {}
    for on in (True, False):
        backend = cuda_engine_backend(checkpoint, precision="bfloat16", switches={"mma_gemv": on})
        logits[on] = backend.forward(PROMPT, backend.new_state())  # one 7-row pass: every row's logits
        assert _mma_kernels(backend) == (MMA if on else set())
        # Simdgroups splitting K by output features (tuning::qmv_mma_simdgroups): 16 outputs per threadgroup.
        mma = [n for n in backend.last_step_graph()["nodes"] if n["kernel"].startswith("qmv_mma")]
        assert bool(mma) == on, len(mma)
        assert all(n["threads"] == (32 * (4 if 16 * n["groups"][0] >= 8192 else 8), 1, 1) for n in mma), mma[:1]
    ref = ReferenceModel(checkpoint)
    want = ref.forward(PROMPT, ref.new_state())
    # bf16 rounding of the hidden stream, as test_fusion's bf16 bound; the two summation orders 1.0e-2 apart here (a
    # few bf16 roundings flipped by one unit, carried through two layers).
    for on, out in logits.items():
        assert relative_error(out, want) < 5e-2, on
    assert relative_error(logits[True], logits[False]) < 2e-2
    assert np.array_equal(np.argmax(logits[True], -1), np.argmax(logits[False], -1))


def test_float32_passes_and_the_metal_runtime_keep_the_vector_gemvs(checkpoints, cuda_engine_backend):  # noqa: F811
    backend = cuda_engine_backend(checkpoints["mlx"], precision="float32", switches={"mma_gemv": True})
    backend.forward(PROMPT, backend.new_state())
    assert not _mma_kernels(backend)
    backend = MetalBackend(checkpoints["mlx"], precision="bfloat16", switches={"mma_gemv": True})
    backend.forward(PROMPT, backend.new_state())
    assert not _mma_kernels(backend)


def test_mma_gemv_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_MMA_GEMV": "1"}) == {"mma_gemv": False}
