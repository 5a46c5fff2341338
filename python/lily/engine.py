"""The compiled Metal engine (``lily._ext``) seen from Python: the ``metal`` backend and ``lily plan``.

``MetalBackend`` implements the backend interface of docs/architecture.md (``new_state``, ``forward``,
``state.copy()``, ``state.position``) over ``lily._ext.Engine``. Weights that are a plain byte range of a
checkpoint file are bound in place (each file is mapped once and wrapped whole as one Metal buffer); the others
(HF layouts, quantized on load, a dtype the kernels do not take) are materialised once at load.

``plan_decode`` builds the decode graph of a configuration without running it (no weights, no GPU) and reports
dispatches, barrier stages and bytes per token next to the minimum of performance.md §2.2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from lily.config import ModelArgs
from lily.quant import QuantizedTensor

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint

# The text configuration of Qwen3.6-35B-A3B (model.md §1.1), for plans without a checkpoint.
FULL_SIZE_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}

PRECISIONS = ("bfloat16", "float32")
# Engine switches (each also LILY_DISABLE_<NAME> in the environment): concurrent dispatch, fused projection GEMVs,
# decode kernel fusion (RMSNorm into the next GEMV, residual add into the out/o projection, routing into the experts),
# the long-context split-KV attention path, the GPU writing the next token, prompts in T-row chunks (off: one decode
# step per token), 32-row GEMM tiles (off: 16-row tiles only), the prefill MoE sort on the GPU (off: a CPU round trip
# per layer), prompts in chunks of the prefill chunk size (off: one chunk for the whole prompt), decode attention
# packing the query heads of one KV head per threadgroup (off: one head per threadgroup, each re-reading the cache).
# Decode attention lanes reading consecutive chunks of a K/V row (coalesced_kv off: the plain lane mapping).
# Prefill GEMMs dequantizing weight tiles inside the GEMM (in_gemm_dequant off: a dequantize pass, then a dense GEMM).
# The prefill DeltaNet scan keeping its state in registers (register_scan off: a memory round trip per 16 tokens).
# Prefill attention on simdgroup matrices for chunks of 8+ tokens (mma_attention off: the vector kernel; also off when
# the device's simdgroup_matrix lane layout differs from the one the kernel assumes).
SWITCHES = ("concurrent", "fused_projections", "fusion", "split_kv", "gpu_token", "batched_prefill", "wide_tiles",
            "gpu_routing", "chunked_prefill", "gqa_packing", "coalesced_kv", "in_gemm_dequant",
            "register_scan", "mma_attention")
# Sizes tests lower to reach rare paths quickly: the split-KV threshold (keys), the KV cache growth step (rows) and
# the prefill chunk (rows).
TEST_OPTIONS = ("split_kv_min_keys", "kv_block", "prefill_chunk")


def full_size_args() -> ModelArgs:
    """ModelArgs of the full-size Qwen3.6-35B-A3B (no checkpoint needed)."""
    return ModelArgs.from_dict(FULL_SIZE_CONFIG, source="Qwen3.6-35B-A3B (built in)")


def engine_config(args: ModelArgs) -> dict[str, Any]:
    """The fields of ``args`` the engine's graph reads, as plain Python values."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "layer_types": list(args.layer_types),
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rotary_dim": args.rotary_dim,
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "shared_expert_intermediate_size": args.shared_expert_intermediate_size,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
    }


def switches_from_env(environ: Mapping[str, str]) -> dict[str, bool]:
    """Switches turned off by ``LILY_DISABLE_<NAME>=1`` (any value but "" and "0")."""
    return {
        name: False for name in SWITCHES if environ.get(f"LILY_DISABLE_{name.upper()}", "") not in ("", "0")
    }


def plan_decode(
    args: ModelArgs,
    *,
    context: int = 4096,
    precision: str = "bfloat16",
    switches: Mapping[str, Any] | None = None,
    with_graph: bool = False,
) -> dict[str, Any]:
    """Build (not run) the decode step at ``context`` cached tokens; return its counts and the byte minimum.

    Keys: dispatches, stages, barriers, bytes_read, bytes_written, minimum_bytes {weights, recurrent_state,
    conv_state, kv_cache, total}, dispatches_by_kernel, context, kv_capacity; with ``with_graph`` also buffers
    [(name, bytes)] and nodes [{kernel, label, reads, writes, barrier_before}] with ranges (buffer, offset, length).
    """
    from lily import _ext

    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be a non-negative integer; got {context!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    unknown = set(switches or {}) - set(SWITCHES) - set(TEST_OPTIONS)
    if unknown:
        raise ValueError(f"unknown engine switch {sorted(unknown)[0]!r}; known: {SWITCHES}")
    try:
        return _ext.plan_decode(engine_config(args), context, precision, dict(switches or {}), with_graph)
    except RuntimeError as exc:  # the engine's config check names the field
        raise ValueError(str(exc)) from None


def format_plan(plan: Mapping[str, Any], targets: Mapping[str, int]) -> str:
    """The plan as a table: measured per token next to the target or the minimum."""
    minimum = plan["minimum_bytes"]
    moved = plan["bytes_read"] + plan["bytes_written"]
    rows = [
        ("dispatches per token", f"{plan['dispatches']}", f"<= {targets['dispatches']}"),
        ("barrier stages per token", f"{plan['stages']}", f"<= {targets['stages']}"),
        ("bytes read", f"{plan['bytes_read'] / 1e6:,.1f} MB", ""),
        ("bytes written", f"{plan['bytes_written'] / 1e6:,.1f} MB", ""),
        ("bytes moved", f"{moved / 1e6:,.1f} MB", f"minimum {minimum['total'] / 1e6:,.1f} MB"),
        ("  weights", "", f"{minimum['weights'] / 1e6:,.1f} MB"),
        ("  DeltaNet state read+write", "", f"{minimum['recurrent_state'] / 1e6:,.1f} MB"),
        ("  conv state read+write", "", f"{minimum['conv_state'] / 1e6:,.1f} MB"),
        (f"  KV cache x {plan['context']} tokens", "", f"{minimum['kv_cache'] / 1e6:,.1f} MB"),
        ("over the minimum", f"{(moved / minimum['total'] - 1) * 100:+.2f} %", "<= +5 %"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'per decode token':<{width}}  {'plan':>14}  target / minimum"]
    lines += [f"{name:<{width}}  {value:>14}  {target}" for name, value, target in rows]
    return "\n".join(lines)


# Targets of issue 6 for one decode token.
PLAN_TARGETS = {"dispatches": 360, "stages": 300}


# Dense tensors the kernels read in the activation dtype; every other dense tensor (A_log, dt_bias) is read as f32.
_ACTIVATION_DTYPE_SUFFIXES = ("layernorm.weight", "norm.weight", "conv1d.weight")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U32": "uint32"}
# Default context limit of an engine: the KV cache grows in blocks up to it.
DEFAULT_MAX_CONTEXT = 32768


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (round to nearest even; exact for values that are bf16 already)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    return _bf16_bits(values) if dtype == "bfloat16" else np.ascontiguousarray(values, dtype=np.float32)


class MetalState:
    """A sequence's state in the metal backend: live in the engine's buffers, or a host snapshot of them.

    The instance fields are exactly ``position`` and ``_snapshot`` (a uint8 array of the conv and recurrent state
    and the KV prefix, or None while the engine holds the state live), so ``Session.save`` writes just those and
    the prompt cache counts the snapshot's bytes; the link to the backend is a slot, outside the fields.
    """

    __slots__ = ("_backend", "__dict__")

    def __init__(self, backend: "MetalBackend", position: int = 0, snapshot: np.ndarray | None = None) -> None:
        self._backend = backend
        self.position = position
        self._snapshot = snapshot

    def copy(self) -> "MetalState":
        """An independent snapshot: the conv and recurrent state and the KV prefix in use."""
        if self._backend._live is self:
            snapshot = np.frombuffer(self._backend._engine.snapshot(), dtype=np.uint8)
        else:
            snapshot = self._snapshot
        return MetalState(self._backend, self.position, snapshot)


def kernel_metallib() -> str | None:
    """The path of ``lily.metallib`` when this build compiled the kernels ahead of time, else None.

    The build has one kernel-library mode (conventions.md §2 item 17): by default the kernel source embedded in
    ``_ext`` is compiled at first use; with ``-DLILY_AOT_METALLIB=ON`` the library is installed next to ``_ext`` and
    found only there. Raises FileNotFoundError naming the path when an AOT build's library is missing.
    """
    import importlib.resources

    from lily import _ext

    if not _ext.kernels.aot_metallib:
        return None
    path = importlib.resources.files("lily") / "lily.metallib"
    if not path.is_file():
        raise FileNotFoundError(
            f"lily was built with LILY_AOT_METALLIB=ON but its kernel library {path} is missing; reinstall lily"
        )
    return str(path)


class MetalBackend:
    """The ``metal`` backend: ``lily._ext.Engine`` behind the backend interface of docs/architecture.md.

    ``precision``: "bfloat16" (the default: bf16 activations and KV cache, fp32 accumulation, fp32 DeltaNet state,
    f32 router logits) or "float32" (f32 activations and KV cache, weights as stored).
    ``switches``: engine options turned off (see ``SWITCHES``; also ``LILY_DISABLE_<NAME>``).
    ``max_context``: the KV cache's limit in tokens (it grows in blocks up to it).
    """

    def __init__(
        self,
        checkpoint: "Checkpoint",
        *,
        precision: str = "bfloat16",
        switches: Mapping[str, Any] | None = None,
        max_context: int = DEFAULT_MAX_CONTEXT,
    ) -> None:
        from lily import _ext

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
        chosen = {**switches_from_env(os.environ), **dict(switches or {})}
        unknown = set(chosen) - set(SWITCHES) - set(TEST_OPTIONS)
        if unknown:
            raise ValueError(f"unknown engine switch {sorted(unknown)[0]!r}; known: {SWITCHES}")
        if not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer; got {max_context!r}")
        self.args = checkpoint.args
        self.precision = precision
        try:
            self._engine = _ext.Engine(engine_config(self.args), precision, chosen, max_context,
                                       metallib=kernel_metallib())
        except RuntimeError as exc:
            raise ValueError(f"{checkpoint.path}: {exc}") from None
        self._files: dict[str, int] = {}
        for name in checkpoint.weights:
            self._bind(checkpoint, name)
        try:
            self._engine.finish_loading()
        except RuntimeError as exc:
            raise ValueError(f"{checkpoint.path}: {exc}") from None
        self._live: MetalState | None = None

    # -- loading ------------------------------------------------------------------------------------

    def _file(self, path: Any) -> int:
        key = str(path)
        if key not in self._files:
            self._files[key] = self._engine.add_file(key)
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
                raise ValueError(f"{checkpoint.path}: {name}: the metal backend needs group size 64; got {group}")
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
            raise ValueError(f"{checkpoint.path}: {name} is not quantized; the metal backend runs 4/8-bit "
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
        """The checkpoint files wrapped as Metal buffers."""
        return list(self._files)

    # -- the backend interface ----------------------------------------------------------------------

    def new_state(self) -> MetalState:
        """Empty caches."""
        return MetalState(self)

    def _activate(self, state: MetalState) -> None:
        """Make ``state`` the engine's live state, saving the one it replaces."""
        if self._live is state:
            return
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

    def forward(self, token_ids: Any, state: MetalState, *, dropped_barrier: int = -1) -> np.ndarray:
        """Run T tokens after ``state.position``; advance the state; logits [T, V] fp32.

        ``dropped_barrier`` (tests only) leaves out the barrier before that node of each step.
        """
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"token_ids must be a non-empty 1-D sequence of integers; got shape {ids.shape}, dtype {ids.dtype}"
            )
        bad = (ids < 0) | (ids >= self.args.vocab_size)
        if bad.any():
            raise ValueError(f"token_ids must lie in [0, {self.args.vocab_size}); got {ids[bad][0]}")
        if not isinstance(state, MetalState) or state._backend is not self:
            raise ValueError("state was not made by this backend's new_state()")
        self._activate(state)
        logits = np.empty((ids.size, self.args.vocab_size), dtype=np.float32)
        try:
            self._engine.forward([int(i) for i in ids], logits, dropped_barrier)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        state.position = self._engine.position
        return logits

    def generate_greedy(self, state: MetalState, first_token: int, count: int) -> list[int]:
        """``count`` greedy tokens after ``first_token``, chosen on the GPU (two command buffers in flight)."""
        self._activate(state)
        tokens = self._engine.generate_greedy(int(first_token), int(count))
        state.position = self._engine.position
        return list(tokens)

    def last_step_counts(self) -> dict[str, Any]:
        """Dispatches, stages, barriers, bytes and dispatches by kernel of the last command buffer's graph."""
        return self._engine.last_step_counts()
