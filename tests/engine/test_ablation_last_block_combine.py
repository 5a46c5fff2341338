"""The LAST_BLOCK_COMBINE switch: on the CUDA runtime (the only one whose kernels fence across threadgroups), split-KV
decode attention with the prep fused in is one dispatch, `attention_decode_split_prep_mma_*`, whose last threadgroup
of each KV head's blocks combines them; off, or on the Metal runtime, the partial kernel and then
`attention_decode_combine_*`. The combine's arithmetic and order are the same, so both give the same logits bit for
bit: the demo model (head dim 64, one threadgroup column per KV head), the gqa4 fixture (two columns per KV head) and
the head-dim-256 fixture (the model's 8 heads per threadgroup), split from the first key; the fake libcuda replays
the CUDA graphs, so every decode step runs the kernel again on the tickets the step before left at 0."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env

from tests.engine.test_metal_head_dims import run_backend
from tests.engine.test_metal_head_dims import checkpoints  # noqa: F401 (the fixture)

SUFFIX = {"demo": "d64", "gqa4": "d64", "d256": "d256"}


@pytest.mark.parametrize("name", ["demo", "gqa4", "d256"])
def test_the_last_block_combine_gives_the_combine_kernels_bits(checkpoints, cuda_engine_backend, name):  # noqa: F811
    checkpoint, attn = checkpoints[name], SUFFIX[name]
    layers = checkpoint.args.layer_types.count("full_attention")
    runs = {}
    for on in (True, False):
        switches = {"last_block_combine": on, "split_kv_min_keys": 1}
        logits, kernels = run_backend(cuda_engine_backend(checkpoint, precision="bfloat16", switches=switches))
        runs[on] = logits
        split, partial = kernels.get(f"attention_decode_split_prep_mma_bf16_{attn}", 0), kernels.get(
            f"attention_decode_partial_prep_mma_bf16_{attn}", 0)
        combine = kernels.get(f"attention_decode_combine_bf16_{attn}", 0)
        assert (split, partial, combine) == ((layers, 0, 0) if on else (0, layers, layers)), sorted(kernels)
    assert np.array_equal(runs[True].view(np.uint32), runs[False].view(np.uint32))


@pytest.mark.metal
def test_the_metal_runtime_keeps_the_combine_kernel(checkpoints):  # noqa: F811
    from lily.backends.metal import MetalBackend

    checkpoint = checkpoints["demo"]
    _, kernels = run_backend(MetalBackend(checkpoint, precision="bfloat16", switches={"split_kv_min_keys": 1}))
    assert "attention_decode_combine_bf16_d64" in kernels and not [k for k in kernels if "_split_prep_" in k]


def test_last_block_combine_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_LAST_BLOCK_COMBINE": "1"}) == {"last_block_combine": False}
