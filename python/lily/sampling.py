"""Logits processors, samplers and stop-string matching, in plain numpy.

The processing order for one decode step is fixed and documented here, because it decides what
every knob means:

1. ``logit_bias`` is added (OpenAI semantics; -100 effectively bans a token).
2. ``repetition_penalty`` (HF / llama.cpp): for every distinct token of the context (prompt and
   generated tokens, or the last ``repetition_context_size`` of them), a positive logit is divided
   by the penalty and a negative one multiplied by it.
3. ``presence_penalty`` / ``frequency_penalty`` (OpenAI): over the *generated* tokens only,
   ``logit -= presence * (count > 0) + frequency * count``.

   The log-softmax of these processed logits is what ``logprobs`` / ``top_logprobs`` report: the
   model's distribution after the user's explicit adjustments, before temperature and truncation
   (so it does not depend on the sampling temperature and never contains -inf from truncation).
4. ``temperature``: 0 means greedy (argmax, lowest id on ties); otherwise logits are divided by it.
5. Truncation, in this order: ``top_k`` (keep every token whose logit reaches the k-th largest),
   ``top_p`` (nucleus over the distribution left by top-k: keep the smallest head whose mass
   reaches ``top_p``), ``min_p`` (keep tokens whose probability is at least ``min_p`` times the
   largest probability).
6. A token is drawn from the softmax of what is left with the decode call's own
   ``numpy.random.Generator``, so the same seed gives the same tokens.

Every entry point (``Model.generate``/``Model.chat``/``Session.decode``, ``lily generate``/``lily chat``, the
server) builds one ``SamplingParams`` per request with ``sampling_params`` and hands that object down; its
``__post_init__`` checks each field with one rule and one message (``SamplingParamError`` names the field).
Defaults, the same for every entry point:
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` come from the checkpoint's
``generation_config.json`` when it sets them (``generation_defaults``), else from ``SamplingParams``
(1.0, 1.0, 0, 0.0, 1.0). ``stop_token_ids=None`` stops on the model's end tokens. ``max_tokens`` is ``DEFAULT_MAX_TOKENS`` (256, as mlx_lm) for text
continuations and ``DEFAULT_CHAT_MAX_TOKENS`` (or the model's context, if smaller) for chats, whose
reasoning comes first; the server follows the OpenAI API instead: an omitted ``max_tokens`` means up
to the end of the context. A ``max_tokens`` above the model's context is an error everywhere; one
that does not fit after the prompt ends the generation at the context's end (finish reason "length").
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_CHAT_MAX_TOKENS",
    "GENERATION_CONFIG_KEYS",
    "SamplingParams",
    "SamplingParamError",
    "sampling_params",
    "generation_defaults",
    "Sampler",
    "StopStringMatcher",
    "apply_logit_bias",
    "apply_repetition_penalty",
    "apply_presence_frequency_penalty",
    "log_softmax",
    "top_k_mask",
    "top_p_mask",
    "min_p_mask",
]


DEFAULT_MAX_TOKENS = 256
DEFAULT_CHAT_MAX_TOKENS = 4096
#: the sampling fields a checkpoint's generation_config.json may set
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: Mapping[str, object] | None) -> dict[str, float]:
    """The sampling defaults a checkpoint's generation_config.json sets (values out of range are
    ignored, as a bad file must not stop a model from loading)."""
    defaults: dict[str, float] = {}
    for name in GENERATION_CONFIG_KEYS:
        value = (generation_config or {}).get(name)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError):
            continue
        defaults[name] = value  # type: ignore[assignment]
    return defaults


class SamplingParamError(ValueError):
    """A sampling parameter out of range: ``field`` names it, ``expected`` says what it takes, ``value`` is what
    it got; the message is "<field> must be <expected>; got <value>", the same from every entry point."""

    def __init__(self, name: str, expected: str, value: object) -> None:
        super().__init__(f"{name} must be {expected}; got {value!r}")
        self.field = name
        self.expected = expected
        self.value = value


@dataclass
class SamplingParams:
    """Every per-request generation knob, with OpenAI names; each field is checked when the object is made
    (``SamplingParamError`` names the first one out of range), and ``validate`` checks it against a model.

    ``max_tokens=None`` means "until a stop token, a stop string or the end of the context".
    ``top_k=0``, ``top_p=1``, ``min_p=0``, ``repetition_penalty=1`` and zero presence/frequency
    penalties switch the corresponding step off. ``stop_token_ids=None`` stops on the model's end tokens.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        _check(self.stop is None or (isinstance(self.stop, Sequence) and all(isinstance(s, str) for s in self.stop)),
               "stop", "a string or a list of strings", self.stop)
        self.stop = tuple(self.stop or ())
        _check(self.stop_token_ids is None or (isinstance(self.stop_token_ids, Sequence)
                                               and all(_is_int(t) for t in self.stop_token_ids)),
               "stop_token_ids", "a list of token ids", self.stop_token_ids)
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        _check(self.logit_bias is None or isinstance(self.logit_bias, Mapping), "logit_bias",
               "a mapping of token ids to biases", self.logit_bias)
        self.logit_bias = {_token_key(k): v for k, v in (self.logit_bias or {}).items()}
        self.validate()

    def validate(self, vocab_size: int | None = None, context: int | None = None) -> None:
        """Raise ``SamplingParamError`` naming the first field out of range, checked against a model's
        ``vocab_size`` and ``context`` where given (prompt and answer share it, so no answer can be longer)."""
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1 or None", self.max_tokens)
        _check(self.max_tokens is None or context is None or self.max_tokens <= context, "max_tokens",
               f"at most the model's context of {context} tokens (prompt and answer share it)", self.max_tokens)
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               "temperature", "a finite number >= 0", self.temperature)
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)",
               self.top_k)
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", "a finite number > 0 (1 = off)", self.repetition_penalty)
        _check(self.repetition_context_size is None
               or (_is_int(self.repetition_context_size) and self.repetition_context_size >= 1),
               "repetition_context_size", "an integer >= 1 or None", self.repetition_context_size)
        _check(_is_finite(self.presence_penalty), "presence_penalty", "a finite number",
               self.presence_penalty)
        _check(_is_finite(self.frequency_penalty), "frequency_penalty", "a finite number",
               self.frequency_penalty)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "non-empty strings", self.stop)
        _check(isinstance(self.logprobs, bool), "logprobs", "a boolean", self.logprobs)
        _check(_is_int(self.top_logprobs) and self.top_logprobs >= 0, "top_logprobs",
               "an integer >= 0", self.top_logprobs)
        for token, bias in self.logit_bias.items():
            _check(_is_finite(bias), "logit_bias", "finite biases", {token: bias})
            _check(token >= 0 and (vocab_size is None or token < vocab_size), "logit_bias",
                   f"token ids in [0, {vocab_size})" if vocab_size else "token ids >= 0", token)
        if vocab_size is not None:
            _check(self.top_logprobs <= vocab_size, "top_logprobs",
                   f"at most the vocabulary size {vocab_size}", self.top_logprobs)


_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(options: Mapping[str, Any], defaults: Mapping[str, Any] = MappingProxyType({})) -> SamplingParams:
    """The one place sampling options become a ``SamplingParams`` and defaults apply: an option left out (or None,
    for a ``GENERATION_CONFIG_KEYS`` field) takes ``defaults``' value (an entry point's: the checkpoint's
    generation_config.json values, its own ``max_tokens``), else the field's own. Raises TypeError for an unknown
    option (naming the closest field) and ``SamplingParamError`` for a value out of range."""
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _FIELDS, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}{hint}")
    given = {name: value for name, value in options.items()
             if not (value is None and name in GENERATION_CONFIG_KEYS)}
    return SamplingParams(**{**defaults, **given})


def _token_key(key: object) -> int:
    """A logit_bias key: a token id, or its decimal string (as JSON objects send it)."""
    if _is_int(key):
        return int(key)  # type: ignore[arg-type]
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        try:
            return int(key)
        except ValueError:  # more than one sign, or more digits than int() reads
            pass
    raise SamplingParamError("logit_bias", "a mapping whose keys are token ids (integers)", key)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    if not isinstance(x, (int, float, np.number)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise SamplingParamError(name, expected, got)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a [V] vector, in float64 for exact-looking logprobs."""
    x = logits.astype(np.float64)
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def apply_logit_bias(logits: np.ndarray, logit_bias: Mapping[int, float]) -> np.ndarray:
    """Add a bias to the listed token ids (returns a new array)."""
    out = logits.copy()
    for token, bias in logit_bias.items():
        out[token] += bias
    return out


def apply_repetition_penalty(logits: np.ndarray, context: Iterable[int], penalty: float) -> np.ndarray:
    """HF / llama.cpp repetition penalty over the distinct tokens of ``context``."""
    ids = np.unique(np.fromiter(context, dtype=np.int64))
    out = logits.copy()
    if penalty == 1.0 or ids.size == 0:
        return out
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def apply_presence_frequency_penalty(logits: np.ndarray, generated: Sequence[int], presence: float,
                                     frequency: float) -> np.ndarray:
    """OpenAI presence/frequency penalties over the generated tokens."""
    out = logits.copy()
    if (presence == 0.0 and frequency == 0.0) or len(generated) == 0:
        return out
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    out[ids] -= presence + frequency * counts
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Boolean [V] mask of the tokens top-k keeps (ties with the k-th value are kept)."""
    if k <= 0 or k >= logits.size:
        return np.ones(logits.shape, dtype=bool)
    kth = np.partition(logits, logits.size - k)[logits.size - k]
    return logits >= kth


def top_p_mask(probs: np.ndarray, p: float) -> np.ndarray:
    """Boolean [V] mask of the nucleus: a token is kept if the mass strictly before it is < p."""
    if p >= 1.0:
        return probs > 0
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    mask = np.zeros(probs.shape, dtype=bool)
    mask[order[before < p]] = True
    return mask & (probs > 0) | (np.arange(probs.size) == order[0])


def min_p_mask(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Boolean [V] mask of tokens whose probability is at least ``min_p`` times the largest."""
    return probs >= min_p * probs.max()


def _softmax(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits))


class Sampler:
    """Chooses tokens for one decode call: owns its random generator and the generated tokens.

    ``context`` is the token history the repetition penalty sees (the prompt, normally).
    """

    def __init__(self, params: SamplingParams, context: Sequence[int] = ()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.context = list(context)
        self.generated: list[int] = []

    def process(self, logits: np.ndarray) -> np.ndarray:
        """Steps 1-3 of the module docstring: bias and penalties (float64 [V])."""
        p = self.params
        x = logits.astype(np.float64)
        if p.logit_bias:
            x = apply_logit_bias(x, p.logit_bias)
        if p.repetition_penalty != 1.0:
            history = self.context + self.generated
            if p.repetition_context_size is not None:
                history = history[-p.repetition_context_size:]
            x = apply_repetition_penalty(x, history, p.repetition_penalty)
        x = apply_presence_frequency_penalty(x, self.generated, p.presence_penalty,
                                             p.frequency_penalty)
        return x

    def choose(self, processed: np.ndarray) -> int:
        """Steps 4-6: greedy or temperature + truncation + a random draw."""
        p = self.params
        if p.temperature == 0.0:
            return int(np.argmax(processed))
        x = processed / p.temperature
        keep = top_k_mask(x, p.top_k)
        x = np.where(keep, x, -np.inf)
        probs = _softmax(x)
        keep &= top_p_mask(probs, p.top_p)
        if p.min_p > 0.0:
            keep &= min_p_mask(probs, p.min_p)
        probs = np.where(keep, probs, 0.0)
        cdf = np.cumsum(probs)
        u = self.rng.random() * cdf[-1]
        token = int(np.searchsorted(cdf, u, side="right"))
        # Guard the float edge u == cdf[-1]: fall back to the last kept token.
        return token if token < probs.size and keep[token] else int(np.flatnonzero(keep)[-1])

    def sample(self, logits: np.ndarray) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """Pick the next token from raw [V] logits and record it as generated.

        Returns ``(token, logprob, top_logprobs)``; the last two are ``None`` unless asked for.
        """
        processed = self.process(logits)
        token = self.choose(processed)
        self.generated.append(token)
        logprob = top = None
        if self.params.logprobs or self.params.top_logprobs:
            lp = log_softmax(processed)
            logprob = float(lp[token])
            if self.params.top_logprobs:
                k = self.params.top_logprobs
                best = np.argsort(-lp, kind="stable")[:k]
                top = [(int(t), float(lp[t])) for t in best]
        return token, logprob, top


class StopStringMatcher:
    """Finds stop strings across token boundaries without ever emitting any part of one.

    Feed text deltas; each call returns the text that is safe to show. Text that could still be
    the start of a stop string is held back until it is disproved (or ``flush`` is called).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add a text delta; return the text now safe to emit (``self.stopped`` tells if a stop hit)."""
        if self.stopped:
            return ""
        text = self.pending + delta
        if not self.stop:
            self.pending = ""
            return text
        # The stop string that is completed first wins (ties: the one starting earlier), which
        # makes the result independent of how the text was split into deltas.
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)[1]]
        hold = self._held_suffix(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Release held-back text at the end of generation (it never became a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
