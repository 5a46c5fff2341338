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
from lily.reference import ReferenceModel

from tests.engine.test_metal_backend import relative_error
from tests.engine.test_metal_head_dims import DECODE, PROMPT, reference_logits, run_backend
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


LONG_PROMPT = np.arange(40) * 53 % 631  # 41 to 43 keys in the decode steps after it


@pytest.mark.parametrize("simdgroups", [1, 2, 4])
def test_split_partials_take_any_simdgroup_count(checkpoints, engine_backend, simdgroups):  # noqa: F811
    """The test option split_mma_simdgroups (the simdgroups of a split-KV partial threadgroup on matrix units; 8 by
    default) takes a block's 8-key steps over fewer simdgroups: the head-dim-256 fixture's bf16 decode split into 2
    blocks of 21-22 keys (3 steps: one simdgroup takes them all, two take 2 and 1, four and eight run one each and
    give the same bits) stays as close to the reference as the default, and to the default's logits within bf16
    rounding (another merge order)."""
    checkpoint = checkpoints["d256"]
    ref = ReferenceModel(checkpoint)
    ref_state = ref.new_state()
    ref.forward(LONG_PROMPT, ref_state)
    want = np.concatenate([ref.forward(np.array([token]), ref_state) for token in DECODE])
    layers = checkpoint.args.layer_types.count("full_attention")
    runs, errors = {}, {}
    for n in (0, simdgroups):  # 0: the default
        backend = engine_backend(checkpoint, precision="bfloat16",
                                 switches={"split_kv_min_keys": 32, "split_kv_block_keys": 32,
                                           "split_mma_simdgroups": n})
        state = backend.new_state()
        backend.forward(LONG_PROMPT, state)
        runs[n] = np.concatenate([backend.forward(np.array([token]), state) for token in DECODE])
        kernels = backend.last_step_counts()["dispatches_by_kernel"]
        assert kernels.get("attention_decode_partial_prep_mma_bf16_d256") == layers, sorted(kernels)
        assert backend._engine.split_blocks(len(LONG_PROMPT) + len(DECODE) - 1) == 2
        errors[n] = relative_error(runs[n], want)
    # bf16 over a 40-token prompt on random MoE weights: the default is itself ~0.1 from the fp64 reference.
    assert errors[simdgroups] < errors[0] + 1e-2
    assert relative_error(runs[simdgroups], runs[0]) < 1e-2


def test_split_mma_simdgroups_outside_1_to_8_is_an_error(checkpoints, engine_backend):  # noqa: F811
    """Named when the backend builds its decode step, at load."""
    with pytest.raises(ValueError, match="split_mma_simdgroups 9: the partial kernels on matrix units take 1 to 8"):
        engine_backend(checkpoints["d256"], precision="bfloat16",
                       switches={"split_kv_min_keys": 1, "split_mma_simdgroups": 9})
