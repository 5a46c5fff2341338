"""The IN_GEMM_DEQUANT ablation: prefill GEMMs as a dequantize pass into an engine scratch buffer followed by the
dense mm_* GEMM, instead of qmm_* dequantizing weight tiles inside the GEMM.

It must change only the schedule: float32 mode gives the default run's logits within fp32 rounding (both accumulate
in fp32 over exactly the fp32 weights), and both match lily.reference. The embedded demo model, on the Linux test
runtime that runs the real kernels on the CPU harness.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import load_checkpoint
from lily.backends.engine import switches_from_env
from lily.backends.metal import MetalBackend
from lily.reference import ReferenceModel

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

DEMO = Path(__file__).resolve().parents[2] / "python" / "lily" / "demo"


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(DEMO)


def prefill(backend: MetalBackend, ids: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    logits = backend.forward(ids, backend.new_state())
    return logits, backend.last_step_counts()["dispatches_by_kernel"]


# 9 rows: 16-row tiles (mm_*_bm16); 21 rows: 32-row tiles (mm_*_bm32).
@pytest.mark.parametrize("tokens,tile", [(9, "bm16"), (21, "bm32")])
def test_separate_dequantize_pass_changes_only_the_schedule(demo, tokens: int, tile: str) -> None:
    ids = np.random.default_rng(tokens).integers(0, demo.args.vocab_size, tokens)
    default, default_kernels = prefill(MetalBackend(demo, precision="float32"), ids)
    ablated, kernels = prefill(MetalBackend(demo, precision="float32", switches={"in_gemm_dequant": False}), ids)

    assert not [k for k in default_kernels if k.startswith(("mm_", "dequantize_"))], sorted(default_kernels)
    assert not [k for k in kernels if k.startswith("qmm_")], sorted(kernels)
    gemms = default_kernels.get(f"qmm_q4_g64_f32_{tile}", 0) + default_kernels.get(f"qmm_q8_g64_f32_{tile}", 0)
    assert gemms > 0, sorted(default_kernels)
    # One dequantize pass and one dense GEMM for every GEMM the default ran.
    assert kernels.get(f"mm_f32_{tile}") == gemms, sorted(kernels)
    dequantized = sum(n for k, n in kernels.items() if k.startswith("dequantize_q") and k.endswith("_f32"))
    assert dequantized == gemms, sorted(kernels)

    scale = float(np.max(np.abs(default)))
    np.testing.assert_allclose(ablated, default, rtol=0, atol=1e-5 * scale)
    want = ReferenceModel(demo).forward(ids, ReferenceModel(demo).new_state())
    assert float(np.max(np.abs(ablated - want))) / float(np.max(np.abs(want))) < 1e-4


def test_decode_after_an_ablated_prefill_continues_the_same(demo) -> None:
    """Decode steps (qmv, untouched by the switch) continue from the state the ablated prefill left."""
    ids = np.array([5, 17, 300, 2, 9, 0, 77, 123])
    runs = []
    for switches in ({}, {"in_gemm_dequant": False}):
        backend = MetalBackend(demo, precision="float32", switches=switches)
        state = backend.new_state()
        backend.forward(ids, state)
        runs.append(backend.forward(np.array([42]), state))
    np.testing.assert_allclose(runs[1], runs[0], rtol=0, atol=1e-5 * float(np.max(np.abs(runs[0]))))


def test_bfloat16_mode_dequantizes_to_bfloat16(demo) -> None:
    """In bf16 mode the dense copy is bf16 (weights rounded once more than qmm's fp32 tiles): close, not equal."""
    ids = np.arange(9) * 7
    default, _ = prefill(MetalBackend(demo, precision="bfloat16"), ids)
    ablated, kernels = prefill(MetalBackend(demo, precision="bfloat16", switches={"in_gemm_dequant": False}), ids)
    assert kernels.get("mm_bf16_bm16", 0) > 0 and any(k.endswith("_bf16") and k.startswith("dequantize_")
                                                      for k in kernels), sorted(kernels)
    rel = float(np.sqrt(np.mean((ablated - default) ** 2)) / np.sqrt(np.mean(default**2)))
    assert rel < 2e-2, f"bf16 relative RMS difference {rel:.3g}"


def test_switch_is_read_from_the_environment() -> None:
    assert switches_from_env({"LILY_DISABLE_IN_GEMM_DEQUANT": "1"}) == {"in_gemm_dequant": False}
    assert switches_from_env({"LILY_DISABLE_IN_GEMM_DEQUANT": "0"}) == {}
