"""Prefill GEMMs on Metal 4 tensor ops (qmm_nax, M5-class GPUs) where the device reports them, through the Linux
test runtime: the fake device reports the family when told to, and the harness emulates the tensor-op matmul.
The same prompt with TENSOR_OPS off (the simdgroup-matrix qmm) gives the same logits within bf16 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from lily import Model
from lily._ext import _test_engine as te

PROMPT = "KING HENRY:\nWhat say you, my lords? Speak, and speak plainly."


@pytest.fixture
def tensor_ops_device():
    te.set_tensor_ops(True)
    yield
    te.set_tensor_ops(False)


def prefill_logits(model: Model) -> tuple[np.ndarray, dict]:
    ids = model.encode(PROMPT)
    assert len(ids) > 16  # more rows than the GEMV takes: the prefill GEMMs run
    logits = model.backend.forward(np.asarray(ids), model.backend.new_state())
    return logits, model.backend.last_step_counts()["dispatches_by_kernel"]


@pytest.mark.fake_metal
def test_tensor_op_gemms_agree_with_the_simdgroup_gemms(tensor_ops_device, monkeypatch):
    with_ops, kernels = prefill_logits(Model.load("lily:demo", backend="metal", progress=False))
    # Every bf16-output GEMM on tensor ops; the f32-output ones (router and lm_head logits) stay on qmm's _of32.
    assert kernels.get("qmm_nax_q4_g64_bf16", 0) > 0
    assert not any(k.startswith("qmm_q") and "_of32" not in k for k in kernels)
    monkeypatch.setenv("LILY_DISABLE_TENSOR_OPS", "1")
    without, kernels = prefill_logits(Model.load("lily:demo", backend="metal", progress=False))
    assert "qmm_nax_q4_g64_bf16" not in kernels and any(k.startswith("qmm_q4_g64_bf16") for k in kernels)
    assert np.isfinite(with_ops).all()
    scale = np.abs(without).max()
    assert np.abs(with_ops - without).max() <= 0.05 * scale
    assert np.mean(with_ops.argmax(-1) == without.argmax(-1)) >= 0.9


@pytest.mark.fake_metal
def test_devices_without_tensor_ops_never_dispatch_them():
    _, kernels = prefill_logits(Model.load("lily:demo", backend="metal", progress=False))
    assert not any("nax" in k for k in kernels)
