"""The COMPACT_SCAN switch: on the CUDA runtime a decode token's spread DeltaNet scan (SPREAD_DELTANET_STEP) keeps 8
state rows per simdgroup in 128-thread threadgroups (gated_delta_prefill_compact: tuning::compact_scan); off, one row
per simdgroup in 1024-thread threadgroups (gated_delta_prefill). Every row is updated by the same arithmetic either
way, so with every prompt token a decode step (the recurrent state carried from step to step) the logits must be the
same bits (the fake libcuda running the real kernels on the harness). A prompt's scan over several tokens never takes
the compact kernel."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env

from tests.engine.test_fusion import PROMPT, checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)


def _scans(kernels) -> set[str]:
    return {name.rsplit("_", 2)[0] for name in kernels if name.startswith("gated_delta_prefill")}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_compact_and_plain_scans_give_the_same_bits(checkpoints, cuda_engine_backend, precision):  # noqa: F811
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoints["mlx"], precision, "compact_scan")
    for compact, (_, backend) in runs.items():
        counts = backend.last_step_counts()["dispatches_by_kernel"]
        assert _scans(counts) == {"gated_delta_prefill_compact" if compact else "gated_delta_prefill"}, sorted(counts)
        graph = backend.last_step_graph()
        scans = [n for n in graph["nodes"] if n["kernel"].startswith("gated_delta_prefill")]
        # 32-row slices: 4 simdgroups of 8 rows, or 32 of one.
        assert scans and all(n["threads"][0] == (128 if compact else 1024) for n in scans), scans[0]["threads"]
    assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32))


def test_a_prompt_scan_is_never_compact(checkpoints, cuda_engine_backend):  # noqa: F811
    backend = cuda_engine_backend(checkpoints["mlx"], precision="bfloat16", switches={"compact_scan": True})
    backend.forward(PROMPT, backend.new_state())  # one prompt chunk of len(PROMPT) tokens: the token-by-token scan
    assert _scans(backend.last_step_counts()["dispatches_by_kernel"]) == {"gated_delta_prefill"}


def test_compact_scan_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_COMPACT_SCAN": "1"}) == {"compact_scan": False}
