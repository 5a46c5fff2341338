"""metal/sampling.metal through the CPU harness: greedy argmax (exact) and seeded sampling.

Sampling is compared with lily.sampling's filters (top_k_mask, top_p_mask, min_p_mask) and its draw rule (first id
whose cumulative kept probability exceeds u * total) in float64, fed with the kernel's Philox4x32-10 number u. The
kernel works in fp32, so a draw is required to match exactly unless nudging top_p or min_p by 1e-5 (relative) or u
by 2e-6 changes the float64 answer; such near-boundary draws must be rare and must match one of the nudged answers.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cases import check, op_cases

from lily._ext import msl
from lily.sampling import log_softmax, min_p_mask, top_k_mask, top_p_mask

DTYPES = ["f32", "bf16"]
PARTIAL = {"f32": "argmax_partial_f32", "bf16": "argmax_partial_bf16"}
SAMPLE = {"f32": "sample_f32", "bf16": "sample_bf16"}
MASK32 = 0xFFFFFFFF


def argmax_args(vocab: int, block: int, num_partials: int, out_index: int) -> bytes:
    """lily::ArgmaxArgs (metal/lily.h)."""
    return struct.pack("<IIII", vocab, block, num_partials, out_index)


def sample_args(vocab: int, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int,
                out_index: int) -> bytes:
    """lily::SampleArgs (metal/lily.h): 48 bytes."""
    return struct.pack("<IIfffIIIIIII", vocab, top_k, temperature, top_p, min_p, seed & MASK32, seed >> 32, step,
                       out_index, 0, 0, 0)


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al. 2011) in Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c3 ^ k1) & MASK32, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, step: int) -> float:
    return (philox4x32_10((step, 0, 0, 0), (seed & MASK32, seed >> 32))[0] >> 8) * 2.0**-24


def test_philox_known_answers() -> None:
    """Random123's published known-answer vectors for philox4x32_10."""
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_10((MASK32,) * 4, (MASK32, MASK32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def expected_token(x32: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> int:
    """lily.sampling.Sampler.choose steps 5-6 on temperature-scaled logits, with the random number u given."""
    x = x32.astype(np.float64)
    keep = top_k_mask(x, top_k)
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    keep &= top_p_mask(probs, top_p)
    if min_p > 0.0:
        keep &= min_p_mask(probs, min_p)
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return token if token < x.size and keep[token] else int(np.flatnonzero(keep)[-1])


def acceptable_tokens(x32: np.ndarray, top_k: int, top_p: float, min_p: float, u: float) -> set[int]:
    """The float64 answer, and the answers with top_p / min_p nudged by 1e-5 and u by 2e-6 (fp32 sums' slack)."""
    top = 1 - 2.0**-24
    nudges = [(top_p, min_p, u)]
    nudges += [(min(1.0, top_p * (1 + s)), min_p * (1 + s), u) for s in (-1e-5, 1e-5)]
    nudges += [(top_p, min_p, min(max(u + s, 0.0), top)) for s in (-2e-6, 2e-6)]
    return {expected_token(x32, top_k, p, m, v) for p, m, v in nudges}


def run_argmax(logits: np.ndarray, dtype: str, block: int, threads: int, out_index: int = 0) -> int:
    vocab = logits.shape[0]
    num_partials = -(-vocab // block)
    values = np.full(num_partials, np.nan, np.float32)
    ids = np.full(num_partials, MASK32, np.uint32)
    tokens = np.full(out_index + 2, MASK32, np.uint32)
    msl.dispatch(PARTIAL[dtype], [argmax_args(vocab, block, num_partials, out_index), logits, values, ids],
                 (num_partials, 1, 1), (threads, 1, 1))
    msl.dispatch("argmax_final_f32", [argmax_args(vocab, block, num_partials, out_index), values, ids, tokens],
                 (1, 1, 1), (32 * min(32, -(-num_partials // 32) + 1), 1, 1))
    assert tokens[out_index + 1] == MASK32, "argmax_final wrote outside its slot"
    return int(tokens[out_index])


# (vocab, block, threads): one entry, one partial simdgroup, block boundaries 31/32/33 and 64/65, many partials.
ARGMAX_SHAPES = [(1, 64, 32), (31, 32, 32), (33, 32, 32), (64, 64, 64), (65, 64, 64), (1000, 96, 64), (5000, 256, 128)]


@pytest.mark.parametrize("vocab,block,threads", ARGMAX_SHAPES, ids=[f"v{v}-b{b}-t{t}" for v, b, t in ARGMAX_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(dtype: str, vocab: int, block: int, threads: int, kio) -> None:
    rng = np.random.default_rng(vocab + 7 * DTYPES.index(dtype))
    values = rng.standard_normal(vocab) * 4.0
    logits = kio.to_device(values, dtype)
    widened = kio.to_f64(logits, dtype)
    assert run_argmax(logits, dtype, block, threads, out_index=3) == int(np.argmax(widened))
    if vocab > 2:
        # A tie for the maximum in two different blocks, and -inf entries: the lowest id wins.
        high = widened.max() + 1.0
        tied = widened.copy()
        lo, hi = sorted(rng.choice(vocab, 2, replace=False))
        tied[[lo, hi]] = high
        tied[rng.choice(vocab, vocab // 3)] = -np.inf
        tied[[lo, hi]] = high
        assert run_argmax(kio.to_device(tied, dtype), dtype, block, threads) == lo


def test_argmax_nan_and_all_negative_infinity() -> None:
    logits = np.full(200, -np.inf, np.float32)
    assert run_argmax(logits, "f32", 64, 32) == 0
    logits[[150, 70]] = np.nan
    logits[10] = 5.0
    assert run_argmax(logits, "f32", 64, 32) == int(np.argmax(logits)) == 70


def run_sample(logits: np.ndarray, dtype: str, threads: int, temperature: float, top_k: int, top_p: float,
               min_p: float, seed: int, step: int, out_index: int = 1) -> int:
    tokens = np.full(out_index + 2, MASK32, np.uint32)
    msl.dispatch(SAMPLE[dtype],
                 [sample_args(logits.shape[0], temperature, top_k, top_p, min_p, seed, step, out_index), logits,
                  tokens],
                 (1, 1, 1), (threads, 1, 1), seed=step)
    assert tokens[out_index + 1] == MASK32 and tokens[out_index - 1] == MASK32, "sample wrote outside its slot"
    return int(tokens[out_index])


# (temperature, top_k, top_p, min_p): plain; Qwen's recommended settings; top-p + min-p; top-k only; a narrow
# nucleus; top_k >= vocab (off).
PARAMS = [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.95, 0.0), (1.0, 0, 0.9, 0.05), (1.5, 5, 1.0, 0.0), (0.8, 0, 0.5, 0.0),
          (1.0, 100000, 0.8, 0.1)]


@pytest.mark.parametrize("params", PARAMS, ids=[f"t{t}-k{k}-p{p}-m{m}" for t, k, p, m in PARAMS])
@pytest.mark.parametrize("vocab,threads", [(37, 32), (300, 64), (2000, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_matches_lily_sampling(dtype: str, vocab: int, threads: int, params, kio) -> None:
    temperature, top_k, top_p, min_p = params
    rng = np.random.default_rng(vocab + 13 * PARAMS.index(params) + 101 * DTYPES.index(dtype))
    logits = kio.to_device(rng.standard_normal(vocab) * 3.0, dtype)
    x32 = (kio.to_f64(logits, dtype).astype(np.float32) / np.float32(temperature)).astype(np.float32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    near_boundary = 0
    for step in range(12):
        u = philox_uniform(seed, step)
        got = run_sample(logits, dtype, threads, temperature, top_k, top_p, min_p, seed, step)
        allowed = acceptable_tokens(x32, top_k, top_p, min_p, u)
        near_boundary += len(allowed) > 1
        assert got in allowed, f"step {step}: got {got}, expected {sorted(allowed)} (u={u})"
    assert near_boundary <= 1


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.95])
def test_sample_top_p_with_ties(top_p: float) -> None:
    """Logits taking 4 values: the nucleus boundary falls inside a run of tied tokens (kept by lowest id)."""
    rng = np.random.default_rng(int(top_p * 100))
    logits = rng.choice([0.0, 0.5, 1.0, 1.5], 257).astype(np.float32)
    seed = 12345
    for step in range(10):
        u = philox_uniform(seed, step)
        got = run_sample(logits, "f32", 64, 1.0, 0, top_p, 0.0, seed, step)
        assert got in acceptable_tokens(logits, 0, top_p, 0.0, u), f"step {step}: got {got}"


def test_sample_top_k_with_ties_and_banned_tokens() -> None:
    """Top-k keeps every token tied with the k-th value; -inf tokens are never drawn."""
    logits = np.full(100, -np.inf, np.float32)
    logits[[3, 40, 41, 77, 90]] = [2.0, 1.0, 1.0, 1.0, 0.5]
    seen = {run_sample(logits, "f32", 32, 1.0, 2, 1.0, 0.0, 9, step) for step in range(60)}
    assert seen == {3, 40, 41, 77}


def test_sample_is_reproducible_and_varies_with_step(kio) -> None:
    rng = np.random.default_rng(4)
    logits = kio.to_device(rng.standard_normal(500), "bf16")
    first = [run_sample(logits, "bf16", 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    again = [run_sample(logits, "bf16", 64, 1.0, 0, 1.0, 0.0, 77, step) for step in range(8)]
    other_seed = [run_sample(logits, "bf16", 64, 1.0, 0, 1.0, 0.0, 78, step) for step in range(8)]
    assert first == again
    assert len(set(first)) > 1 and first != other_seed


def test_sample_distribution() -> None:
    """Chi-square of 3000 draws (steps 0..2999) against the filtered distribution of lily.sampling."""
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    temperature, top_k, top_p = 0.9, 6, 0.9
    x = logits / np.float32(temperature)
    keep = top_k_mask(x.astype(np.float64), top_k)
    probs = np.exp(log_softmax(np.where(keep, x.astype(np.float64), -np.inf)))
    keep &= top_p_mask(probs, top_p)
    expected = np.where(keep, probs, 0.0) / probs[keep].sum()
    draws = 3000
    counts = np.bincount([run_sample(logits, "f32", 32, temperature, top_k, top_p, 0.0, 2024, s) for s in range(draws)],
                         minlength=logits.size)
    assert (counts[~keep] == 0).all(), f"filtered tokens drawn: {counts}"
    e = expected[keep] * draws
    chi2 = float(((counts[keep] - e) ** 2 / e).sum())
    # 99.9th percentile of chi-square with (kept - 1) <= 4 degrees of freedom is 18.5.
    assert chi2 < 18.5, f"chi2 {chi2:.1f}; counts {counts.tolist()}, expected {np.round(e).tolist()}"


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


@pytest.mark.parametrize("case", op_cases("sampling"))
def test_sampling_cases(case, kernel_device) -> None:
    """Every case of lily.kernel_cases.sampling: the self-test's, on this session's device."""
    check(case, kernel_device)
