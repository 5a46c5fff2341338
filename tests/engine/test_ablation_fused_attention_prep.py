"""The FUSED_ATTENTION_PREP switch: on, a bf16 decode step whose attention runs split over key blocks on matrix units
(MMA_ATTENTION) has no attention_prep dispatch: each `attention_decode_partial_prep_mma_*` threadgroup norms and ropes
its own query rows and the new key row before the combine; off, `attention_prep_*` runs first and the partials read
its q, gate and cache row. The single pass keeps its prep dispatch either way (fused, it lost 2 % of tg128 on an H100).
The prep's arithmetic is one source (metal/attention_prep.h), so both give the same logits bit for bit: on the demo
model (head dim 64, one threadgroup per KV head), the gqa4 fixture (two threadgroups of one KV head both write its new
row) and the head-dim-256 fixture (the model's 8 heads per threadgroup), split from the first key, on each runtime (the
Linux test runtime shuffles the dispatches between barriers, so a missing one shows; the fake libcuda replays CUDA
graphs whose nodes carry two per-position fields)."""

from __future__ import annotations

import numpy as np
import pytest

from lily.backends.engine import switches_from_env

from tests.engine.test_metal_backend import relative_error
from tests.engine.test_metal_head_dims import PROMPT, reference_logits, run_backend
from tests.engine.test_metal_head_dims import checkpoints  # noqa: F401 (the fixture)

SUFFIX = {"demo": "d64", "gqa4": "d64", "d256": "d256"}


@pytest.mark.parametrize("split", [False, True], ids=["single-pass", "split-kv"])
@pytest.mark.parametrize("name", ["demo", "gqa4", "d256"])
def test_fused_prep_gives_the_unfused_bits(checkpoints, engine_backend, name, split):  # noqa: F811 (the fixture)
    checkpoint = checkpoints[name]
    attn, kind = SUFFIX[name], "partial_" if split else ""
    layers = checkpoint.args.layer_types.count("full_attention")
    runs = {}
    for fused in (True, False):
        switches = {"fused_attention_prep": fused, **({"split_kv_min_keys": 1} if split else {})}
        logits, kernels = run_backend(engine_backend(checkpoint, precision="bfloat16", switches=switches))
        runs[fused] = logits
        prep = kernels.get(f"attention_prep_bf16_{attn}", 0)
        if fused and split:
            fused_kernel = f"attention_decode_partial_prep_mma_bf16_{attn}"
            assert kernels.get(fused_kernel) == layers and prep == 0, sorted(kernels)
        else:
            assert kernels.get(f"attention_decode_{kind}mma_bf16_{attn}") == layers and prep == layers, sorted(kernels)
            assert not [k for k in kernels if "_prep_mma_" in k], sorted(kernels)
    if name != "gqa4":  # bf16 against the reference as test_ablation_mma_attention bounds it (gqa4's random MoE
        # routing flips on bf16 near-ties: its bf16 logits move by ~0.2 whichever path runs)
        decode_rows = slice(len(PROMPT), None)
        assert relative_error(runs[True][decode_rows], reference_logits(checkpoint)[decode_rows]) < 5e-2
    assert np.array_equal(runs[True].view(np.uint32), runs[False].view(np.uint32))


def test_fused_attention_prep_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_FUSED_ATTENTION_PREP": "1"}) == {"fused_attention_prep": False}
