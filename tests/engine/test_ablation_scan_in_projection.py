"""The SCAN_IN_PROJECTION switch: on the CUDA runtime (the only one whose kernels fence across threadgroups) the spread
DeltaNet step's recurrence runs inside its in_proj GEMV, `qmv_norm_seg_conv_scan_staged_*` (the threadgroup that
takes a scan slice's last ticket scans it); off, or on the Metal runtime, the conv GEMV and then
`gated_delta_prefill_*`'s scan. The same arithmetic in the same order, so every prompt token a decode step (the
states and the tickets carried from step to step, the fake libcuda replaying the CUDA graphs), the logits must be the
same bits, in both precisions."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env

from tests.engine.test_fusion import checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)


def _deltanet_kernels(backend) -> set[str]:
    kernels = backend.last_step_counts()["dispatches_by_kernel"]
    return {name.split("_q4")[0].rsplit("_", 2)[0] if name.startswith("gated_delta_") else name.split("_q4")[0]
            for name in kernels if "_conv_" in name or name.startswith("gated_delta_")}


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_scan_in_the_projection_gives_the_scan_kernels_bits(
        checkpoints, cuda_engine_backend, precision):  # noqa: F811 (the fixture)
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoints["mlx"], precision, "scan_in_projection")
    for on, (_, backend) in runs.items():
        counts = backend.last_step_counts()["dispatches_by_kernel"]
        layers = sum(n for name, n in counts.items() if "_conv_" in name)
        assert layers > 0
        want = {"qmv_norm_seg_conv_scan_staged"} if on else {"qmv_norm_seg_conv_staged", "gated_delta_prefill"}
        assert _deltanet_kernels(backend) == want, sorted(counts)
    assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32))


def test_scan_in_projection_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_SCAN_IN_PROJECTION": "1"}) == {"scan_in_projection": False}
