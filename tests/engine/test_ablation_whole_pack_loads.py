"""The WHOLE_PACK_LOADS switch: on the CUDA runtime the staged kernels (STAGED_GEMV) read a pack of 4 code words as
one 16-byte load (their `_a16` instances) wherever every code tensor a dispatch binds lies on 16 bytes, and a word at
a time elsewhere (tuning::whole_pack_loads); off, always a word at a time. The mlx checkpoint of the fusion tests has
code tensors on 16 bytes and others at 4 or 8 past (after its 2- and 4-byte-aligned dense tensors), so one decode
step runs both instances; the logits must be the same bits either way (the same arithmetic), and a 16-byte load bound
off 16 bytes fails the fake libcuda's per-argument alignment check, as it faults on a GPU."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from lily.backends.engine import switches_from_env

from tests.engine.test_fusion import checkpoints, cuda_decode_both_ways  # noqa: F401 (the fixture)


def code_offsets(checkpoint) -> dict[str, int]:
    """Each quantized code tensor's (U32) offset from its file's data section, where the engine's buffer puts 16-byte
    alignment (Runtime::load_file shifts a file so that its data section starts on 16 bytes)."""
    offsets = {}
    for path in checkpoint.files:
        data = path.read_bytes()
        header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
        offsets.update({name: entry["data_offsets"][0] for name, entry in header.items()
                        if name != "__metadata__" and entry["dtype"] == "U32"})
    return offsets


def expected_moe_kernels(checkpoint, precision: str) -> Counter:
    """The staged MoE dispatches of one decode step by instance, from where the file puts each layer's codes."""
    offsets = code_offsets(checkpoint)
    dtype = "bf16" if precision == "bfloat16" else "f32"
    counts: Counter = Counter()
    layers = sorted({name.split(".mlp.")[0] for name in offsets if ".mlp.switch_mlp." in name})
    for layer in layers:
        for kernel, projections in (("moe_gate_up_swiglu_routed_staged", ("switch_mlp.gate_proj", "switch_mlp.up_proj",
                                                                           "shared_expert.gate_proj",
                                                                           "shared_expert.up_proj")),
                                    ("moe_down_combine_staged", ("switch_mlp.down_proj", "shared_expert.down_proj"))):
            on_16 = all(offsets[f"{layer}.mlp.{p}.weight"] % 16 == 0 for p in projections)
            counts[f"{kernel}_{dtype}{'_a16' if on_16 else ''}"] += 1
    return counts


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_whole_pack_loads_follow_the_codes_alignment_and_give_the_same_bits(
        checkpoints, cuda_engine_backend, precision):  # noqa: F811 (the fixture)
    checkpoint = checkpoints["mlx"]
    expected = expected_moe_kernels(checkpoint, precision)
    assert any(k.endswith("_a16") for k in expected) and not all(k.endswith("_a16") for k in expected), expected
    runs = cuda_decode_both_ways(cuda_engine_backend, checkpoint, precision, "whole_pack_loads")
    for whole_packs, (_, backend) in runs.items():
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        moe = Counter({k: n for k, n in kernels.items() if k.startswith("moe_") and "_staged_" in k})
        if whole_packs:
            assert moe == expected, (moe, expected)
        else:
            assert not [k for k in kernels if k.endswith("_a16")], sorted(kernels)
            assert sum(moe.values()) == sum(expected.values())
    assert np.array_equal(runs[True][0].view(np.uint32), runs[False][0].view(np.uint32))


def test_whole_pack_loads_switch_is_read_from_the_environment():
    assert switches_from_env({"LILY_DISABLE_WHOLE_PACK_LOADS": "1"}) == {"whole_pack_loads": False}
