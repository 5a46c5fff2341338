"""The GPU token choice of the metal engine against the CPU sampler (lily.sampling), feature by feature.

Each draw is the engine's own path for a decode's first token: logits uploaded, the choice dispatched (argmax,
sample_f32 for top_k above the block path's candidates, else the block path sample_partial_f32 + sample_final_f32, after
penalize_logits for a logit bias or a repetition penalty over the context: exactly the dispatches
ending every decode step), the token id read back. Presence and frequency act from the second token on: their draws
are tested on the kernel pair in tests/kernels/test_sampling.py, their tokens over whole decodes in test_gpu_decode.py. The draws are tested with a
chi-square goodness-of-fit against the distribution lily.sampling.Sampler draws from (computed in float64), over
logits with a dozen plausible tokens and a long tail. 400 draws per feature (the harness runs the
1024-thread sample kernel's radix passes as fibers: tens of ms a draw); p < 1e-3 fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from lily import Model
from lily.backends.engine import token_choice
from lily.sampling import Sampler, SamplingParams, min_p_mask, top_k_mask, top_p_mask

DRAWS = 400


@pytest.fixture(scope="module")
def engine():
    model = Model.load("lily:demo", backend="metal", precision="float32", progress=False)
    return model.backend._engine, model.config.vocab_size


@pytest.fixture(scope="module")
def logits(engine) -> np.ndarray:
    _, vocab = engine
    x = np.full(vocab, -40.0, dtype=np.float32)
    head = np.random.default_rng(11).permutation(vocab)[:12]
    x[head] = np.array([3.0, 2.6, 2.5, 2.5, 2.0, 1.7, 1.5, 1.2, 1.0, 0.5, 0.4, 0.0], dtype=np.float32)
    return x


def cpu_distribution(x: np.ndarray, params: SamplingParams, context: list[int] = ()) -> np.ndarray:
    """The probabilities Sampler draws its first token from (steps 1-6 of lily.sampling), in float64."""
    z = Sampler(params, context=context).process(x) / params.temperature
    keep = top_k_mask(z, params.top_k)
    z = np.where(keep, z, -np.inf)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep &= top_p_mask(probs, params.top_p)
    if params.min_p > 0.0:
        keep &= min_p_mask(probs, params.min_p)
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def gpu_draws(engine, x: np.ndarray, params: SamplingParams, draws: int = DRAWS, context: list[int] = ()) -> np.ndarray:
    e, vocab = engine
    counts = np.zeros(vocab, dtype=np.int64)
    bias = params.logit_bias or {}
    for seed in range(draws):
        e.begin_decode(x, token_choice(params, seed), bias_ids=list(bias), bias_values=list(bias.values()),
                       context=list(context))
        counts[e.next_token()] += 1
        e.end_decode()
    return counts


def fit_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of `counts` under `probs`; a draw of a token `probs` excludes fails outright."""
    assert counts[probs == 0].sum() == 0, f"drew excluded tokens {np.flatnonzero(counts * (probs == 0))}"
    expected = probs * counts.sum()
    bins = expected >= 5  # pool the rare tokens into one bin
    observed = np.append(counts[bins], counts[~bins].sum())
    expected = np.append(expected[bins], expected[~bins].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue)


FEATURES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.3, min_p=0.25),
    "all": SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_gpu_draws_follow_the_cpu_sampler(engine, logits, feature):
    params = FEATURES[feature]
    counts = gpu_draws(engine, logits, params)
    assert fit_pvalue(counts, cpu_distribution(logits, params)) > 1e-3


@pytest.mark.parametrize("feature", ["logit_bias", "repetition_penalty"])
def test_penalized_gpu_draws_follow_the_cpu_sampler(engine, logits, feature):
    """The two likeliest tokens pushed down (a bias, or the repetition penalty over a context holding them), one of
    the tail raised by a bias: the draws follow the processed distribution, not the raw one."""
    head = np.argsort(-logits, kind="stable")
    context = [int(head[0]), int(head[1]), 7]
    if feature == "logit_bias":
        params = SamplingParams(temperature=1.0, top_k=10, logit_bias={context[0]: -1.5, context[1]: -0.5,
                                                                         int(head[30]): 43.0})
    else:
        params = SamplingParams(temperature=1.0, top_k=10, repetition_penalty=2.0)
    counts = gpu_draws(engine, logits, params, context=context)
    assert fit_pvalue(counts, cpu_distribution(logits, params, context)) > 1e-3
    raw = cpu_distribution(logits, SamplingParams(temperature=1.0, top_k=10))
    if counts[raw == 0].sum() == 0:  # else the raw distribution excludes a token drawn: rejected already
        assert fit_pvalue(counts, raw) < 1e-3


def test_the_fit_rejects_a_wrong_distribution(engine, logits):
    """Power: draws with top-k 5 do not pass as draws with top-k 3 (tokens it excludes) or at temperature 0.5."""
    counts = gpu_draws(engine, logits, FEATURES["top_k"], draws=DRAWS)
    with pytest.raises(AssertionError, match="excluded"):
        fit_pvalue(counts, cpu_distribution(logits, SamplingParams(temperature=1.0, top_k=3)))
    assert fit_pvalue(counts, cpu_distribution(logits, SamplingParams(temperature=0.5, top_k=5))) < 1e-3


def test_greedy_choice_and_a_fixed_seed(engine, logits):
    e, _ = engine
    e.begin_decode(logits, token_choice(SamplingParams(temperature=0.0), seed=0))
    assert e.next_token() == int(np.argmax(logits))
    e.end_decode()
    params = FEATURES["all"]
    runs = [gpu_draws(engine, logits, params, draws=40) for _ in range(2)]
    assert np.array_equal(runs[0], runs[1])
