"""Early start (programmatic dependent launch, docs/cuda.md): in the CUDA runtime's graphs a node may start while the
one node it depends on still runs, and waits for it inside (lily::grid_dependency_wait, metal/lily.h), having read
only what that node cannot be writing (Node::early_reads). The rule is barriers.cpp's `early_starts`, written again
here from its definition and checked on the engine's decode graph; the logits with early start on and off (the
LILY_CUDA_PDL=0 switch) are the same. The fake libcuda orders programmatic edges as full ones, so the timing itself
is the H200's to check (docs/verification.md)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_fusion import DECODE_ONLY, PROMPT, checkpoints  # noqa: F401 (the fixture)
from tests.engine.test_plan import overlap, small_full_shape_args
from lily import plan as lily_plan

EARLY_KERNELS = ("qmv_norm_staged_", "qmv_norm_argmax_staged_", "qmv_residual_staged_", "qmv_norm_seg_staged_", "gated_delta_step_",
                 "qmv_norm_seg_conv_staged_", "qmv_gated_norm_residual_staged_", "gated_delta_prefill_f32_",
                 "gated_delta_prefill_bf16_", "gated_delta_prefill_blockwise_", "moe_gate_up_swiglu_routed_staged_",
                 "moe_down_combine_staged_", "attention_decode_mma_", "attention_decode_partial_mma_",
                 "attention_decode_partial_prep_mma_")


def expected_early_start(nodes: list[dict], i: int) -> bool:
    """One edge into node i, from a node writing none of what i reads before its wait."""
    edges = nodes[i]["depends_on"]
    return len(edges) == 1 and not overlap(nodes[edges[0]]["writes"], nodes[i]["early_reads"])


def check_graph(graph: dict) -> list[dict]:
    nodes = graph["nodes"]
    for i, node in enumerate(nodes):
        assert node["early_start"] == expected_early_start(nodes, i), (i, node["label"])
        # What a kernel reads before its wait is among what it declares it reads (so the barrier rule orders it).
        assert all(any(r == e for r in node["reads"]) for e in node["early_reads"]), node["label"]
        reads_early = node["kernel"].startswith(EARLY_KERNELS) and "_late_" not in node["kernel"]
        assert bool(node["early_reads"]) == reads_early, node["kernel"]
    return nodes


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_decode_graph_starts_its_gemvs_and_deltanet_steps_early(checkpoints, cuda_engine_backend, monkeypatch,
                                                                precision):  # noqa: F811 (the fixture)
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("LILY_CUDA_PDL", pdl)  # read when the runtime opens
        backend = cuda_engine_backend(checkpoints["mlx"], precision=precision, switches=DECODE_ONLY)
        runs[pdl] = backend.forward(PROMPT, backend.new_state())
        nodes = check_graph(backend.last_step_graph())
    early = [n for n in nodes if n["kernel"].startswith(EARLY_KERNELS)]
    # Every staged GEMV, DeltaNet scan, staged expert gate/up (the shared expert's weights) and staged expert down (its
    # routing, weights and residual) of a decode token (the spread step, on by default) follows the one dispatch that
    # writes its input.
    assert {n["kernel"].split("_q")[0].split("_bf16")[0].split("_f32")[0] for n in early} == {
        "qmv_norm_staged", "qmv_residual_staged", "qmv_norm_seg_staged", "qmv_norm_seg_conv_staged",
        "qmv_gated_norm_residual_staged", "gated_delta_prefill", "moe_gate_up_swiglu_routed_staged",
        "moe_down_combine_staged"}
    assert all(n["early_start"] for n in early)
    # Both runtimes (programmatic edges, and full ones only) give the same bits.
    assert np.array_equal(runs["1"], runs["0"])


@pytest.mark.parametrize("switches", [{}, {"concurrent": False}, {"fusion": False, "fused_projections": False}])
def test_early_start_rule_on_planned_graphs(switches):
    """The planned (Metal-shaped) decode graph: its DeltaNet steps read their state early; they start early behind
    the one fused in_proj GEMV, not behind four separate projections."""
    plan = lily_plan.plan_decode(small_full_shape_args(8), context=37, precision="float32", switches=switches,
                                 with_graph=True)
    nodes = check_graph(plan)
    steps = [n for n in nodes if n["kernel"].startswith("gated_delta_step_")]
    assert steps and all(n["early_reads"] for n in steps)
    fused = switches.get("fused_projections", True)
    assert all(n["early_start"] == fused and len(n["depends_on"]) == (1 if fused else 4) for n in steps)


@pytest.mark.parametrize("context", [0, 200, 4096])
def test_decode_attention_on_matrix_units_reads_earlier_rows_early(context):
    """The bf16 decode attention on matrix units (the single pass below the split, the fused partials from it) fetches
    its first steps of the cache before its wait: only the rows of earlier tokens, which the prep before it (or its
    own fused prep) does not write, so it starts early behind that one dispatch."""
    args = lily_plan.full_size_args()
    nodes = check_graph(lily_plan.plan_decode(args, context=context, with_graph=True))
    attention = [n for n in nodes if n["kernel"].startswith(("attention_decode_mma_", "attention_decode_partial"))]
    assert len(attention) == 10 and all(n["early_start"] for n in attention)
    row_bytes = args.head_dim * 2  # bf16 cache
    for node in attention:
        early = node["early_reads"]
        assert len(early) == 2 * args.num_key_value_heads  # K and V of each KV head
        assert all(length == context * row_bytes for _, _, length in early)  # rows 0 .. context - 1
        new_rows = nodes[node["depends_on"][0]]["writes"] + node["writes"]
        assert not overlap(new_rows, early)
        assert any(length == row_bytes for _, _, length in new_rows)  # the new token's row: written, not read early
