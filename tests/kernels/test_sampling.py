"""metal/sampling.metal: every case of lily.kernel_cases.sampling (greedy argmax exactly, seeded sampling draw by
draw against lily.sampling fed with the kernel's Philox number, ties and banned tokens), then what the cases do not
cover: Philox's known answers, reproducibility, a chi-square test of 3000 draws, and the tokens independent of the
fiber schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases import check, op_cases

from lily._ext import msl
from lily.kernel_cases.common import Run, to_device, to_f64
from lily.kernel_cases.sampling import (MASK32, acceptable_tokens, block_scratch, philox4x32_10, philox_uniform,
                                        processed_reference, run_penalize, run_sample, run_sample_blocks, sample_args)
from lily.sampling import SamplingParams, log_softmax, top_k_mask, top_p_mask


@pytest.mark.parametrize("case", op_cases("sampling"))
def test_sampling(case, kernel_device) -> None:
    check(case, kernel_device)


def test_philox_known_answers() -> None:
    """Random123's published known-answer vectors for philox4x32_10."""
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((MASK32,) * 4, (MASK32, MASK32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_sample_is_reproducible_and_varies_with_step(kernel_device) -> None:
    run = Run(kernel_device, np.random.default_rng(4))
    logits = to_device(run.rng.standard_normal(500), "f32")
    first = [run_sample(run, "sample_f32", logits, 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    again = [run_sample(run, "sample_f32", logits, 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    other_seed = [run_sample(run, "sample_f32", logits, 64, 1.0, 0, 1.0, 0.0, 78, step) for step in range(8)]
    assert first == again
    assert len(set(first)) > 1 and first != other_seed


def test_sample_distribution(kernel_device) -> None:
    """Chi-square of 3000 draws (steps 0..2999) against the filtered distribution of lily.sampling."""
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    temperature, top_k, top_p = 0.9, 6, 0.9
    x = logits / np.float32(temperature)
    keep = top_k_mask(x.astype(np.float64), top_k)
    probs = np.exp(log_softmax(np.where(keep, x.astype(np.float64), -np.inf)))
    keep &= top_p_mask(probs, top_p)
    expected = np.where(keep, probs, 0.0) / probs[keep].sum()
    draws = 3000
    run = Run(kernel_device, np.random.default_rng(0))
    counts = np.bincount([run_sample(run, "sample_f32", logits, 32, temperature, top_k, top_p, 0.0, 2024, s)
                          for s in range(draws)], minlength=logits.size)
    assert (counts[~keep] == 0).all(), f"filtered tokens drawn: {counts}"
    e = expected[keep] * draws
    chi2 = float(((counts[keep] - e) ** 2 / e).sum())
    # 99.9th percentile of chi-square with (kept - 1) <= 4 degrees of freedom is 18.5.
    assert chi2 < 18.5, f"chi2 {chi2:.1f}; counts {counts.tolist()}, expected {np.round(e).tolist()}"


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalized_sample_distribution(kernel_device, penalty) -> None:
    """The decode step's kernel pair, penalize_logits_f32 then sample_f32, for a decode that has chosen tokens 0, 0
    and 1: chi-square of 3000 draws against lily.sampling's distribution over the processed logits."""
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    generated = [0, 0, 1]
    params = SamplingParams(temperature=0.9, **{penalty: 0.8})
    run = Run(kernel_device, np.random.default_rng(1))
    processed = run_penalize(run, "penalize_logits_f32", logits, 32, params, [], generated)
    x = processed_reference(logits.astype(np.float64), params, [], generated) / params.temperature
    expected = np.exp(log_softmax(x))
    draws = 3000
    counts = np.bincount([run_sample(run, "sample_f32", processed, 32, params.temperature, 0, 1.0, 0.0, 99, s)
                          for s in range(draws)], minlength=logits.size)
    e = expected * draws
    chi2 = float(((counts - e) ** 2 / e).sum())
    # 99.9th percentile of chi-square with 7 degrees of freedom is 24.3; the unpenalized distribution must fail it.
    assert chi2 < 24.3, f"chi2 {chi2:.1f}; counts {counts.tolist()}, expected {np.round(e).tolist()}"
    raw = np.exp(log_softmax(logits.astype(np.float64) / params.temperature)) * draws
    assert float(((counts - raw) ** 2 / raw).sum()) > 24.3


def test_sample_independent_of_schedule() -> None:
    """Fixed-order sums and integer atomics only: FIFO and random fiber schedules pick the same tokens."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal(3000).astype(np.float32) * 2.0
    for step in range(3):
        picks = set()
        for schedule_seed, random_schedule in ((0, False), (1, True), (2, True)):
            tokens = np.full(1, MASK32, np.uint32)
            msl.dispatch("sample_f32", [sample_args(3000, 0.9, 50, 0.9, 0.02, 5, step, 0), logits, tokens], (1, 1, 1),
                         (256, 1, 1), random_schedule=random_schedule, seed=schedule_seed)
            picks.add(int(tokens[0]))
        assert len(picks) == 1, f"step {step}: tokens {picks} depend on the schedule"


# The block path (sample_partial + sample_final; tuning::sample_block_path sends every request but top_k above the
# candidates there): vocabularies of several blocks, the last one short.
BLOCK = 128


def assert_passed(run: Run) -> None:
    """The checks run_sample* made (slots around out_index untouched)."""
    failed = [f"{c.what}: {c.detail}" for c in run.comparisons if not c.passed]
    assert not failed, failed


def block_logits(vocab: int = 600) -> np.ndarray:
    """Eight plausible tokens spread over the blocks, a tail far below them and some banned (-inf) tokens."""
    x = np.full(vocab, -12.0, np.float32)
    x[np.random.default_rng(3).choice(vocab, vocab // 5, replace=False)] = -np.inf
    head = np.linspace(5, vocab - 7, 8).astype(int)
    x[head] = [2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0]
    return x


@pytest.mark.parametrize("top_k,top_p,min_p", [(6, 0.9, 0.0), (0, 1.0, 0.0), (64, 0.95, 0.05), (0, 0.9, 0.0),
                                             (0, 1.0, 0.02)])
def test_sample_distribution_of_the_block_path(kernel_device, top_k, top_p, min_p) -> None:
    """Chi-square of 2000 draws of the block path against lily.sampling's filtered distribution (the tail is kept by
    plain temperature sampling: it holds ~4e-5 of the mass in ~470 tokens, pooled into one bin). Named like
    test_sample_distribution, so tests/test_cuda_driver.py's subset skips it with that slow test."""
    logits = block_logits()
    temperature = 0.9
    x = logits.astype(np.float64) / temperature
    keep = top_k_mask(x, top_k)
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    keep &= top_p_mask(probs, top_p) & (probs >= min_p * probs.max())
    expected = np.where(keep, probs, 0.0) / probs[keep].sum()
    draws = 2000
    run = Run(kernel_device, np.random.default_rng(0))
    got = [run_sample_blocks(run, "f32", logits, BLOCK, 32, 64, temperature, top_k, top_p, min_p, 2024, s)
           for s in range(draws)]
    counts = np.bincount(got, minlength=logits.size)
    assert (counts[~keep] == 0).all(), f"filtered tokens drawn: {np.flatnonzero(counts * ~keep)}"
    head = expected * draws >= 5
    observed = np.append(counts[head], counts[~head].sum())
    e = np.append(expected[head] * draws, expected[~head].sum() * draws)
    if e[-1] < 5:  # the pooled rare tokens join the least likely bin, so every bin expects >= 5 draws
        least = int(np.argmin(e[:-1]))
        observed[least] += observed[-1]
        e[least] += e[-1]
        observed, e = observed[:-1], e[:-1]
    chi2 = float(((observed - e) ** 2 / e).sum())
    # 99.9th percentile of chi-square with <= 8 degrees of freedom is 26.1.
    assert chi2 < 26.1, f"chi2 {chi2:.1f}; counts {observed.tolist()}, expected {np.round(e).tolist()}"
    assert_passed(run)


@pytest.mark.parametrize("params", [(0.7, 50, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 1, 1.0, 0.0), (1.2, 64, 1.0, 0.1),
                                    (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.9, 150, 0.95, 0.0)])
def test_block_path_agrees_with_the_general_path(kernel_device, params) -> None:
    """Fresh random logits (a tenth -inf) over 5 blocks, 30 seeds x steps: the block path picks sample_f32's token
    unless the draw is near a rounding boundary (then both must be among lily.sampling's nudged answers)."""
    temperature, top_k, top_p, min_p = params
    rng = np.random.default_rng(8)
    values = 3.0 * rng.standard_normal(4 * 512 + 300)
    values[rng.choice(values.size, values.size // 10, replace=False)] = -np.inf
    logits = to_device(values, "f32")
    x32 = (to_f64(logits, "f32").astype(np.float32) / np.float32(temperature)).astype(np.float32)
    run = Run(kernel_device, np.random.default_rng(0))
    disagree = 0
    for step in range(30):
        seed = int(rng.integers(0, 2**63))
        fast = run_sample_blocks(run, "f32", logits, 512, 32, 128, temperature, top_k, top_p, min_p, seed, step)
        general = run_sample(run, "sample_f32", logits, 256, temperature, top_k, top_p, min_p, seed, step)
        allowed = acceptable_tokens(x32, top_k, top_p, min_p, philox_uniform(seed, step))
        assert fast in allowed and general in allowed, (step, fast, general, allowed)
        disagree += fast != general
        assert fast == general or len(allowed) > 1, (step, fast, general)
    assert disagree <= 2
    assert_passed(run)


@pytest.mark.parametrize("penalty", [{"presence_penalty": 0.8, "repetition_penalty": 1.3}, {"frequency_penalty": 0.6}])
def test_penalized_block_path(kernel_device, penalty) -> None:
    """The decode step's penalized chain: penalize_logits_f32, then the block path over its fp32 output (top-k 20 and
    plain temperature): the same tokens as sample_f32 over the same processed logits, and as lily.sampling."""
    rng = np.random.default_rng(9)
    vocab = 3 * BLOCK + 77
    logits = to_device(2.0 * rng.standard_normal(vocab), "f32")
    context = rng.integers(0, vocab, 30).tolist()
    generated = rng.integers(0, vocab // 4, 40).tolist()
    params = SamplingParams(temperature=0.8, **penalty)
    run = Run(kernel_device, np.random.default_rng(1))
    processed = run_penalize(run, "penalize_logits_f32", logits, 32, params, context, generated)
    x32 = (processed_reference(logits.astype(np.float64), params, context, generated)
           .astype(np.float32) / np.float32(params.temperature)).astype(np.float32)
    for top_k in (20, 0):
        for step in range(12):
            fast = run_sample_blocks(run, "f32", processed, BLOCK, 32, 64, params.temperature, top_k, 1.0, 0.0, 4, step)
            general = run_sample(run, "sample_f32", processed, 64, params.temperature, top_k, 1.0, 0.0, 4, step)
            allowed = acceptable_tokens(x32, top_k, 1.0, 0.0, philox_uniform(4, step))
            assert fast in allowed and (fast == general or len(allowed) > 1), (top_k, step, fast, general, allowed)
    assert_passed(run)


def test_block_path_independent_of_schedule() -> None:
    """Fixed-order sums and integer atomics only: FIFO and random fiber schedules pick the same tokens."""
    rng = np.random.default_rng(6)
    logits = rng.standard_normal(3000).astype(np.float32) * 2.0
    for top_k, top_p, min_p in ((50, 0.9, 0.02), (0, 1.0, 0.0), (0, 0.9, 0.0)):
        args = sample_args(3000, 0.9, top_k, top_p, min_p, 5, 1, 0, 512)
        picks = set()
        for schedule_seed, random_schedule in ((0, False), (1, True), (2, True)):
            scratch = list(block_scratch(3000, 512))
            tokens = np.full(1, MASK32, np.uint32)
            msl.dispatch("sample_partial_f32", [args, logits, *scratch], (6, 1, 1), (64, 1, 1),
                         random_schedule=random_schedule, seed=schedule_seed)
            msl.dispatch("sample_final_f32", [args, logits, *scratch, tokens], (1, 1, 1), (128, 1, 1),
                         random_schedule=random_schedule, seed=schedule_seed)
            picks.add(int(tokens[0]))
        assert len(picks) == 1, f"top_k {top_k} top_p {top_p}: tokens {picks} depend on the schedule"
