"""The kernel choice for a short prompt's projections (tuning::qmv_takes): up to 4 rows every projection runs qmv;
5 to 8 rows run qmv below 8192 output features and the 16-row qmm tile from there on (in_proj_qkv and q_proj, and
lm_head when every row's logits are asked for); more rows run qmm everywhere. With MMA_GEMV (CUDA's choice:
tuning::mma_gemv) every 4-bit projection of 2 to 8 rows runs qmv_mma instead, of one row only those of 8192 outputs
or more (in_proj_qkv, q_proj, lm_head), and 9 rows the vector choice again.
Read from the graphs the engine builds (graph_kernels) at the model's full size and at the demo's, whose matrices
are all narrower than 8192."""

from __future__ import annotations

import pytest

from lily import _ext
from lily.backends import engine_config
from lily.backends.engine import engine_switches
from lily.checkpoint import load_checkpoint
from lily.config import ModelArgs
from lily.plan import FULL_SIZE_CONFIG

from tests.engine.test_metal_head_dims import DEMO

FULL_SIZE = engine_config(ModelArgs.from_dict(FULL_SIZE_CONFIG, source="full size"))


def pass_kernels(config, rows: int, mma_gemv: bool = False) -> set[str]:
    """The GEMV and GEMM kernels of passes of `rows` rows (the decode step's, which graph_kernels adds, left out), as
    a GPU without Metal 4 tensor ops runs them (`mma_gemv`: and with few-row GEMVs on matrix units, as CUDA)."""
    switches = engine_switches({"tensor_ops": False, "mma_gemv": mma_gemv})
    step = set(_ext.graph_kernels(config, "bfloat16", switches, 0, False, []))
    return {k for k in set(_ext.graph_kernels(config, "bfloat16", switches, 0, False, [rows])) - step
            if k.startswith(("qmv_", "qmm_"))}


@pytest.mark.parametrize("rows", [5, 8])
def test_five_to_eight_rows_take_qmv_below_8192_outputs(rows):
    assert pass_kernels(FULL_SIZE, rows) == {
        "qmv_q4_g64_bf16",            # in_proj_z, in_proj_b/a, out_proj, k/v_proj, o_proj
        "qmm_q4_g64_bf16_bm16",       # in_proj_qkv, q_proj: N = 8192
        "qmv_q8_g64_bf16_of32",       # the router (N = 256) and the shared-expert gate
        "qmv_q4_g64_bf16_of32",       # lm_head, the last row's logits
        "qmm_q4_g64_bf16_of32_bm16",  # lm_head, every row's logits (N = 248,320)
    }


def test_nine_rows_take_the_gemm_and_four_the_gemv():
    nine = pass_kernels(FULL_SIZE, 9)
    assert "qmm_q8_g64_bf16_of32_bm16" in nine and "qmv_q4_g64_bf16" not in nine, sorted(nine)
    four = pass_kernels(FULL_SIZE, 4)
    assert not any(k.startswith("qmm_") for k in four), sorted(four)


def test_the_demo_model_runs_eight_rows_on_qmv_alone():
    demo = engine_config(load_checkpoint(DEMO).args)
    kernels = pass_kernels(demo, 8)
    assert kernels and not any(k.startswith("qmm_") for k in kernels), sorted(kernels)


@pytest.mark.parametrize("rows", [3, 5, 8])
def test_three_to_eight_rows_take_the_matrix_unit_gemv_where_chosen(rows):
    assert pass_kernels(FULL_SIZE, rows, mma_gemv=True) == {
        "qmv_mma_q4_g64_bf16",       # every 4-bit projection
        "qmv_q8_g64_bf16_of32",      # the router (N = 256) and the shared-expert gate: 8-bit codes
        "qmv_mma_q4_g64_bf16_of32",  # lm_head, the last row's logits and every row's
    }


def test_two_rows_take_it_too_and_nine_rows_not_at_all():
    assert pass_kernels(FULL_SIZE, 2, mma_gemv=True) == {
        "qmv_mma_q4_g64_bf16",       # every 4-bit projection (below 8192 outputs on 8 simdgroups)
        "qmv_q8_g64_bf16_of32",      # the router and the shared-expert gate
        "qmv_mma_q4_g64_bf16_of32",  # lm_head
    }
    nine = pass_kernels(FULL_SIZE, 9, mma_gemv=True)  # the projections on qmm; lm_head's last row is one row
    assert "qmv_mma_q4_g64_bf16" not in nine and {"qmm_q4_g64_bf16_bm16", "qmv_mma_q4_g64_bf16_of32"} <= nine, nine
