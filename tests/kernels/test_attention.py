"""metal/attention.metal (decode attention): every case of lily.kernel_cases.attention (single pass and split-KV at
contexts around simdgroup and block boundaries, GQA 1 to 8, head dims 256 and 64, the unpacked and plain ablations,
large scores), then what the cases do not cover: paths that must agree with each other (split vs single pass,
unpacked vs packed, plain vs coalesced, the fused prep vs attention_prep and the unfused kernels) and the bits
independent of the fiber schedule. Also the helpers test_attention_prefill.py shares (kernel names, the f32 sums
tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily.kernel_cases.attention import (CACHE_DTYPE, F32_SUMS, MMA_SIMDGROUPS, DecodeInputs, PrepDecodeInputs,
                                         attention_args, run_prep_fused, run_single, run_split, tolerance,
                                         weight_rounding_allowance)
from lily.kernel_cases.common import Run, poisoned

__all__ = ["CACHE_DTYPE", "attention_args"]  # shared with test_attention_prefill.py

D = 256
SINGLE = {"f32": "attention_decode_f32_d256", "bf16": "attention_decode_bf16_d256", "f16": "attention_decode_f16_d256"}
# Other instances: (head dim, heads per threadgroup) -> {dtype: (single-pass, partial, combine)}.
VARIANTS = {
    (64, 2): {
        "f32": ("attention_decode_f32_d64", "attention_decode_partial_f32_d64", "attention_decode_combine_f32_d64"),
        "bf16": ("attention_decode_bf16_d64", "attention_decode_partial_bf16_d64", "attention_decode_combine_bf16_d64"),
    },
    (256, 1): {
        "f32": ("attention_decode_unpacked_f32_d256", "attention_decode_partial_unpacked_f32_d256",
                "attention_decode_combine_f32_d256"),
        "bf16": ("attention_decode_unpacked_bf16_d256", "attention_decode_partial_unpacked_bf16_d256",
                 "attention_decode_combine_bf16_d256"),
    },
    (64, 1): {
        "f32": ("attention_decode_unpacked_f32_d64", "attention_decode_partial_unpacked_f32_d64",
                "attention_decode_combine_f32_d64"),
        "bf16": ("attention_decode_unpacked_bf16_d64", "attention_decode_partial_unpacked_bf16_d64",
                 "attention_decode_combine_bf16_d64"),
    },
}


def assert_close(kio, actual: np.ndarray, expected: np.ndarray, dtype: str, what: str, widen: float = 1.0) -> None:
    """kio.assert_close, with the fp32 bound widened for sums over many keys (and by `widen` on request)."""
    if dtype != "f32":
        kio.assert_close(actual, expected, dtype, what)
        return
    assert not np.isnan(actual).any(), f"{what}: NaN in output"
    err = np.abs(actual - expected)
    rel_rms = np.sqrt(np.mean(err**2) / np.mean(expected**2))
    assert rel_rms <= widen * F32_SUMS.rel_rms, f"{what}: relative RMS error {rel_rms:.3g}"
    limit = widen * (F32_SUMS.atol + F32_SUMS.rtol * np.abs(expected))
    assert (err <= limit).all(), f"{what}: max abs error {err.max():.3g}"


@pytest.mark.parametrize("case", op_cases("attention"))
def test_attention(case, kernel_device) -> None:
    check(case, kernel_device)


@pytest.mark.parametrize("keys,blocks", [(70, 3), (1, 2), (9, 4), (3, 8), (255, 2), (256, 2), (257, 4), (1025, 8)])
def test_attention_decode_split_matches_single_pass(keys: int, blocks: int, kio, kernel_device) -> None:
    """Both decode paths compute the same attention: they agree within fp32 rounding, with empty blocks (1 key in 2,
    9 in 4 of span 3, 3 in 8), the engine's counts either side of its first bucket boundaries (2 blocks from 256 keys,
    4 from 512, 8 at 1025: tuning::attention_split_blocks) and contexts that are not a multiple of 8 keys."""
    run = Run(kernel_device, np.random.default_rng(9))
    inputs = DecodeInputs.random(run.rng, "f32", 8, 2, keys, D)
    single = run_single(run, SINGLE["f32"], inputs, 8)
    _, _, split = run_split(run, "attention_decode_partial_f32_d256", inputs, blocks, 8)
    assert_close(kio, split, single, "f32", "split vs single pass")
    assert_close(kio, split, inputs.expected(), "f32", "split vs reference")


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_decode_independent_of_schedule(seed: int, kio, kernel_device) -> None:
    """Keys are walked and simdgroups merged in a fixed order: FIFO and random schedules give the same bits."""
    run = Run(kernel_device, np.random.default_rng(12))
    inputs = DecodeInputs.random(run.rng, "f32", 8, 2, 45, D)
    results = [run_single(run, SINGLE["f32"], inputs, 5, random_schedule=random_schedule, seed=seed)
               for random_schedule in (False, True)]
    assert np.array_equal(results[0], results[1])
    assert_close(kio, results[1], inputs.expected(), "f32", "schedule")


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_decode_mma_independent_of_schedule(seed: int, kio, kernel_device) -> None:
    """The mma kernels' simdgroups meet at one barrier per chunk of keys, each chunk's scores in one of two buffers:
    over five chunks (300 keys) the FIFO schedule and one that runs each simdgroup ahead to its next barrier (a
    simdgroup writing the next chunk's scores over ones another has yet to read would show) give the same bits, and
    the reference's result."""
    run = Run(kernel_device, np.random.default_rng(13))
    inputs = DecodeInputs.random(run.rng, "bf16", 16, 2, 300, D)
    results = [run_single(run, "attention_decode_mma_bf16_d256", inputs, MMA_SIMDGROUPS, random_schedule=greedy,
                          greedy_simdgroups=greedy, seed=seed) for greedy in (False, True)]
    assert np.array_equal(results[0], results[1])
    run.compare("out", results[1], inputs.expected(), tolerance("bf16"), weight_rounding_allowance(inputs))
    (comparison,) = run.comparisons
    assert comparison.passed, f"schedule: {comparison}"


def test_attention_decode_unpacked_matches_packed(kio, kernel_device) -> None:
    """The GQA-packing ablation changes the schedule, not the maths: per head, the same keys in the same order, so
    the packed and unpacked kernels agree within fp32 rounding (and both with the reference)."""
    run = Run(kernel_device, np.random.default_rng(21))
    inputs = DecodeInputs.random(run.rng, "f32", 16, 2, 70, D)
    packed = run_single(run, SINGLE["f32"], inputs, 8)
    unpacked = run_single(run, VARIANTS[(256, 1)]["f32"][0], inputs, 8)
    assert_close(kio, unpacked, packed, "f32", "unpacked vs packed")
    assert_close(kio, unpacked, inputs.expected(), "f32", "unpacked vs reference")


def test_attention_decode_plain_matches_coalesced(kio, kernel_device) -> None:
    """The coalesced-KV ablation changes which lane reads which chunk, not the maths: the plain and coalesced kernels
    agree within fp32 rounding (the dot products' lane partial sums are grouped differently), single pass and split."""
    run = Run(kernel_device, np.random.default_rng(41))
    inputs = DecodeInputs.random(run.rng, "f32", 16, 2, 70, D)
    coalesced = run_single(run, SINGLE["f32"], inputs, 8)
    plain = run_single(run, "attention_decode_plain_f32_d256", inputs, 8)
    assert_close(kio, plain, coalesced, "f32", "plain vs coalesced")
    coalesced_parts, coalesced_stats, _ = run_split(run, "attention_decode_partial_f32_d256", inputs, 4, 4)
    plain_parts, plain_stats, plain_split = run_split(run, "attention_decode_partial_plain_f32_d256", inputs, 4, 4)
    assert_close(kio, plain_parts, coalesced_parts, "f32", "plain partials")
    assert_close(kio, plain_stats, coalesced_stats, "f32", "plain stats")
    assert_close(kio, plain_split, inputs.expected(), "f32", "plain split vs reference")


@pytest.mark.parametrize("head_dim,heads,keys,blocks,rotary_dim", [
    (256, 16, 1, 2, 64), (256, 16, 300, 4, 64), (256, 32, 47, 3, 64), (256, 32, 100, 4, 64), (64, 4, 45, 3, 16),
    (64, 8, 33, 2, 32)])
def test_attention_decode_prep_fused_gives_the_unfused_bits(head_dim, heads, keys, blocks, rotary_dim,
                                                            kernel_device) -> None:
    """FUSED_ATTENTION_PREP changes where the prep runs, not its arithmetic (one attention_prep_row, one rounding to
    bf16 of q and of the cache row) nor the attention's: the fused kernel's output, cache rows, gate copy, partials
    and stats are the bits of attention_prep followed by attention_decode_partial_mma and the combine."""
    run = Run(kernel_device, np.random.default_rng(61 + keys))
    fused = PrepDecodeInputs.random(run.rng, heads, 2, keys, head_dim, rotary_dim)
    unfused_k, unfused_v = fused.k_cache.copy(), fused.v_cache.copy()
    out, gate, parts, stats = run_prep_fused(run, f"attention_decode_partial_prep_mma_bf16_d{head_dim}", fused, blocks,
                                             8)

    p = fused.prepped
    q, unfused_gate = poisoned((heads, head_dim), "bf16"), poisoned((heads, head_dim), "bf16")
    rows = heads + 2
    run.dispatch(f"attention_prep_bf16_d{head_dim}",
                 [fused.prep_args(), *fused.prep_inputs(), q, unfused_gate, unfused_k, unfused_v], -(-rows // 8), 256)
    unfused = DecodeInputs("bf16", heads, 2, keys, head_dim, q, unfused_gate, unfused_k, unfused_v)
    assert np.array_equal(fused.k_cache, unfused_k) and np.array_equal(fused.v_cache, unfused_v)
    want_parts, want_stats, want = run_split(run, f"attention_decode_partial_mma_bf16_d{head_dim}", unfused, blocks, 8)
    assert np.array_equal(gate, unfused_gate)
    assert np.array_equal(parts.astype(np.float64), want_parts) and np.array_equal(stats.astype(np.float64), want_stats)
    assert np.array_equal(out, want)
