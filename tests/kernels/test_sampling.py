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
from lily.kernel_cases.common import Run, to_device
from lily.kernel_cases.sampling import (MASK32, philox4x32_10, processed_reference, run_penalize, run_sample,
                                        sample_args)
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
    logits = to_device(run.rng.standard_normal(500), "bf16")
    first = [run_sample(run, "sample_bf16", logits, 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    again = [run_sample(run, "sample_bf16", logits, 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    other_seed = [run_sample(run, "sample_bf16", logits, 64, 1.0, 0, 1.0, 0.0, 78, step) for step in range(8)]
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
