"""The compiled engine (``lily._ext.Engine``) seen from Python: ``EngineBackend``, which the ``metal`` and ``cuda``
backends run over their runtimes, its sequence state, and what crosses into it typed besides the configuration
(``lily.backends.engine_config``): the engine switches (``engine_switches``) and the token choice (``token_choice``).

``EngineBackend`` implements ``lily.backends.Backend`` (``new_state``, ``forward``, ``state.copy()``,
``state.position``) and the GPU capabilities (``GpuDecoding``, ``DeviceMemory``). Weights that are a plain byte range
of a checkpoint file are bound in place (each file is mapped once and wrapped whole as one buffer); the others (HF
layouts, quantized on load, a dtype the kernels do not take) are materialised once at load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lily.backends import engine_config
from lily.quant import QuantizedTensor, float32_to_bfloat16_bits
from lily.reference import check_token_ids

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint
    from lily.sampling import SamplingParams

PRECISIONS = ("bfloat16", "float32")
# Engine switches, each also LILY_DISABLE_<NAME> in the environment: the one list. What each turns off is the table in
# docs/engine.md ("Switches"); src/lily_ext/model.h (struct Switches) and bindings.cpp name the same ones, which
# tests/test_layout.py checks.
SWITCHES = ("concurrent", "fused_projections", "fusion", "split_kv", "split_prefill_kv", "gpu_token", "batched_prefill", "wide_tiles",
            "gpu_routing", "chunked_prefill", "gqa_packing", "coalesced_kv", "in_gemm_dequant",
            "register_scan", "chunked_scan", "tensor_ops", "mma_attention", "staged_gemv", "replayed_prompts",
            "spread_deltanet_step", "whole_pack_loads", "fused_attention_prep", "fused_argmax",
            "mma_gemv", "early_moe_down", "split_steps")
# Sizes tests lower to reach rare paths quickly: the split-KV threshold (keys) and block count unit (keys; 0: the
# runtime's), the fewest keys per split prefill block, the KV cache growth step (rows), the prefill chunk (rows) and
# the threadgroups the staged segmented GEMV streams its row blocks over (0: one per block).
TEST_OPTIONS = ("split_kv_min_keys", "split_kv_block_keys", "split_prefill_block_keys", "kv_block", "prefill_chunk",
                "seg_stream_groups")


_log = logging.getLogger(__name__)


def switches_from_env(environ: Mapping[str, str]) -> dict[str, bool]:
    """Switches turned off by ``LILY_DISABLE_<NAME>=1`` (any value but "" and "0")."""
    return {
        name: False for name in SWITCHES if environ.get(f"LILY_DISABLE_{name.upper()}", "") not in ("", "0")
    }


def engine_switches(chosen: Mapping[str, Any]) -> Any:
    """``chosen`` (switch names to bools, ``TEST_OPTIONS`` to sizes) as the engine takes it: a typed
    ``lily._ext.Switches``, every switch not named left on. Raises ValueError naming an unknown name or a bad value."""
    from lily import _ext

    switches = _ext.Switches()
    for name, value in chosen.items():
        if name in SWITCHES:
            if not isinstance(value, bool):
                raise ValueError(f"engine switch {name!r} must be True or False; got {value!r}")
        elif name in TEST_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"engine option {name!r} must be an integer >= 0; got {value!r}")
        else:
            raise ValueError(f"unknown engine switch {name!r}; known: {SWITCHES}")
        setattr(switches, name, value)
    return switches


def token_choice(params: SamplingParams, seed: int) -> Any:
    """How the engine chooses tokens for ``params``: a typed ``lily._ext.TokenChoice`` (temperature, truncation,
    penalty strengths; the logit bias and the penalty's context go to ``begin_decode`` beside it), the one conversion
    of sampling parameters into C++. ``seed``: the decode's (``params.seed`` or a random one), taken modulo 2**64."""
    from lily import _ext

    return _ext.TokenChoice(
        temperature=params.temperature,
        top_k=min(params.top_k, 2**32 - 1),  # any k at or above the vocabulary size is off
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seed % 2**64,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )


# Dense tensors the kernels read in the activation dtype; every other dense tensor (A_log, dt_bias) is read as f32.
_ACTIVATION_DTYPE_SUFFIXES = ("layernorm.weight", "norm.weight", "conv1d.weight")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U32": "uint32"}
# Default context limit of an engine: the KV cache grows in blocks up to it.
DEFAULT_MAX_CONTEXT = 32768


def _as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    return float32_to_bfloat16_bits(values) if dtype == "bfloat16" else np.ascontiguousarray(values, dtype=np.float32)


class EngineState:
    """A sequence's state in an engine backend: live in the engine's buffers, or a host snapshot of them.

    The instance fields are exactly ``position`` and ``_snapshot`` (a uint8 array of the conv and recurrent state
    and the KV prefix, or None while the engine holds the state live), so ``Session.save`` writes just those and
    the prompt cache counts the snapshot's bytes; the link to the backend is a slot, outside the fields.
    """

    __slots__ = ("_backend", "__dict__")

    def __init__(self, backend: "EngineBackend", position: int = 0, snapshot: np.ndarray | None = None) -> None:
        self._backend = backend
        self.position = position
        self._snapshot = snapshot

    def copy(self) -> "EngineState":
        """An independent snapshot: the conv and recurrent state and the KV prefix in use."""
        if self._backend._live is self:
            snapshot = np.frombuffer(self._backend._engine.snapshot(), dtype=np.uint8)
        else:
            snapshot = self._snapshot
        return EngineState(self._backend, self.position, snapshot)


class _LoadPhases:
    """A load's phases: one step of a progress bar each (the weights one per tensor), and each phase's seconds at
    debug level."""

    def __init__(self, path: Any, tensors: int, progress: bool) -> None:
        from tqdm.auto import tqdm

        self._path = path
        # disable=None: drawn only where stderr is a terminal (logs and pipes get the debug lines alone).
        self._bar = tqdm(total=tensors + 2, desc="lily: loading", unit="step", leave=False,
                         disable=None if progress else True)
        self._times: list[tuple[str, float]] = []

    def __enter__(self) -> "_LoadPhases":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.close()
        if exc[0] is None:
            _log.debug("%s: loaded in %.3f s (%s)", self._path, sum(t for _, t in self._times),
                       ", ".join(f"{name} {t:.3f} s" for name, t in self._times))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._bar.set_description(f"lily: {name}")
        start = time.perf_counter()
        yield
        self._times.append((name, time.perf_counter() - start))
        if name != "weights":  # the weights phase advances per tensor
            self._bar.update(1)

    def advance(self) -> None:
        self._bar.update(1)


class EngineBackend:
    """The compiled engine (``lily._ext.Engine``) behind the backend interface of ``lily.backends.Backend``: the
    ``metal`` and ``cuda`` backends are this class over their runtime (``_require_runtime``, ``_runtime_arguments``).

    ``precision``: "bfloat16" (the default: bf16 activations and KV cache, fp32 accumulation, fp32 DeltaNet state,
    f32 router logits) or "float32" (f32 activations and KV cache, weights as stored).
    ``switches``: engine options turned off (see ``SWITCHES``; also ``LILY_DISABLE_<NAME>``).
    ``max_context``: the KV cache's limit in tokens (it grows in blocks up to it).
    ``progress``: a progress bar over the load's phases (kernels and device, each weight, buffers and graph) on stderr
    where it is a terminal; each phase's time is logged at debug level either way.
    """

    def __init__(
        self,
        checkpoint: "Checkpoint",
        *,
        precision: str = "bfloat16",
        switches: Mapping[str, Any] | None = None,
        max_context: int = DEFAULT_MAX_CONTEXT,
        progress: bool = False,
    ) -> None:
        from lily import _ext

        self._require_runtime()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
        chosen = engine_switches({**switches_from_env(os.environ), **dict(switches or {})})
        if not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer; got {max_context!r}")
        self.prefill_chunk: int = _ext.prefill_chunk  # tuning::kPrefillChunk: the PrefillChunking capability
        self.args = checkpoint.args
        self.weights = checkpoint.weights  # names, shapes and quantization (lily bench); the engine reads the files
        self.precision = precision
        names = list(checkpoint.weights)
        config = engine_config(self.args)
        with _LoadPhases(checkpoint.path, len(names), progress) as phases:
            with phases.phase("kernels and device"):
                try:
                    self._engine = _ext.Engine(config, precision, chosen, max_context, **self._runtime_arguments())
                except RuntimeError as exc:
                    raise ValueError(f"{checkpoint.path}: {exc}") from None
            for line in _ext.fast_paths_left_out(config):
                _log.debug("%s: fast path left out: %s", checkpoint.path, line)
            self._files: dict[str, int] = {}
            with phases.phase("weights"):
                for name in names:
                    self._bind(checkpoint, name)
                    phases.advance()
            with phases.phase("buffers and graph"):
                try:
                    self._engine.finish_loading()
                except RuntimeError as exc:
                    raise ValueError(f"{checkpoint.path}: {exc}") from None
        self._live: EngineState | None = None
        self._decoded: EngineState | None = None  # the state whose decode logits the engine's buffer holds
        self._decoding = False  # a decode_tokens iterator is open (steps may be in flight)
        self._gpu_token = chosen.gpu_token

    def _require_runtime(self) -> None:
        """Raise RuntimeError, before any work, when this machine lacks the runtime."""
        raise NotImplementedError

    def _runtime_arguments(self) -> dict[str, Any]:
        """How ``lily._ext.Engine`` reaches the GPU: the runtime and where its kernels are."""
        raise NotImplementedError

    # -- loading ------------------------------------------------------------------------------------

    def _file(self, path: Any) -> int:
        key = str(path)
        if key not in self._files:
            self._files[key] = self._engine.add_file(key)
            if self._engine.buffer_origin(self._files[key]):
                _log.debug("%s: loaded shifted (on Metal: copied, not mapped): its tensors do not start on 16 bytes",
                           key)
        return self._files[key]

    def _owned(self, array: np.ndarray) -> tuple[int, int, int]:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return (self._engine.add_owned(data), 0, data.nbytes)

    def _bind(self, checkpoint: "Checkpoint", name: str) -> None:
        weights = checkpoint.weights
        shape = weights.shape(name)
        locations = weights.locations(name)
        if weights.is_quantized(name):
            bits, group = weights.quantization(name)
            if group != 64:
                raise ValueError(f"{checkpoint.path}: {name}: the engine needs group size 64; got {group}")
            # The kernels take bf16 scales, or f32 ("_sf32" variants); f16 scales are widened to f32.
            scale_dtype = "bfloat16" if weights.dtype(name) == "bfloat16" else "float32"
            parts = ("weight", "scales", "biases")
            if locations is not None and all(
                _SAFETENSORS_DTYPES.get(locations[p].dtype) == scale_dtype for p in parts[1:]
            ):
                data, scales, biases = (
                    (self._file(locations[p].file), locations[p].offset, locations[p].nbytes) for p in parts
                )
            else:
                tensor: QuantizedTensor = weights[name]
                data = self._owned(np.asarray(tensor.weight, dtype=np.uint32))
                scales = self._owned(_as_dtype(tensor.scales, scale_dtype))
                biases = self._owned(_as_dtype(tensor.biases, scale_dtype))
            experts = shape[0] if len(shape) == 3 else 0
            self._engine.bind_weight(name, bits, "uint32", scale_dtype, experts, shape[-2], shape[-1],
                                     data, scales, biases)
            return
        wanted = (
            ("float32" if self.precision == "float32" else "bfloat16")
            if name.endswith(_ACTIVATION_DTYPE_SUFFIXES)
            else "float32"
        )
        if name.endswith(".weight") and not name.endswith(_ACTIVATION_DTYPE_SUFFIXES):
            raise ValueError(f"{checkpoint.path}: {name} is not quantized; the engine runs 4/8-bit "
                             "checkpoints (load HF checkpoints with quantize=4)")
        location = (locations or {}).get("weight")
        if location is not None and _SAFETENSORS_DTYPES.get(location.dtype) == wanted:
            span = (self._file(location.file), location.offset, location.nbytes)
        else:
            span = self._owned(_as_dtype(np.asarray(weights[name], dtype=np.float32), wanted))
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[-1])
        self._engine.bind_weight(name, 0, wanted, wanted, 0, rows, cols, span, (span[0], 0, 0), (span[0], 0, 0))

    @property
    def materialised_bytes(self) -> int:
        """Bytes of weights copied at load (not a plain byte range of a file in a dtype the kernels take), counted
        by the engine: the Python-side conversions and anything the engine itself copies."""
        return int(self._engine.owned_bytes)

    @property
    def mapped_files(self) -> list[str]:
        """The checkpoint files loaded as buffers (Metal wraps a file's mapping unless it had to be shifted)."""
        return list(self._files)

    @property
    def shifted_files(self) -> list[str]:
        """The checkpoint files loaded shifted, so that their tensors start aligned (on Metal: copied, not wrapped):
        MLX writes safetensors headers of any length, which leaves every tensor at an odd offset."""
        return [path for path, buffer in self._files.items() if self._engine.buffer_origin(buffer)]

    # -- the backend interface ----------------------------------------------------------------------

    def new_state(self) -> EngineState:
        """Empty caches."""
        return EngineState(self)

    def activate(self, state: EngineState) -> None:
        """Make ``state`` the engine's live state, saving the one it replaces."""
        if self._live is state:
            return
        if self._decoding:
            raise ValueError("another sequence is decoding on this backend (its steps are in flight); finish or "
                             "close that decode first")
        snapshot = state._snapshot
        if snapshot is None:
            if state.position != 0:
                raise ValueError("state has no snapshot for its position; it was not made by this backend")
        else:
            snapshot = np.ascontiguousarray(snapshot, dtype=np.uint8).reshape(-1)
            expected = self._engine.snapshot_bytes(int(state.position))
            if snapshot.nbytes != expected:
                raise ValueError(
                    f"state snapshot holds {snapshot.nbytes} bytes; this backend's state after {state.position} "
                    f"tokens is {expected} bytes (saved from another model or precision?)"
                )
        if self._live is not None:
            self._live._snapshot = np.frombuffer(self._engine.snapshot(), dtype=np.uint8)
        if snapshot is None:
            self._engine.reset()
        else:
            self._engine.restore(snapshot, int(state.position))
        state._snapshot = None
        self._live = state
        self._decoded = None

    def forward(self, token_ids: Any, state: EngineState, *, last_only: bool = False,
                dropped_barrier: int = -1) -> np.ndarray:
        """Run T tokens after ``state.position``; advance the state; logits [T, V] fp32, or [1, V] (the last row,
        the only one lm_head computes) with ``last_only``.

        ``dropped_barrier`` (tests only) leaves out the barrier before that node of each step.
        """
        ids = check_token_ids(token_ids, self.args.vocab_size)
        if not isinstance(state, EngineState) or state._backend is not self:
            raise ValueError("state was not made by this backend's new_state()")
        self.activate(state)
        logits = np.empty((1 if last_only else ids.size, self.args.vocab_size), dtype=np.float32)
        try:
            self._engine.forward([int(i) for i in ids], logits, dropped_barrier, last_only)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        state.position = self._engine.position
        self._decoded = None
        return logits

    # -- decoding on the GPU (an optional capability: Session.decode looks for ``decode_tokens``) -------------

    def gpu_decode_blockers(self, params: "SamplingParams") -> list[str]:
        """The requested features that keep this request on the CPU sampler (empty: it runs on the GPU).

        The GPU chooses tokens with temperature, top-k, top-p, min-p, a seed, a logit bias and the repetition,
        presence and frequency penalties (metal/sampling.metal). Logprobs need the logits on the host, and a
        repetition penalty over a window (``repetition_context_size``) needs the token leaving the window: such a
        request reads every step's logits and samples with ``lily.sampling.Sampler``, for that request only.
        """
        blockers = [] if self._gpu_token else ["the GPU_TOKEN switch is off"]
        if params.repetition_penalty != 1.0 and params.repetition_context_size is not None:
            blockers.append("repetition_context_size")
        if params.logprobs or params.top_logprobs:
            blockers.append("logprobs")
        return blockers

    def decode_tokens(self, state: EngineState, last_logits: np.ndarray, params: "SamplingParams",
                      max_tokens: int | None, context: Sequence[int] = ()) -> Iterator[int]:
        """Token ids chosen on the GPU, starting from ``last_logits`` (the logits of the state's last position);
        ``context`` is the token history the repetition penalty sees (the session's tokens, as ``Sampler``'s).

        The first token is chosen from ``last_logits``; each next token by a decode step that runs the one before
        and chooses in its last dispatches, so only token ids come back. The step that runs the token just yielded
        is committed before the host looks at that token: when the caller stops (a stop token or string, or it
        closes the iterator), the state has run exactly the tokens yielded, and ``last_logits(state)`` reads the
        logits after the last one. At most ``max_tokens`` tokens (None: until the caller stops or the context ends).
        """
        self.activate(state)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        logits = np.ascontiguousarray(last_logits, dtype=np.float32).reshape(-1)
        engine = self._engine
        bias = params.logit_bias or {}
        engine.begin_decode(logits, token_choice(params, seed), bias_ids=list(bias),
                            bias_values=[float(v) for v in bias.values()],
                            context=list(context) if params.repetition_penalty != 1.0 else [])
        self._decoded = state
        self._decoding = True
        count = 0
        try:
            while max_tokens is None or count < max_tokens:
                try:
                    engine.submit_step()  # runs the token the last choice wrote, and chooses the next
                except RuntimeError as exc:  # the context limit
                    raise ValueError(str(exc)) from None
                token = engine.next_token()  # the oldest choice in flight (the step just committed keeps running)
                count += 1
                yield token
        finally:
            engine.end_decode()
            self._decoding = False
            state.position = engine.position

    def last_logits(self, state: EngineState) -> np.ndarray:
        """Logits [V] after the last token ``decode_tokens`` ran for ``state`` (a copy to the host)."""
        if self._decoded is not state or self._live is not state:
            raise ValueError("the engine no longer holds this state's decode logits")
        out = np.empty(self.args.vocab_size, dtype=np.float32)
        self._engine.read_logits(out)
        return out

    def host_timing(self, encode: bool, cpp: bool = False) -> dict[str, list[int]]:
        """Set per-step host timing; returns the times (ns) of the steps submitted since the last call.

        ``encode``: finding the built step and submitting it (Metal: patching, encoding with its Metal calls and
        committing; CUDA: patching the position fields, their upload and the graph launch); ``cpp``: the same without
        the driver calls, the engine's own C++ (each step is then submitted both ways, which slows the token).
        """
        times = {"encode": list(self._engine.step_encode_ns), "cpp": list(self._engine.step_cpp_ns)}
        self._engine.reset_host_timing()
        self._engine.set_host_timing(encode, cpp)
        return times

    def device_memory(self) -> dict[str, int]:
        """Bytes the engine holds in GPU memory: ``weights``, ``kv_cache`` (at its current capacity), ``state``
        (DeltaNet and conv states), ``scratch`` (activations, prefill buffers, logits), their ``total``, and the
        ``peak`` total since loading began. Host memory (the process's RSS) is not in these figures."""
        return {key: int(value) for key, value in self._engine.device_memory().items()}

    @property
    def host_read_bytes(self) -> int:
        """Bytes the engine has copied to the host so far: logits rows and token ids."""
        return int(self._engine.host_read_bytes)

    def generate_greedy(self, state: EngineState, first_token: int, count: int) -> list[int]:
        """``count`` greedy tokens after ``first_token``, chosen on the GPU (two command buffers in flight)."""
        self.activate(state)
        tokens = self._engine.generate_greedy(int(first_token), int(count))
        state.position = self._engine.position
        self._decoded = None
        return list(tokens)

    def last_step_graph(self) -> dict[str, Any]:
        """The last command buffer's graph: buffers [(name, bytes)] and nodes [{kernel, label, groups, threads, reads,
        writes, barrier_before, depends_on, early_reads, early_start}] with ranges (buffer, offset, length), as
        ``plan_decode(with_graph=True)``."""
        return self._engine.last_step_graph()

    def last_step_counts(self) -> dict[str, Any]:
        """Dispatches, stages, barriers, bytes and dispatches by kernel of the last command buffer's graph."""
        return self._engine.last_step_counts()

    @property
    def supports_profiling(self) -> bool:
        """Whether ``profile_prefill`` works here: the cuda runtime reports per-node device times, the cpu runtime
        per-node host times."""
        return self._engine.supports_profiling()

    def profile_prefill(self, token_ids: Any) -> list[tuple[str, str, float]]:
        """Where a prefill's GPU time goes: (kernel, label, device milliseconds) of every node of a prefill of
        ``token_ids`` (at least 2: one token runs as a decode step) on a new sequence, each node run on its own
        between CUDA events (on the cpu runtime: the host clock around each node's call), so the times add up to the
        serial cost. The cuda and cpu runtimes only (ValueError elsewhere)."""
        ids = check_token_ids(token_ids, self.args.vocab_size)
        if ids.size < 2:
            raise ValueError("profile_prefill needs at least 2 tokens (one token runs as a decode step)")
        if not self.supports_profiling:
            raise ValueError("profile_prefill needs the cuda or cpu runtime (per-node times); the metal runtime "
                             "does not report them yet")
        self._engine.set_profiling(True)
        try:
            self._engine.clear_node_times()
            self.forward(ids, self.new_state(), last_only=True)
            return [tuple(row) for row in self._engine.node_times()]
        finally:
            self._engine.set_profiling(False)
