"""The L2_PREFETCH switch (docs/cuda.md, "L2 prefetch"): on the CUDA runtime (sm_90) every dispatch of a pass carries
the next dispatch's early reads (Node::early_reads: the weights and state it may read before waiting) as L2 prefetch
ranges, which its threadgroups hand to cp.async.bulk.prefetch as they start. The range rule (prefetch.cpp) is written
again here from its definition and checked on random spans and on the engine's decode graph; the fake libcuda checks
every range lies in device memory at launch, and the logits are the same bits with the switch on and off. Whether
the prefetches make the decode faster is the H200's to measure (docs/verification.md)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily import _ext
from lily.backends.engine import switches_from_env

from tests.engine.test_fusion import checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)

MAX_RANGES, MAX_BYTES = _ext.l2_prefetch_limits


def expected_ranges(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merged where they touch within a buffer; the MAX_RANGES longest (ties in place order), MAX_BYTES in all, the
    last cut short; in place order."""
    merged: list[list[int]] = []
    for buffer, offset, length in sorted(s for s in spans if s[2]):
        if merged and merged[-1][0] == buffer and offset <= merged[-1][1] + merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], offset + length - merged[-1][1])
        else:
            merged.append([buffer, offset, length])
    chosen, total = [], 0
    for buffer, offset, length in sorted(merged, key=lambda m: -m[2])[:MAX_RANGES]:
        take = min(length, MAX_BYTES - total)
        if take == 0:
            break
        chosen.append((buffer, offset, take))
        total += take
    return sorted(chosen)


span = st.tuples(st.integers(0, 3), st.integers(0, 1 << 26), st.one_of(st.integers(0, 4096), st.integers(0, 1 << 25)))


@settings(max_examples=300, deadline=None)
@given(st.lists(span, max_size=16))
def test_prefetch_ranges_follow_the_rule(spans):
    got = [tuple(r) for r in _ext.l2_prefetch_ranges(spans)]
    assert got == expected_ranges(spans)
    assert len(got) <= MAX_RANGES and sum(r[2] for r in got) <= MAX_BYTES


def test_prefetch_limits_bind():
    """Nine disjoint spans keep the eight longest; spans of 20 MiB each are cut at the byte limit."""
    nine = [(0, i * 4096, 16 * (i + 1)) for i in range(9)]
    assert [r[2] for r in _ext.l2_prefetch_ranges(nine)] == [16 * (i + 1) for i in range(1, 9)]
    big = [(1, 0, 20 << 20), (2, 64, 20 << 20)]
    assert [tuple(r) for r in _ext.l2_prefetch_ranges(big)] == [(1, 0, 20 << 20), (2, 64, MAX_BYTES - (20 << 20))]
    touching = [(0, 0, 64), (0, 64, 32), (0, 48, 8), (0, 200, 8)]
    assert [tuple(r) for r in _ext.l2_prefetch_ranges(touching)] == [(0, 0, 96), (0, 200, 8)]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_decode_step_prefetches_the_next_dispatchs_early_reads_and_gives_the_same_bits(
        checkpoints, cuda_engine_backend, monkeypatch, precision):  # noqa: F811 (the fixture)
    monkeypatch.setenv("LILY_CUDA_L2_PREFETCH", "1")  # opted in: read when the runtime opens
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoints["mlx"], precision, "l2_prefetch")
    for prefetch, (_, backend) in runs.items():
        nodes = backend.last_step_graph()["nodes"]
        got = [[tuple(r) for r in n["prefetch"]] for n in nodes]
        if not prefetch:
            assert not any(got)
            continue
        want = [expected_ranges([tuple(s) for s in nodes[i + 1]["early_reads"]]) for i in range(len(nodes) - 1)]
        assert got == want + [[]]
        # Every staged GEMV's weights and every DeltaNet step's state are prefetched by the dispatch before it.
        prefetching = {nodes[i + 1]["kernel"].split("_q")[0].split("_bf16")[0].split("_f32")[0]
                       for i in range(len(nodes) - 1) if got[i]}
        assert {"qmv_norm_staged", "qmv_residual_staged", "qmv_norm_seg_staged", "qmv_norm_seg_conv_staged",
                "qmv_gated_norm_residual_staged", "gated_delta_prefill",
                "moe_gate_up_swiglu_routed_staged"} == prefetching, prefetching
    assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32))


def test_l2_prefetch_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_L2_PREFETCH": "1"}) == {"l2_prefetch": False}


def test_l2_prefetch_is_off_unless_opted_in(checkpoints, cuda_engine_backend, monkeypatch):  # noqa: F811
    """It cost 4 % of tg128 on the H200 (docs/performance.md): without LILY_CUDA_L2_PREFETCH=1 no node prefetches."""
    monkeypatch.delenv("LILY_CUDA_L2_PREFETCH", raising=False)
    backend = cuda_engine_backend(checkpoints["mlx"], precision="float32", switches={"batched_prefill": False})
    backend.forward(np.array([5, 17]), backend.new_state())
    assert not any(n["prefetch"] for n in backend.last_step_graph()["nodes"])
