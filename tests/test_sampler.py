"""lily.sampling against plain-loop reference implementations written here, on fixed random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily.sampling import (
    Sampler,
    SamplingParams,
    StopStringMatcher,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    log_softmax,
    min_p_mask,
    top_k_mask,
    top_p_mask,
)

# ---- reference implementations: loops over Python floats -------------------------------------


def ref_log_softmax(logits):
    finite = [x for x in logits if x != -math.inf]
    m = max(finite)
    total = sum(math.exp(x - m) for x in finite)
    return [x - m - math.log(total) if x != -math.inf else -math.inf for x in logits]


def ref_processed(logits, params: SamplingParams, context, generated):
    out = [float(x) for x in logits]
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    history = list(context) + list(generated)
    if params.repetition_context_size is not None:
        history = history[-params.repetition_context_size:]
    for token in set(history):
        if out[token] > 0:
            out[token] /= params.repetition_penalty
        else:
            out[token] *= params.repetition_penalty
    for token in set(generated):
        count = sum(1 for t in generated if t == token)
        out[token] -= params.presence_penalty + params.frequency_penalty * count
    return out


def ref_distribution(logits, params: SamplingParams, context=(), generated=()):
    """Final sampling probabilities, the way the module docstring describes them."""
    x = [v / params.temperature for v in ref_processed(logits, params, context, generated)]
    n = len(x)
    keep = [True] * n
    if 0 < params.top_k < n:
        kth = sorted(x, reverse=True)[params.top_k - 1]
        keep = [v >= kth for v in x]
    lp = ref_log_softmax([v if k else -math.inf for v, k in zip(x, keep)])
    probs = [math.exp(v) if k else 0.0 for v, k in zip(lp, keep)]
    if params.top_p < 1:
        order = sorted(range(n), key=lambda i: (-probs[i], i))
        mass = 0.0
        nucleus = set()
        for i in order:
            if mass < params.top_p and probs[i] > 0:
                nucleus.add(i)
            mass += probs[i]
        keep = [k and i in nucleus for i, k in enumerate(keep)]
    if params.min_p > 0:
        top = max(probs)
        keep = [k and probs[i] >= params.min_p * top for i, k in enumerate(keep)]
    kept = [p if k else 0.0 for p, k in zip(probs, keep)]
    total = sum(kept)
    return [p / total for p in kept]


def fixed_logits(seed: int, vocab: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, size=vocab).astype(np.float32)


# ---- single processors ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_processors_match_loops(seed):
    rng = np.random.default_rng(100 + seed)
    logits = fixed_logits(seed, 50)
    context = rng.integers(0, 50, size=30).tolist()
    generated = rng.integers(0, 50, size=12).tolist()
    penalty = float(rng.uniform(1.05, 2.0))
    got = apply_repetition_penalty(logits.astype(np.float64), context, penalty)
    params = SamplingParams(repetition_penalty=penalty)
    np.testing.assert_allclose(got, ref_processed(logits, params, context, []), rtol=1e-12)
    got = apply_presence_frequency_penalty(logits.astype(np.float64), generated, 0.7, 0.3)
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3)
    np.testing.assert_allclose(got, ref_processed(logits, params, [], generated), rtol=1e-12)
    np.testing.assert_allclose(log_softmax(logits), ref_log_softmax(logits.tolist()), atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 5, 23, 24, 100])
def test_top_k_keeps_ties_and_k_largest(k):
    logits = fixed_logits(1)
    logits[3] = logits[7] = np.sort(logits)[-min(k, 24)]  # a tie exactly at the k-th value
    kth = sorted(logits.tolist(), reverse=True)[min(k, 24) - 1]
    expected = [v >= kth for v in logits.tolist()]
    assert top_k_mask(logits, k).tolist() == expected


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_min_p_masks(p):
    probs = np.exp(log_softmax(fixed_logits(2)))
    order = sorted(range(24), key=lambda i: -probs[i])
    mass, expected = 0.0, set()
    for i in order:
        if mass < p:
            expected.add(i)
        mass += probs[i]
    assert set(np.flatnonzero(top_p_mask(probs, p)).tolist()) == expected
    expected_min = {i for i in range(24) if probs[i] >= p * probs.max()}
    assert set(np.flatnonzero(min_p_mask(probs, p)).tolist()) == expected_min


def test_greedy_is_argmax_of_processed_logits():
    for seed in range(10):
        logits = fixed_logits(seed, 64)
        bias = {int(np.argmax(logits)): -5.0, 3: 4.0}
        params = SamplingParams(temperature=0, logit_bias=bias, repetition_penalty=1.3, presence_penalty=0.5)
        sampler = Sampler(params, context=[1, 2, 3])
        for _ in range(4):
            before = list(sampler.generated)
            token, _, _ = sampler.sample(logits)
            ref = ref_processed(logits, params, [1, 2, 3], before)
            assert token == int(np.argmax(ref))


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = fixed_logits(5, 40)
    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={2: 3.0}, frequency_penalty=0.4,
                            logprobs=True, top_logprobs=6, seed=1)
    sampler = Sampler(params, context=[])
    for _ in range(5):
        before = list(sampler.generated)
        token, logprob, top = sampler.sample(logits)
        ref = ref_log_softmax(ref_processed(logits, params, [], before))
        assert logprob == pytest.approx(ref[token], abs=1e-9)
        ranked = sorted(range(40), key=lambda i: -ref[i])[:6]
        assert [t for t, _ in top] == ranked
        assert [lp for _, lp in top] == pytest.approx([ref[i] for i in ranked], abs=1e-9)


# ---- distributions ------------------------------------------------------------------------------

CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=0.8, top_k=6),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.5, min_p=0.2),
    "all": dict(temperature=0.9, top_k=10, top_p=0.9, min_p=0.02, logit_bias={0: 2.0},
                repetition_penalty=1.5, repetition_context_size=4, presence_penalty=0.3,
                frequency_penalty=0.2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampling_distribution_chi_square(case):
    """Empirical frequencies of many draws agree with the loop reference distribution."""
    logits = fixed_logits(11, 16)
    params = SamplingParams(seed=1234, **CASES[case])
    context, generated = [0, 1, 5, 5, 9], [5, 9, 9]
    expected = ref_distribution(logits.tolist(), params, context, generated)
    sampler = Sampler(params, context=context)
    draws = 10000
    counts = np.zeros(16)
    for _ in range(draws):
        sampler.generated = list(generated)
        counts[sampler.sample(logits)[0]] += 1
    support = [i for i in range(16) if expected[i] > 0]
    assert all(counts[i] == 0 for i in range(16) if expected[i] == 0), "sampled a truncated token"
    chi2 = sum((counts[i] - draws * expected[i]) ** 2 / (draws * expected[i]) for i in support)
    dof = max(len(support) - 1, 1)
    # Generous bound: mean dof, sd sqrt(2 dof); 6 sd is far beyond chance with a fixed seed.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_same_seed_same_tokens_and_own_generator():
    logits = fixed_logits(3, 100)
    params = dict(temperature=1.0, top_p=0.95)

    def run(seed):
        s = Sampler(SamplingParams(seed=seed, **params))
        return [s.sample(logits)[0] for _ in range(50)]

    first = run(7)
    np.random.seed(0)  # the global generator must not matter
    assert run(7) == first
    assert run(8) != first


# ---- stop strings -------------------------------------------------------------------------------


def _run_matcher(stop, pieces):
    matcher = StopStringMatcher(stop)
    emitted = []
    for piece in pieces:
        emitted.append(matcher.feed(piece))
        if matcher.stopped:
            break
    emitted.append(matcher.flush())
    return emitted, matcher.stopped


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab<>x", max_size=40),
       stop=st.lists(st.text(alphabet="ab<>", min_size=1, max_size=5), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_across_boundaries_never_leak(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    # The first stop string to be completed wins; on a tie, the one that starts first.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    expected = text[: min(hits)[1]] if hits else text
    emitted, stopped = _run_matcher(stop, pieces)
    assert "".join(emitted) == expected
    assert stopped == bool(hits)
    shown = ""
    for part in emitted:
        shown += part
        assert expected.startswith(shown)
        assert not any(s in shown for s in stop)


def test_stop_string_held_back_until_disproved():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("hello </e") == "hello "
    assert matcher.feed("nx") == "</enx"
    assert matcher.feed("</en") == ""
    assert matcher.feed("d> tail") == ""
    assert matcher.stopped


# ---- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("presence_penalty", float("inf")), ("seed", 1.5), ("top_logprobs", -1), ("stop", [""]),
    ("logit_bias", {-1: 1.0}),
])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logit_bias_beyond_vocab_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={50: 1.0}).validate(vocab_size=50)
