"""`lily plan`: the decode graph built without running it, its counts, and its bytes against the minimum a token
must move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lily import plan as lily_plan
from lily._ext import _test_engine as te
from lily.cli import main as cli_main
from lily.config import ModelArgs

from tests.fixtures import text_config

ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCE = "\n".join(p.read_text() for p in sorted((ROOT / "metal").glob("*.metal")))
TEST_KERNEL_SOURCE = (Path(__file__).with_name("engine_kernels.metal")).read_text()


def small_full_shape_args(layers: int = 4) -> ModelArgs:
    """The model's structure (head dim 256, DeltaNet dk 128, attention every 4th layer) at a tiny width."""
    config = dict(lily_plan.FULL_SIZE_CONFIG)
    config.update(
        vocab_size=640, hidden_size=128, num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )
    return ModelArgs.from_dict(config)


def expected_dispatches(args: ModelArgs, *, fused: bool, split: bool = False, fusion: bool = True,
                        prep_in_attention: bool = False) -> int:
    """Dispatches of one decode token, counted from the model's structure (one kernel chain per layer kind).

    ``fused``: projections sharing an input as one GEMV; ``fusion``: norms folded into the GEMVs after them, the
    residual add into the out/o projection, routing into the experts' gate/up kernel; ``prep_in_attention``: no
    attention_prep dispatch (FUSED_ATTENTION_PREP: bf16 split-KV decode on matrix units preps its own rows).
    """
    attention = sum(t == "full_attention" for t in args.layer_types)
    deltanet = args.num_hidden_layers - attention
    norm = 0 if fusion else 1  # a separate RMSNorm dispatch (the post-attention one also adds the residual)
    route = 0 if fusion else 1
    moe = norm + (1 if fused else 2) + route + 2  # post norm, router GEMV(s), route, gate/up, down+combine
    per_deltanet = norm + (1 if fused else 4) + 1 + 1 + moe  # input norm, in_proj(s), deltanet step, out_proj
    prep = 0 if prep_in_attention else 1
    per_attention = norm + (1 if fused else 3) + prep + (2 if split else 1) + 1 + moe  # qkv, prep, attention, o_proj
    return deltanet * per_deltanet + attention * per_attention + 1 + norm + 1 + 2  # embed, norm, lm_head, argmax x2


def performance_minimum(context: int) -> dict[str, float]:
    """The minimum bytes of one decode token of the full-size model: every active weight once, the states, the cache."""
    H, L, NGDN, NATT, V, nq, nkv, hd = 2048, 40, 30, 10, 248320, 16, 2, 256
    lk, lv, dk, dv, conv_k, E, topk, Fi = 16, 32, 128, 128, 4, 256, 8, 512
    b4, b8 = 0.5625, 1.0625
    att = H * nq * hd * 2 + 2 * H * nkv * hd + nq * hd * H
    gdn = H * (2 * lk * dk + lv * dv) + H * lv * dv + 2 * H * lv + lv * dv * H
    expert, router = 3 * H * Fi, H * E
    weights = (NATT * att * b4 + NGDN * (gdn * b4 + (2 * lk * dk + lv * dv) * conv_k * 2)
               + L * ((topk + 1) * expert * b4 + (router + H) * b8) + V * H * b4)
    state = 2 * NGDN * lv * dk * dv * 4
    conv = 2 * NGDN * 3 * (2 * lk * dk + lv * dv) * 2
    kv = NATT * 2 * nkv * hd * 2 * context
    return {"weights": weights, "state": state, "conv": conv, "kv": kv, "total": weights + state + conv + kv}


def full_size_weight_bytes() -> float:
    """Every weight of the full-size model as the 4-bit checkpoint holds it (8-bit router and shared-expert gate)."""
    H, L, NGDN, NATT, V, nq, nkv, hd = 2048, 40, 30, 10, 248320, 16, 2, 256
    lk, lv, dk, dv, conv_k, E, Fi = 16, 32, 128, 128, 4, 256, 512
    b4, b8 = 0.5625, 1.0625
    att = H * nq * hd * 2 + 2 * H * nkv * hd + nq * hd * H
    gdn = H * (2 * lk * dk + lv * dv) + H * lv * dv + 2 * H * lv + lv * dv * H
    expert = 3 * H * Fi
    return (NATT * att * b4 + NGDN * (gdn * b4 + (2 * lk * dk + lv * dv) * conv_k * 2)
            + L * ((E + 1) * expert * b4 + (H * E + H) * b8) + 2 * V * H * b4)


@pytest.mark.parametrize("switches", [{}, {"fusion": False}], ids=["fusion", "unfused"])
@pytest.mark.parametrize("context", [4096, 40000])
def test_full_size_bytes_within_five_percent_of_the_minimum(context, switches):
    plan = lily_plan.plan_decode(lily_plan.full_size_args(), context=context, switches=switches)
    expected = performance_minimum(context)
    minimum = plan["minimum_bytes"]
    # The formula leaves out norms (0.35 MB), A_log/dt_bias and the embedding row: well under 0.1 %.
    assert minimum["total"] == pytest.approx(expected["total"], rel=1e-3)
    assert minimum["recurrent_state"] == expected["state"]
    assert minimum["conv_state"] == expected["conv"]
    assert minimum["kv_cache"] == expected["kv"]
    moved = plan["bytes_read"] + plan["bytes_written"]
    assert expected["total"] <= moved <= 1.05 * expected["total"]


def test_full_size_dispatch_counts_follow_the_layer_structure():
    args = lily_plan.full_size_args()
    # Below LILY_ATTN_SPLIT_MIN_KEYS (256) keys the attention runs single pass, after attention_prep.
    fused = lily_plan.plan_decode(args, context=200)
    unfused = lily_plan.plan_decode(args, context=200, switches={"fused_projections": False})
    assert fused["dispatches"] == expected_dispatches(args, fused=True)
    assert unfused["dispatches"] == expected_dispatches(args, fused=False)
    no_fusion = lily_plan.plan_decode(args, context=200, switches={"fusion": False})
    assert no_fusion["dispatches"] == expected_dispatches(args, fused=True, fusion=False)
    assert fused["dispatches_by_kernel"]["attention_decode_mma_bf16_d256"] == 10
    assert fused["dispatches_by_kernel"]["attention_prep_bf16_d256"] == 10
    prep_apart = lily_plan.plan_decode(args, context=200, switches={"fused_attention_prep": False})
    assert prep_apart["dispatches_by_kernel"] == fused["dispatches_by_kernel"]
    # From there on as partials (on matrix units, preparing their own rows: FUSED_ATTENTION_PREP; on the vector kernel
    # with MMA_ATTENTION off) + combine (32 blocks at 4K keys, 64 at 40K), unless split-KV is off.
    for context in (4096, 40000):
        split = lily_plan.plan_decode(args, context=context)
        assert split["dispatches"] == expected_dispatches(args, fused=True, split=True, prep_in_attention=True)
        assert split["dispatches_by_kernel"]["attention_decode_partial_prep_mma_bf16_d256"] == 10
        assert "attention_prep_bf16_d256" not in split["dispatches_by_kernel"]
        prep_apart = lily_plan.plan_decode(args, context=context, switches={"fused_attention_prep": False})
        assert prep_apart["dispatches"] == expected_dispatches(args, fused=True, split=True)
        assert prep_apart["dispatches_by_kernel"]["attention_prep_bf16_d256"] == 10
        vector = lily_plan.plan_decode(args, context=context, switches={"mma_attention": False})
        assert vector["dispatches"] == expected_dispatches(args, fused=True, split=True)
        assert vector["dispatches_by_kernel"]["attention_decode_partial_bf16_d256"] == 10
    assert lily_plan.plan_decode(args, context=4096, switches={"split_kv": False})["dispatches"] == fused["dispatches"]
    # Fusing projections removes dispatches, never stages: the separate GEMVs share one stage.
    assert unfused["stages"] == fused["stages"]
    assert fused["stages"] <= fused["dispatches"]


def replay_through_encoder(plan: dict) -> dict:
    """Encode the plan's dispatches into a real Encoder (fake Metal; never committed) with the same ranges."""
    device = te.Device(TEST_KERNEL_SOURCE)
    pipeline = device.pipeline("engine_scale")
    buffers = [device.buffer(length) for _, length in plan["buffers"]]
    encoder = te.Encoder(device)
    for node in plan["nodes"]:
        if node["barrier_before"]:
            encoder.barrier()
        encoder.dispatch(pipeline, [], (1, 1, 1), (1, 1, 1),
                         [(buffers[b], o, n) for b, o, n in node["reads"]],
                         [(buffers[b], o, n) for b, o, n in node["writes"]])
    return encoder.counters


@pytest.mark.metal
@pytest.mark.parametrize("switches", [{}, {"concurrent": False}, {"fused_projections": False}, {"fusion": False},
                                      {"split_kv_min_keys": 8}])
def test_stages_equal_the_encoders_automatic_barriers(switches):
    plan = lily_plan.plan_decode(small_full_shape_args(8), context=37, precision="float32", switches=switches,
                              with_graph=True)
    counters = replay_through_encoder(plan)
    assert counters["dispatches"] == plan["dispatches"] == len(plan["nodes"])
    assert counters["stages"] == plan["stages"]
    assert counters["barriers"] == plan["barriers"]
    declared_read = sum(n for node in plan["nodes"] for _, _, n in node["reads"])
    assert counters["bytes_read"] == declared_read
    if switches.get("concurrent") is False:
        assert plan["stages"] == plan["dispatches"]


def overlap(a, b) -> bool:
    """Two lists of (buffer, offset, length) spans share a byte."""
    return any(x[0] == y[0] and x[2] and y[2] and x[1] < y[1] + y[2] and y[1] < x[1] + x[2] for x in a for y in b)


def must_wait(earlier: dict, later: dict) -> bool:
    """The barrier rule, written again from its definition: RAW, WAR or WAW on overlapping spans of one buffer."""
    return (overlap(later["reads"], earlier["writes"]) or overlap(later["writes"], earlier["reads"])
            or overlap(later["writes"], earlier["writes"]))


@pytest.mark.parametrize("switches", [{}, {"concurrent": False}, {"fusion": False, "fused_projections": False},
                                      {"split_kv_min_keys": 8}])
def test_dependency_edges_order_exactly_what_the_rule_orders(switches):
    """The CUDA graph's edges (barriers.cpp, `dependencies`): every pair the rule orders is ordered by a path of
    edges, every edge is a pair the rule orders (or a forced barrier), and no edge is implied by the others."""
    plan = lily_plan.plan_decode(small_full_shape_args(8), context=37, precision="float32", switches=switches,
                                 with_graph=True)
    nodes = plan["nodes"]
    before: list[set[int]] = []  # the nodes each node runs after, through the edges
    for i, node in enumerate(nodes):
        edges = node["depends_on"]
        assert edges == sorted(set(edges)) and all(j < i for j in edges)
        ancestors = set().union(*(before[j] | {j} for j in edges)) if edges else set()
        for j in edges:
            assert node["barrier_before"] or must_wait(nodes[j], node), (j, i)
            others = set().union(*(before[k] | {k} for k in edges if k != j)) if len(edges) > 1 else set()
            assert j not in others, f"edge {j} -> {i} is implied by the others"
        for j in range(i):
            if node["barrier_before"] or must_wait(nodes[j], node):
                assert j in ancestors, f"node {i} ({node['label']}) is not ordered after node {j}"
        before.append(ancestors)
    if switches.get("concurrent") is False:
        assert all(node["depends_on"] == [i - 1] for i, node in enumerate(nodes) if i)


@pytest.mark.parametrize("context", [4096, 40000])
def test_full_size_meets_the_decode_targets(context):
    """Issue 6: at most 360 dispatches and 300 barrier stages per decode token at full size (bf16, the default)."""
    plan = lily_plan.plan_decode(lily_plan.full_size_args(), context=context)
    assert plan["dispatches"] <= 360
    assert plan["stages"] <= 300
    # Every decode dispatch reads what the one before wrote: the chain is serial, so fusion is what cuts stages.
    assert plan["stages"] == plan["dispatches"]
    by_kernel = plan["dispatches_by_kernel"]
    assert "rms_norm_bf16" not in by_kernel and "rms_norm_residual_bf16" not in by_kernel
    assert "moe_route_f32" not in by_kernel
    assert by_kernel["moe_gate_up_swiglu_routed_bf16"] == 40
    assert by_kernel["qmv_norm_seg_q8_g64_bf16_of32"] == 40  # router | shared-expert gate, f32 logits
    assert by_kernel["qmv_norm_seg_q4_g64_bf16"] == 40  # in_proj_qkv|z|b|a and q|k|v: no concatenated copies
    assert by_kernel["qmv_residual_q4_g64_bf16"] == 40  # out_proj / o_proj
    unfused = lily_plan.plan_decode(lily_plan.full_size_args(), context=context, switches={"fusion": False})
    assert unfused["dispatches"] - plan["dispatches"] == 3 * 40 + 1


def test_every_planned_kernel_exists_for_the_model_shape():
    """The graph names only kernels the Metal source instantiates (full-size shapes, both precisions)."""
    for precision in lily_plan.PRECISIONS:
        for switches in ({}, {"split_kv_min_keys": 1}, {"fusion": False}, {"fusion": False, "fused_projections": False}):
            plan = lily_plan.plan_decode(lily_plan.full_size_args(), context=10, precision=precision, switches=switches)
            for kernel in plan["dispatches_by_kernel"]:
                assert f'"{kernel}"' in KERNEL_SOURCE, kernel


def test_tiny_config_graph():
    args = ModelArgs.from_dict({**text_config("gqa4"), "model_type": "qwen3_5_moe_text"})
    plan = lily_plan.plan_decode(args, context=5, precision="float32")
    assert plan["dispatches"] == expected_dispatches(args, fused=True)
    by_kernel = plan["dispatches_by_kernel"]
    assert by_kernel["gated_delta_step_f32_dk64"] == 4 and by_kernel["attention_prep_f32_d64"] == 2
    assert by_kernel["moe_gate_up_swiglu_routed_f32"] == 6
    state = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    assert plan["minimum_bytes"]["recurrent_state"] == 2 * 4 * state
    assert plan["minimum_bytes"]["kv_cache"] == 2 * 2 * args.num_key_value_heads * args.head_dim * 4 * 5


def test_bad_input_names_the_parameter():
    args = lily_plan.full_size_args()
    with pytest.raises(ValueError, match="unknown engine switch 'fast'"):
        lily_plan.plan_decode(args, switches={"fast": True})
    with pytest.raises(ValueError, match="precision"):
        lily_plan.plan_decode(args, precision="fp8")
    with pytest.raises(ValueError, match="context"):
        lily_plan.plan_decode(args, context=-1)


def test_cli_plan_json_and_table(capsys, monkeypatch):
    assert cli_main(["plan", "--full-size", "--context", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 4096 keys (and the default context, 4096): split-KV attention, partials + combine.
    assert plan["dispatches"] == expected_dispatches(lily_plan.full_size_args(), fused=True, split=True,
                                                     prep_in_attention=True)
    monkeypatch.setenv("LILY_DISABLE_FUSED_PROJECTIONS", "1")
    assert cli_main(["plan", "--full-size"]) == 0
    table = capsys.readouterr().out
    unfused = expected_dispatches(lily_plan.full_size_args(), fused=False, split=True, prep_in_attention=True)
    assert "dispatches per token" in table and str(unfused) in table
    # Memory held: every weight of the model (all 256 experts, embedding and lm_head), and a KV cache of 10 layers x
    # K and V x 2 heads x 256 x bf16 per token of context.
    assert plan["memory"]["weights"] == pytest.approx(full_size_weight_bytes(), rel=1e-3)
    assert plan["kv_bytes_per_token"] == 10 * 2 * 2 * 256 * 2
    assert plan["memory"]["kv_cache"] == plan["kv_bytes_per_token"] * plan["kv_capacity"] >= 4097 * 20480
    assert "20.5 KB per token" in table and "5.37 GB at 262,144" in table
    assert cli_main(["plan", "--model", "/nonexistent/dir"]) == 1
    assert "lily: error:" in capsys.readouterr().err
