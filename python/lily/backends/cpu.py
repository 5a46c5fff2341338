"""The ``cpu`` backend: the compiled CPU engine (``lily._ext.cpu``) behind the backend interface.

It computes what ``lily.reference`` specifies, in C++ on the packed checkpoint weights: quantized matrices are read
where the checkpoint file maps them (never copied to float32), decode runs a GEMV on the packed codes, prefill a
blocked GEMM that dequantizes a small tile at a time, experts run as one small GEMM per expert over the tokens
routed to it, and attention keeps one score row per query. A forward pass is one C++ call on a few threads.

The state is the reference's own containers (``lily.reference.State`` with ``KVCache`` and ``DeltaNetState``
float32 arrays), updated in place by the engine, so sessions copy, save and restore as with the reference backend.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from lily.backends import engine_config
from lily.config import FULL_ATTENTION, ModelArgs
from lily.reference import KV_CACHE_MIN_CAPACITY, DeltaNetState, KVCache, State, check_token_ids, rope_inv_freq

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint

# Small dense tensors the engine keeps as float32 vectors; every other tensor is a matrix read in place.
_VECTOR_SUFFIXES = ("norm.weight", "layernorm.weight", "conv1d.weight", "dt_bias", "A_log")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def default_threads(environ: Any = os.environ) -> int:
    """Threads of the CPU engine: ``LILY_NUM_THREADS`` if set, else the CPUs this process may run on."""
    value = environ.get("LILY_NUM_THREADS", "")
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"LILY_NUM_THREADS must be a positive integer; got {value!r}")
        return threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)


class CpuBackend:
    """The ``cpu`` backend: ``new_state()`` and ``forward(token_ids, state, *, last_only=False)``.

    ``threads``: worker threads (default ``default_threads()``: ``LILY_NUM_THREADS`` or the usable CPUs).
    """

    def __init__(self, checkpoint: Checkpoint, *, threads: int | None = None) -> None:
        from lily import _ext

        if threads is None:
            threads = default_threads()
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer; got {threads!r}")
        self.args: ModelArgs = checkpoint.args
        self.weights = checkpoint.weights  # shapes and names for `lily bench`; the engine reads the files
        try:
            # The RoPE frequencies as the reference forms them (the CPU engine reads them, not rope_theta).
            inv_freq = [float(f) for f in rope_inv_freq(self.args.rotary_dim, self.args.rope_theta)]
            self._model = _ext.cpu.CpuModel(engine_config(self.args), inv_freq, threads)
            self._files: dict[str, int] = {}
            for name in checkpoint.weights:
                self._bind(checkpoint, name)
            self._model.finish_loading()
        except ValueError as exc:
            raise ValueError(f"{checkpoint.path}: {exc}") from None

    @property
    def threads(self) -> int:
        """Threads the engine runs on."""
        return int(self._model.threads)

    @property
    def owned_bytes(self) -> int:
        """Bytes of weights copied at load (those not one byte range of a file in a dtype the engine reads)."""
        return int(self._model.owned_bytes)

    def expert_tokens(self, *, reset: bool = False) -> np.ndarray:
        """Routed (token, slot) pairs per layer and expert, uint64 [layers, experts], counted over every ``forward``
        since loading or the last call with ``reset=True`` (which zeroes them after reading): ``lily bench``'s
        expert load."""
        counts = np.array(self._model.expert_tokens())
        if reset:
            self._model.reset_expert_tokens()
        return counts

    # -- loading ------------------------------------------------------------------------------------

    def _file(self, path: Any) -> int:
        key = str(path)
        if key not in self._files:
            self._files[key] = self._model.add_file(key)
        return self._files[key]

    def _owned(self, array: np.ndarray) -> tuple[int, int, int]:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return (self._model.add_owned(data), 0, data.nbytes)

    def _span(self, location: Any) -> tuple[int, int, int]:
        return (self._file(location.file), location.offset, location.nbytes)

    def _bind(self, checkpoint: Checkpoint, name: str) -> None:
        weights = checkpoint.weights
        shape = weights.shape(name)
        if name.endswith(_VECTOR_SUFFIXES):
            self._model.bind_vector(name, np.ascontiguousarray(weights[name], dtype=np.float32).reshape(-1))
            return
        if len(shape) not in (2, 3):
            raise ValueError(f"{name}: expected a matrix or an expert stack, got shape {tuple(shape)}")
        experts = shape[0] if len(shape) == 3 else 0
        locations = weights.locations(name) or {}
        none = (0, 0, 0)
        if weights.is_quantized(name):
            bits, group = weights.quantization(name)
            dtype = weights.dtype(name)
            if locations and all(_SAFETENSORS_DTYPES.get(locations[p].dtype) == dtype for p in ("scales", "biases")):
                data, scales, biases = (self._span(locations[p]) for p in ("weight", "scales", "biases"))
            else:  # quantized on load, or split across files: the packed codes are kept, scales as float32
                tensor = weights[name]
                dtype = "float32"
                data = self._owned(np.asarray(tensor.weight, dtype=np.uint32))
                scales = self._owned(np.asarray(tensor.scales, dtype=np.float32))
                biases = self._owned(np.asarray(tensor.biases, dtype=np.float32))
            self._model.bind_matrix(name, bits, group, dtype, experts, shape[-2], shape[-1], data, scales, biases)
            return
        location = locations.get("weight")
        dtype = _SAFETENSORS_DTYPES.get(location.dtype) if location is not None else None
        if dtype is not None:
            data = self._span(location)
        else:  # a dense tensor that is not one byte range (stacked experts, HF layouts): kept in its stored dtype
            from lily.quant import float32_to_bfloat16_bits

            values = np.asarray(weights[name], dtype=np.float32)
            dtype = "bfloat16" if weights.dtype(name) == "bfloat16" else "float32"
            data = self._owned(float32_to_bfloat16_bits(values) if dtype == "bfloat16" else values)
        self._model.bind_matrix(name, 0, 0, dtype, experts, shape[-2], shape[-1], data, none, none)

    # -- the backend interface ----------------------------------------------------------------------

    def new_state(self) -> State:
        """Empty caches: no tokens seen, zero conv and recurrent states."""
        args = self.args
        conv_shape = (args.linear_conv_kernel_dim - 1, args.conv_dim)
        recurrent_shape = (args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        layers: list[KVCache | DeltaNetState] = []
        for layer_type in args.layer_types:
            if layer_type == FULL_ATTENTION:
                layers.append(KVCache(args.num_key_value_heads, args.head_dim))
            else:
                layers.append(DeltaNetState(np.zeros(conv_shape, np.float32), np.zeros(recurrent_shape, np.float32)))
        return State(layers)

    def _engine_states(self, state: Any, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's arrays, writable, float32, C-contiguous, the KV caches grown to hold ``tokens`` more."""
        args = self.args
        if not isinstance(state, State) or len(state.layers) != len(args.layer_types):
            raise ValueError("state was not made by this backend's new_state()")
        kv_shape = (args.num_key_value_heads, args.head_dim)
        conv_shape = (args.linear_conv_kernel_dim - 1, args.conv_dim)
        recurrent_shape = (args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim)
        out = []
        for layer_type, layer in zip(args.layer_types, state.layers):
            if layer_type == FULL_ATTENTION:
                if not isinstance(layer, KVCache) or layer.keys.shape[1:] != kv_shape or layer.length != state.position:
                    raise ValueError("state was not made by this backend's new_state()")
                end = state.position + tokens
                if end > layer.keys.shape[0] or not _usable(layer.keys) or not _usable(layer.values):
                    capacity = max(end, 2 * layer.keys.shape[0], KV_CACHE_MIN_CAPACITY)
                    layer.keys, layer.values = (_grown(a, layer.length, capacity) for a in (layer.keys, layer.values))
                out.append((layer.keys, layer.values))
            else:
                if (not isinstance(layer, DeltaNetState) or layer.conv.shape != conv_shape
                        or layer.recurrent.shape != recurrent_shape):
                    raise ValueError("state was not made by this backend's new_state()")
                if not _usable(layer.conv):
                    layer.conv = np.array(layer.conv, dtype=np.float32)
                if not _usable(layer.recurrent):
                    layer.recurrent = np.array(layer.recurrent, dtype=np.float32)
                out.append((layer.conv, layer.recurrent))
        return out

    def forward(self, token_ids: Any, state: State, *, last_only: bool = False) -> np.ndarray:
        """Run T tokens after the ``state.position`` tokens already seen; advance the state.

        token_ids: [T] int  ->  logits [T, V] fp32, or [1, V] (the last token's) with ``last_only``.
        """
        ids = check_token_ids(token_ids, self.args.vocab_size)
        states = self._engine_states(state, ids.shape[0])
        logits = np.empty((1 if last_only else ids.shape[0], self.args.vocab_size), dtype=np.float32)
        self._model.forward(np.ascontiguousarray(ids), state.position, states, logits, bool(last_only))
        state.position += ids.shape[0]
        for layer in state.layers:
            if isinstance(layer, KVCache):
                layer.length = state.position
        return logits


def _usable(array: np.ndarray) -> bool:
    """Whether the engine can update ``array`` in place."""
    return array.dtype == np.float32 and array.flags.c_contiguous and array.flags.writeable


def _grown(cache: np.ndarray, length: int, capacity: int) -> np.ndarray:
    grown = np.zeros((capacity,) + cache.shape[1:], dtype=np.float32)
    grown[:length] = cache[:length]
    return grown
