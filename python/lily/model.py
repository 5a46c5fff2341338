"""The public Python API: ``Model``, ``Session``, tokens, results and the prompt cache.

``Model`` owns a backend (see docs/architecture.md: ``new_state()``, ``forward(ids, state)``),
the tokenizer and a prompt cache. A ``Session`` is one sequence: the backend state after the
tokens it has seen, plus the logits of its last position so decoding can start at once.

Hybrid models keep a recurrent state that cannot be trimmed back to an earlier position, so
reuse across calls works by *snapshots*: copies of the state taken at chosen token positions
(end of the system prompt, end of the last user message, end of the prompt, end of each
generation). A new prompt restores the longest snapshot whose tokens are a prefix of it and
prefills only the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from lily.backends import Backend, GpuDecoding, peak_memory_gb
from lily.sampling import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    Sampler,
    SamplingParams,
    StopStringMatcher,
    generation_defaults,
    sampling_params,
)
from lily.snapshot import PromptCache, Snapshot, flatten_state, unflatten_state
from lily.tokenizer import check_text

Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]
CancelCheck = Union[threading.Event, Callable[[], bool], None]

_SESSION_FORMAT = "lily-session-1"


class Cancelled(Exception):
    """Raised when a cancellation check (an Event or a callable) asks the work to stop."""


@dataclass
class Stats:
    """Counters of one prefill + decode; rates are tokens per second. ``peak_memory`` (GB): the most the model has
    held in GPU memory on a GPU backend, the process's peak RSS on the CPU ones."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    peak_memory: float = 0.0


@dataclass
class Token:
    """One generated token as the decode iterator yields it.

    ``text`` is the new visible text (may be empty while the detokenizer or a possible stop
    string holds text back). ``logprob``/``top_logprobs`` are set when asked for (see
    ``lily.sampling`` for which distribution they come from). ``finish_reason`` is set on the
    last token only: "stop" (stop token or string), "length" (max_tokens or context end) or,
    from ``Model.chat``, "tool_calls". ``reasoning``/``content``/``tool_calls`` are the chat
    channels of this token's text (``Model.chat(stream=True)`` only).
    """

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)
    reasoning: str = ""
    content: str = ""
    tool_calls: list[Any] = field(default_factory=list)


@dataclass
class Result:
    """A finished generation. ``reasoning``, ``content`` and ``tool_calls`` are filled by
    ``Model.chat``; for ``Model.generate`` ``content`` equals ``text``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: Stats
    reasoning: str = ""
    content: str = ""
    tool_calls: list[Any] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _is_cancelled(cancel: CancelCheck) -> bool:
    if cancel is None:
        return False
    if isinstance(cancel, threading.Event):
        return cancel.is_set()
    return bool(cancel())


class Session:
    """One sequence on a model: the state after ``tokens`` and the logits of the last one.

    Made by ``Model.prefill``; extended by ``prefill(..., session=s)`` and ``decode``. The last
    sampled token of a decode is kept *pending* (not yet run through the model) until the session
    is extended, so a finished generation costs no extra forward pass.
    """

    def __init__(self, model: Model, *, use_cache: bool = True) -> None:
        self.model = model
        self.state = model.backend.new_state()
        self._processed: list[int] = []
        self._pending: list[int] = []
        self._last_logits: np.ndarray | None = None
        self._logits_on_device = False  # the backend holds the last logits (after a decode on the GPU)
        self._use_cache = use_cache
        self.stats = Stats()

    def __repr__(self) -> str:
        return f"Session({len(self)} tokens)"

    @property
    def tokens(self) -> list[int]:
        """Every token of the sequence, including a pending last sampled token."""
        return self._processed + self._pending

    def __len__(self) -> int:
        return len(self._processed) + len(self._pending)

    @property
    def logits(self) -> np.ndarray:
        """Logits [vocab] fp32 of the last token (a pending token is run through the model first)."""
        return self._ensure_logits().copy()

    # -- feeding tokens ------------------------------------------------------------------------

    def _feed(self, token_ids: Sequence[int], *, cancel: CancelCheck = None,
              checkpoints: Sequence[int] = ()) -> None:
        """Run tokens through the backend in chunks, checking ``cancel`` between chunks and
        storing a prompt-cache snapshot whenever the sequence length reaches a checkpoint."""
        ids = self._pending + [int(t) for t in token_ids]
        self._pending = []
        limit = self.model.config.max_position_embeddings
        if len(self._processed) + len(ids) > limit:
            raise ValueError(f"prompt too long: {len(self._processed) + len(ids)} tokens exceed the "
                             f"model context of {limit}")
        step = self.model.prefill_step_size
        marks = sorted(c for c in set(checkpoints) if self._use_cache
                       and len(self._processed) < c <= len(self._processed) + len(ids))
        start = 0
        while start < len(ids):
            if _is_cancelled(cancel):
                self._pending = ids[start:]
                raise Cancelled("prefill cancelled")
            end = min(start + step, len(ids))
            for mark in marks:  # stop a chunk exactly at a checkpoint
                if len(self._processed) < mark < len(self._processed) + (end - start):
                    end = start + mark - len(self._processed)
                    break
            logits = self.model.backend.forward(np.asarray(ids[start:end], dtype=np.int64), self.state,
                                                last_only=True)
            self._processed.extend(ids[start:end])
            self._last_logits = np.asarray(logits[-1], dtype=np.float32)
            self._logits_on_device = False
            start = end
            if len(self._processed) in marks:
                self.model.prompt_cache.insert(self._snapshot_processed())

    def _ensure_logits(self) -> np.ndarray:
        if self._pending:
            self._feed([])
        if self._last_logits is None and self._logits_on_device:
            self._last_logits = self.model.backend.last_logits(self.state)
            self._logits_on_device = False
        if self._last_logits is None:
            raise ValueError("the session is empty: prefill a prompt before decoding")
        return self._last_logits

    # -- snapshots -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """A frozen copy of this session (pending tokens are run through the model first)."""
        if self._pending or self._logits_on_device:
            self._ensure_logits()
        return self._snapshot_processed()

    def restore(self, snapshot: Snapshot) -> None:
        """Make this session continue exactly from ``snapshot`` (the snapshot stays reusable)."""
        if snapshot.fingerprint != self.model.fingerprint:
            raise ValueError("snapshot was taken on a different model (fingerprint mismatch)")
        self.state = snapshot.state.copy()
        self._processed = list(snapshot.token_ids)
        self._pending = []
        self._last_logits = None if snapshot.last_logits is None else snapshot.last_logits.copy()
        self._logits_on_device = False

    def fork(self) -> Session:
        """An independent copy: both sessions can continue differently."""
        if self._logits_on_device:
            self._ensure_logits()  # the copy's state is not the backend's live one
        other = Session(self.model, use_cache=self._use_cache)
        other.state = self.state.copy()
        other._processed = list(self._processed)
        other._pending = list(self._pending)
        other._last_logits = None if self._last_logits is None else self._last_logits.copy()
        other.stats = dataclasses.replace(self.stats)
        return other

    def save(self, path: str | Path) -> None:
        """Write the session to a safetensors file with its tokens and the model fingerprint."""
        from safetensors.numpy import save_file

        snap = self.snapshot()
        tensors: dict[str, np.ndarray] = {}
        structure = flatten_state(snap.state, "state", tensors)
        tensors["token_ids"] = np.asarray(snap.token_ids, dtype=np.int64)
        if snap.last_logits is not None:
            tensors["last_logits"] = snap.last_logits
        metadata = {
            "format": _SESSION_FORMAT,
            "fingerprint": snap.fingerprint,
            "backend": self.model.backend_name,
            "structure": json.dumps(structure),
        }
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, model: Model) -> Session:
        """Read a session written by ``save``; it must come from the same model and backend."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"session file not found: {path}")
        try:
            with safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise ValueError(f"{path}: not a readable session file ({exc})") from None
        if metadata.get("format") != _SESSION_FORMAT:
            raise ValueError(f"{path}: not a Lily session file (format {metadata.get('format')!r})")
        if metadata.get("fingerprint") != model.fingerprint:
            raise ValueError(f"{path}: the session was saved from a different model "
                             f"(fingerprint {metadata.get('fingerprint')}, this model is {model.fingerprint})")
        if metadata.get("backend") != model.backend_name:
            raise ValueError(f"{path}: the session was saved by the {metadata.get('backend')!r} backend, "
                             f"this model runs {model.backend_name!r}")
        session = cls(model)
        try:
            session.state = unflatten_state(model.backend.new_state(), json.loads(metadata["structure"]),
                                             tensors)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: session state does not match this model ({exc})") from None
        session._processed = [int(t) for t in tensors["token_ids"]]
        session._last_logits = tensors.get("last_logits")
        return session

    # -- decoding --------------------------------------------------------------------------------

    def decode(self, sampling: SamplingParams | None = None, *, cancel: CancelCheck = None,
               **options: Any) -> Iterator[Token]:
        """Generate tokens that extend this session; an iterator of ``Token``.

        ``sampling`` is a ``SamplingParams`` (e.g. from ``Model.sampling_params``), or ``options`` are its fields
        as keyword arguments, OpenAI names (see ``lily.sampling`` for their exact meaning, order and defaults):
        ``max_tokens`` (default ``DEFAULT_MAX_TOKENS``; None decodes to the end of the context), ``temperature``
        (0 is greedy), ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` (None or left out for these five:
        the checkpoint's generation_config.json, else the neutral value), ``repetition_context_size``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``, ``stop``, ``stop_token_ids``
        (None: the checkpoint's end tokens), ``logprobs``, ``top_logprobs``. ``cancel`` (an Event or a callable)
        is checked before every token and raises ``Cancelled``. Closing the iterator stops the work; the session
        keeps what was generated.
        """
        params = self.model._sampling("Session.decode", sampling, options, DEFAULT_MAX_TOKENS)
        return self._start_decode(params, cancel)

    def _start_decode(self, params: SamplingParams, cancel: CancelCheck) -> Iterator[Token]:
        """``_decode`` once the session can take a token (``params`` checked against the model already)."""
        if len(self) == 0:
            raise ValueError("the session is empty: prefill a prompt before decoding")
        if len(self) >= self.model.config.max_position_embeddings:
            raise ValueError(f"the session is full: {len(self)} tokens reach the model context of "
                             f"{self.model.config.max_position_embeddings}")
        return self._decode(params, cancel)

    def _decode(self, params: SamplingParams, cancel: CancelCheck) -> Iterator[Token]:
        model = self.model
        detok = model._detokenizer()
        matcher = StopStringMatcher(params.stop)
        stop_ids = set(model.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        limit = model.config.max_position_embeddings
        stats = dataclasses.replace(self.stats, generation_tokens=0, generation_tps=0.0)
        # Each token carries its own Stats; built from the fields that do not change (replace() costs microseconds
        # per token, a tenth of the host's budget for one).
        fixed = {f.name: getattr(stats, f.name) for f in dataclasses.fields(Stats)
                 if f.name not in ("generation_tokens", "generation_tps")}
        start = time.perf_counter()
        count = 0
        source = self._choose_on_gpu(params) if self._gpu_decode_possible(params) else self._choose_on_cpu(params)
        try:
            while True:
                if _is_cancelled(cancel):
                    raise Cancelled("decode cancelled")
                token, logprob, top = next(source)
                count += 1
                finish = None
                if token in stop_ids:
                    finish = "stop"
                    text = matcher.feed(detok.flush() if detok else "") + matcher.flush()
                else:
                    text = matcher.feed(detok.add(token) if detok else "")
                    if matcher.stopped:
                        finish = "stop"
                    elif count == params.max_tokens or len(self) >= limit:
                        finish = "length"
                        text += matcher.feed(detok.flush() if detok else "") + matcher.flush()
                elapsed = time.perf_counter() - start
                stats = Stats(**fixed, generation_tokens=count, generation_tps=count / elapsed if elapsed > 0 else 0.0)
                if finish is not None:
                    source.close()  # a GPU decode waits here for the step that runs this last token
                    stats.peak_memory = peak_memory_gb(model.backend)
                    self.stats = stats
                    if self._use_cache and self._processed:
                        model.prompt_cache.insert(self._snapshot_processed())
                yield Token(token, text, logprob, top, finish, stats)
                if finish is not None:
                    return
        finally:
            source.close()

    def _gpu_decode_possible(self, params: SamplingParams) -> bool:
        """Whether the backend chooses tokens itself for this request (see ``EngineBackend.gpu_decode_blockers``:
        logprobs and a windowed repetition penalty keep a request on the CPU sampler)."""
        backend = self.model.backend
        return isinstance(backend, GpuDecoding) and not backend.gpu_decode_blockers(params)

    def _choose_on_cpu(self, params: SamplingParams) -> Iterator[tuple[int, float | None, Any]]:
        """The reference path: every step's logits to the host, ``lily.sampling.Sampler`` chooses; the chosen
        token stays pending (not run) until the session is extended."""
        sampler = Sampler(params, context=self.tokens)
        while True:
            logits = self._ensure_logits()  # runs the previous token through the model
            token, logprob, top = sampler.sample(logits)
            self._pending = [token]
            yield token, logprob, top

    def _choose_on_gpu(self, params: SamplingParams) -> Iterator[tuple[int, float | None, Any]]:
        """Tokens chosen by the backend with steps in flight: only token ids come back. A yielded token has been
        submitted to run (its step is in flight), so it counts as processed; closing waits for that step, and the
        logits after it stay in the backend until asked for."""
        steps = self.model.backend.decode_tokens(self.state, self._ensure_logits(), params, params.max_tokens,
                                                 context=self.tokens)
        try:
            for token in steps:
                self._processed.append(token)
                self._last_logits = None
                self._logits_on_device = True
                yield token, None, None
        finally:
            steps.close()

    def _snapshot_processed(self) -> Snapshot:
        """A snapshot of the processed tokens only (no forward pass for a pending token)."""
        return Snapshot(self.state.copy(), tuple(self._processed),
                        None if self._last_logits is None else self._last_logits.copy(),
                        self.model.fingerprint)


def _check_precision(requested: str, backend: str, precision: str | None) -> None:
    from lily.backends.engine import PRECISIONS

    if precision is None:
        return
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if backend in ("reference", "cpu") and precision != "float32":
        raise ValueError(f"the {backend} backend computes in float32 only; got precision={precision!r}"
                         + (f" (backend='auto' chose {backend}: no Metal device here)" if requested == "auto" else ""))


def _fingerprint(checkpoint: Any, quantize: int | None) -> str:
    """A short hash of the config, the tensor names, shapes and quantization, and a sample of the
    bytes of every weight file (its size and its first and last 64 KiB)."""
    h = hashlib.sha256()
    args, weights = checkpoint.args, checkpoint.weights
    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    h.update(json.dumps({"config": config, "quantize": quantize}, sort_keys=True, default=str).encode())
    for name in sorted(weights):
        h.update(f"{name}:{weights.shape(name)}:{weights.quantization(name)};".encode())
    for path in sorted(Path(f) for f in checkpoint.files):
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(f"{path.name}:{size}".encode())
            h.update(f.read(1 << 16))
            f.seek(max(size - (1 << 16), 0))
            h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


class Model:
    """A loaded checkpoint: ``config`` (ModelArgs), ``tokenizer``, a backend and a prompt cache."""

    def __init__(self, backend: Backend, config: Any, tokenizer: Any, *, backend_name: str,
                 fingerprint: str, path: Path | None = None, prompt_cache: PromptCache | None = None,
                 prefill_step_size: int = 512) -> None:
        self.backend = backend
        self.config = config
        self.tokenizer = tokenizer
        self.backend_name = backend_name
        self.fingerprint = fingerprint
        self.path = path
        self.prompt_cache = prompt_cache if prompt_cache is not None else PromptCache()
        self.prefill_step_size = prefill_step_size
        #: the checkpoint's generation_config.json (sampling defaults), if any
        self.generation_config: dict[str, Any] = {}
        #: "auto" (weights read from the checkpoint) or "dummy" (random weights, ``lily.dummy``)
        self.load_format = "auto"
        eos = list(getattr(config, "eos_token_ids", ()) or ())
        if tokenizer is not None:
            eos += [t for t in getattr(tokenizer, "eos_token_ids", ()) if t not in eos]
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in eos)

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, backend={self.backend_name!r})"

    @classmethod
    def load(cls, path_or_repo: str | Path | Mapping[str, Any], *, backend: str = "auto", precision: str | None = None,
             revision: str | None = None, quantize: int | None = None, prompt_cache_entries: int = 16,
             prompt_cache_bytes: int = 4 << 30, prefill_step_size: int | None = None,
             progress: bool = True, load_format: str = "auto", max_context: int | None = None) -> Model:
        """Load a checkpoint from a directory, a Hugging Face repo id or ``"lily:demo"``.

        ``backend``: "reference" (numpy, the specification), "metal" (the compiled engine), "cuda"
        (the same engine on an NVIDIA GPU), "cpu" (the compiled CPU engine) or "auto" (metal on a Mac
        when the extension drives real Metal, cuda where an NVIDIA driver, a GPU and the CUDA kernels
        are present, else cpu). On Linux "metal" selects the engine's test runtime (the kernels run
        on the CPU harness: correct, and slow).
        ``precision``: the metal and cuda backends' activations, "bfloat16" or "float32" (None: the
        backend's default); the reference and cpu backends compute in float32 only. ``quantize=4``
        quantizes an HF bf16/fp32 checkpoint on load. The prompt cache keeps at most
        ``prompt_cache_entries`` snapshots and ``prompt_cache_bytes`` bytes. ``progress`` shows
        download progress bars, and the engine backends' load phases, on stderr where it is a terminal (the phases'
        times are logged at debug level).
        ``load_format="dummy"`` reads no weights: random 4-bit weights of the configuration's shapes, for
        benchmarks (``lily.dummy``); ``path_or_repo`` is then a checkpoint directory, a config.json path, a config
        dict or ``"full-size"`` (Qwen3.6-35B-A3B).
        ``max_context``: the metal and cuda backends' KV-cache limit in tokens (None: 32768; at most the model's
        ``max_position_embeddings``); the cache grows in blocks up to it. The other backends have no preset limit.
        ``prefill_step_size``: prompts run through the backend in pieces of this many tokens, and a cancellation
        acts between pieces (None: the engine backends' own prefill chunk, 2048 tokens; 512 for the others).
        """
        from lily import backends, hub
        from lily.checkpoint import load_checkpoint
        from lily.dummy import LOAD_FORMATS, dummy_checkpoint

        if load_format not in LOAD_FORMATS:
            raise ValueError(f"Model.load(): load_format must be one of {LOAD_FORMATS}; got {load_format!r}")
        dummy = load_format == "dummy"
        if not isinstance(path_or_repo, (str, os.PathLike)) and not (dummy and isinstance(path_or_repo, Mapping)):
            raise TypeError("Model.load(): path_or_repo must be a checkpoint directory, a Hugging Face repo id "
                            f"or 'lily:demo' (or, with load_format='dummy', a config dict); "
                            f"got {type(path_or_repo).__name__}")
        if dummy and (quantize is not None or revision is not None):
            raise ValueError("Model.load(): quantize= and revision= do not apply to load_format='dummy' (its random "
                             "weights are 4-bit already, and nothing is downloaded)")
        chosen = backends.choose(backend)
        _check_precision(backend, chosen, precision)
        if prefill_step_size is not None and (isinstance(prefill_step_size, bool)
                                              or not isinstance(prefill_step_size, int) or prefill_step_size < 1):
            raise ValueError(f"Model.load(): prefill_step_size must be a positive integer; got {prefill_step_size!r}")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                        or max_context < 1):
            raise ValueError(f"Model.load(): max_context must be a positive integer; got {max_context!r}")
        if dummy:
            checkpoint = dummy_checkpoint(path_or_repo)
            directory = checkpoint.path
        else:
            directory = Path(hub.resolve(path_or_repo, revision=revision, progress=progress))
            checkpoint = load_checkpoint(directory, quantize=quantize)
        if max_context is not None and max_context > checkpoint.args.max_position_embeddings:
            raise ValueError(f"Model.load(): max_context={max_context} exceeds the model's context of "
                             f"{checkpoint.args.max_position_embeddings} tokens (max_position_embeddings)")
        engine = backends.create(chosen, checkpoint, precision, max_context, progress)
        if prefill_step_size is None:
            prefill_step_size = engine.prefill_chunk if isinstance(engine, backends.PrefillChunking) else 512
        tokenizer = None
        tokenizer_dir = Path(checkpoint.tokenizer_dir or directory)
        if (tokenizer_dir / "tokenizer.json").is_file():
            from lily.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(tokenizer_dir)
        model = cls(engine, checkpoint.args, tokenizer, backend_name=chosen,
                    fingerprint=_fingerprint(checkpoint, quantize), path=directory,
                    prompt_cache=PromptCache(prompt_cache_entries, prompt_cache_bytes),
                    prefill_step_size=prefill_step_size)
        model.generation_config = dict(checkpoint.generation_config or {})
        model.load_format = load_format
        return model

    # -- arguments -------------------------------------------------------------------------------

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The sampling values the checkpoint's generation_config.json sets (see ``lily.sampling``)."""
        return generation_defaults(self.generation_config)

    def sampling_params(self, *, chat: bool = False, **options: Any) -> SamplingParams:
        """The ``SamplingParams`` that ``generate`` (``chat=True``: ``chat``) builds from these keyword arguments
        (``Session.decode`` lists them), checked against this model: to build once and pass as ``sampling=``."""
        max_tokens = min(DEFAULT_CHAT_MAX_TOKENS, self.config.max_position_embeddings) if chat else DEFAULT_MAX_TOKENS
        return self._sampling("Model.sampling_params", None, options, max_tokens)

    def _sampling(self, method: str, sampling: SamplingParams | None, options: Mapping[str, Any],
                  max_tokens: int) -> SamplingParams:
        """A decode's one ``SamplingParams``: ``sampling`` as given, or built from the keyword ``options`` by
        ``lily.sampling.sampling_params`` with this model's defaults (generation_config.json, ``max_tokens``);
        either way checked against the model before any work. Errors name ``method``."""
        try:
            if sampling is None:
                sampling = sampling_params(options, {**self.sampling_defaults, "max_tokens": max_tokens})
            elif options:
                raise TypeError(f"takes sampling= or sampling keyword arguments, not both; got sampling= and "
                                f"{sorted(options)[0]!r}")
            elif not isinstance(sampling, SamplingParams):
                raise TypeError(f"sampling must be a lily.sampling.SamplingParams; got {type(sampling).__name__}")
            sampling.validate(self.config.vocab_size, self.config.max_position_embeddings)
        except TypeError as exc:
            raise TypeError(f"{method}() {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{method}(): {exc}") from None
        return sampling

    # -- tokens ----------------------------------------------------------------------------------

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"the model at {self.path} has no tokenizer (tokenizer.json is missing); "
                             "pass token ids instead of text")
        return self.tokenizer

    def _detokenizer(self) -> _Detokenizer | None:
        return None if self.tokenizer is None else _Detokenizer(self.tokenizer)

    def encode(self, prompt: Prompt, *, tools: Sequence[Mapping[str, Any]] | None = None,
               enable_thinking: bool | None = None, preserve_thinking: bool = False) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the template;
        ``enable_thinking=None`` leaves thinking to it, see ``Tokenizer.thinks_by_default``)."""
        return self._encode(prompt, tools, enable_thinking, preserve_thinking)[0]

    def _encode(self, prompt: Prompt, tools: Any, enable_thinking: bool | None,
                preserve_thinking: bool) -> tuple[list[int], list[int]]:
        """Token ids and the checkpoint positions inside them."""
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError("prompt must be text (str), token ids or chat messages; got bytes (decode them "
                            "first, e.g. prompt.decode('utf-8'))")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            ids = list(self._require_tokenizer().encode(prompt))
            checkpoints: list[int] = []
        elif isinstance(prompt, np.ndarray) or (isinstance(prompt, Sequence) and prompt
                                                and all(isinstance(t, (int, np.integer)) for t in prompt)):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size}); got {bad[0]}")
            checkpoints = []
        elif _is_chat(prompt):
            tokenizer = self._require_tokenizer()
            text = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True,
                                                 enable_thinking=enable_thinking,
                                                 preserve_thinking=preserve_thinking)
            ids = list(tokenizer.encode(text))
            checkpoints = self._turn_checkpoints(ids, has_system=prompt[0].get("role") == "system" or bool(tools))
        else:
            raise ValueError("prompt must be a non-empty string, a non-empty list of token ids, or a "
                             f"non-empty list of chat messages; got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return ids, checkpoints

    def _turn_checkpoints(self, ids: list[int], *, has_system: bool) -> list[int]:
        """Token positions worth a snapshot: the end of the system turn (system prompt and tools)
        and the end of the last user message, i.e. the start of the second and of the final turn."""
        starts = self._turn_starts(ids)
        marks = []
        if has_system and len(starts) > 1:
            marks.append(starts[1])
        if len(starts) > 1:
            marks.append(starts[-1])
        return marks

    def _turn_starts(self, ids: list[int]) -> list[int]:
        start_id = self._require_tokenizer().token_to_id("<|im_start|>")
        return [i for i, t in enumerate(ids) if t == start_id] if start_id is not None else []

    # -- running ---------------------------------------------------------------------------------

    def logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """Logits [T, vocab] fp32 of a fresh sequence of token ids or text (no cache involved)."""
        if _is_chat(prompt):
            raise TypeError("Model.logits() takes token ids or text; got chat messages (use model.encode(messages))")
        ids = self.encode(prompt if isinstance(prompt, (str, bytes, bytearray)) else list(prompt))
        limit = self.config.max_position_embeddings
        if len(ids) > limit:
            raise ValueError(f"Model.logits(): {len(ids)} tokens exceed the model context of {limit}")
        return np.asarray(self.backend.forward(np.asarray(ids, dtype=np.int64), self.backend.new_state()),
                          dtype=np.float32)

    def new_session(self, *, use_cache: bool = True) -> Session:
        """An empty session."""
        return Session(self, use_cache=use_cache)

    def prefill(self, prompt: Prompt, *, session: Session | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool | None = None,
                preserve_thinking: bool = False, use_cache: bool = True,
                cancel: CancelCheck = None) -> Session:
        """Run a prompt (text, token ids or chat messages) and return the session after it.

        Without ``session`` the longest cached prefix is restored from the prompt cache (see
        ``session.stats.cached_tokens``) and only the rest is computed. With ``session`` the prompt
        is appended to it. ``cancel`` is checked between prefill chunks and raises ``Cancelled``.
        """
        ids, checkpoints = self._encode(prompt, tools, enable_thinking, preserve_thinking)
        cached = 0
        if session is not None:
            if session.model is not self:
                raise ValueError("session belongs to a different model")
            if _is_chat(prompt):
                raise ValueError("chat messages render a whole conversation and cannot extend a session; "
                                 "call prefill(messages) without session= (the prompt cache reuses the "
                                 "shared prefix)")
            checkpoints = [len(session) + c for c in checkpoints]
        else:
            session = Session(self, use_cache=use_cache)
            hit = self.prompt_cache.longest_prefix(ids) if use_cache else None
            if hit is not None and hit.last_logits is None and len(hit.token_ids) == len(ids):
                hit = self.prompt_cache.longest_prefix(ids[:-1])  # the last token must run to give logits
            if hit is not None:
                session.restore(hit)
                cached = len(hit.token_ids)
                ids = ids[cached:]
        full_length = len(session) + len(ids)
        start = time.perf_counter()
        session._feed(ids, cancel=cancel, checkpoints=[*checkpoints, full_length])
        elapsed = time.perf_counter() - start
        session.stats = Stats(prompt_tokens=cached + len(ids), cached_tokens=cached,
                              prompt_tps=len(ids) / elapsed if ids and elapsed > 0 else 0.0,
                              peak_memory=peak_memory_gb(self.backend))
        return session

    def generate(self, prompt: Prompt, *, sampling: SamplingParams | None = None, session: Session | None = None,
                 use_cache: bool = True, stream: bool = False, cancel: CancelCheck = None,
                 **options: Any) -> Result | Iterator[Token]:
        """Prefill ``prompt`` and decode with ``sampling`` (a ``SamplingParams``) or ``options``, its fields as the
        ``Session.decode`` keyword arguments (``max_tokens`` defaults to ``DEFAULT_MAX_TOKENS``).
        ``stream=True`` returns an iterator of ``Token``; otherwise a ``Result``."""
        params = self._sampling("Model.generate", sampling, options, DEFAULT_MAX_TOKENS)
        s = self.prefill(prompt, session=session, use_cache=use_cache, cancel=cancel)
        tokens = s._start_decode(params, cancel)
        return tokens if stream else _collect(tokens, parse=None)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, sampling: SamplingParams | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, enable_thinking: bool | None = None,
             preserve_thinking: bool = False, stream: bool = False, use_cache: bool = True,
             cancel: CancelCheck = None, **options: Any) -> Result | Iterator[Token]:
        """Answer a conversation; the output is split into reasoning, content and tool calls.

        ``enable_thinking=None`` thinks if the chat template does by default (Qwen3.6 does, the
        demo model does not: ``Tokenizer.thinks_by_default``). ``stream=True`` returns an iterator of ``Token`` whose ``reasoning``/``content``/
        ``tool_calls`` hold each token's share; otherwise a ``Result``. The finish reason is
        "tool_calls" when the answer ends in tool calls. ``sampling`` or ``options`` as for ``generate``, but
        ``max_tokens`` defaults to ``DEFAULT_CHAT_MAX_TOKENS`` or the model's context, whichever is smaller; without
        ``tools`` tool-call markup stays in the content.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("Model.chat(): messages must be a non-empty list of chat messages")
        params = self._sampling("Model.chat", sampling, options,
                                min(DEFAULT_CHAT_MAX_TOKENS, self.config.max_position_embeddings))
        thinking = self._require_tokenizer().thinks_by_default if enable_thinking is None else enable_thinking
        session = self.prefill(messages, tools=tools, enable_thinking=thinking,
                               preserve_thinking=preserve_thinking, use_cache=use_cache, cancel=cancel)
        tokens = chat_stream(session._start_decode(params, cancel), tools, thinking)
        return tokens if stream else _collect(tokens, parse=True)


def _is_chat(prompt: Any) -> bool:
    return (isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0
            and all(isinstance(m, Mapping) for m in prompt))


class _Detokenizer:
    """Streaming detokenizer of generated ids: control tokens (end tokens) give no text, and ids of
    the padded vocabulary rows beyond the tokenizer give none either."""

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer.detokenizer(skip_special_tokens=True)
        self._known = tokenizer.vocab_size

    def add(self, token_id: int) -> str:
        return self._inner.add(token_id) if token_id < self._known else ""

    def flush(self) -> str:
        return self._inner.finish()


def chat_stream(tokens: Iterator[Token], tools: Any, thinking: bool) -> Iterator[Token]:
    """Route each decoded token's text through the reasoning/tool-call parser (``lily.chat``).

    Fills every token's ``reasoning``/``content``/``tool_calls`` share; a generation that stops
    after a tool call finishes with "tool_calls". Closing the result closes ``tokens``.
    """
    from lily.chat import ContentDelta, ReasoningDelta, StreamingParser, ToolCallEvent

    parser = StreamingParser(tools=tools, thinking=thinking, tool_calls=bool(tools))  # no tools offered: no calls
    saw_tool_call = False
    try:
        for token in tokens:
            events = parser.feed(token.text)
            if token.finish_reason is not None:
                events += parser.finish()
            for event in events:
                if isinstance(event, ReasoningDelta):
                    token.reasoning += event.text
                elif isinstance(event, ContentDelta):
                    token.content += event.text
                elif isinstance(event, ToolCallEvent):
                    token.tool_calls.append(event.call)
                    saw_tool_call = True
            if token.finish_reason == "stop" and saw_tool_call:
                token.finish_reason = "tool_calls"
            yield token
    finally:
        tokens.close()


def _collect(tokens: Iterator[Token], *, parse: bool | None) -> Result:
    ids: list[int] = []
    text: list[str] = []
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[Any] = []
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    last: Token | None = None
    for token in tokens:
        ids.append(token.id)
        text.append(token.text)
        reasoning.append(token.reasoning)
        content.append(token.content)
        calls.extend(token.tool_calls)
        if token.logprob is not None:
            logprobs.append(token.logprob)
        if token.top_logprobs is not None:
            tops.append(token.top_logprobs)
        last = token
    if last is None:
        raise RuntimeError("decoding produced no token")
    full = "".join(text)
    return Result(text=full, token_ids=ids, finish_reason=last.finish_reason, stats=last.stats,
                  reasoning="".join(reasoning), content="".join(content) if parse else full,
                  tool_calls=calls, logprobs=logprobs or None, top_logprobs=tops or None)
