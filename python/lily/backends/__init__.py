"""The backends that run the forward pass under ``lily.Model`` (docs/architecture.md, "Backends").

``reference``: ``lily.reference.ReferenceModel``, the specification itself (numpy, float32, always available).
``metal``: ``lily.backends.metal.MetalBackend``, the compiled engine (``lily.backends.engine``) on Metal.
``cuda``: ``lily.backends.cuda.CudaBackend``, the same engine on its CUDA runtime (NVIDIA GPUs).
``cpu``: ``lily.backends.cpu.CpuBackend``, the same engine on its CPU runtime (any machine).

Every backend is a ``Backend``; what only some can do is a capability, a protocol of its own, that ``lily.Model`` and
``lily bench`` test with ``isinstance``: ``GpuDecoding``, ``LiveSequence``, ``DeviceMemoryReport``, ``ExpertCounts``,
``KernelProfiling`` and ``PrefillChunking``.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from lily.config import ModelArgs
    from lily.sampling import SamplingParams


@runtime_checkable
class Backend(Protocol):
    """What ``lily.Model`` runs on: ``new_state()`` gives a sequence's state (``position``, ``copy()`` for an
    independent snapshot), ``forward`` runs token ids through it and returns float32 logits [T, V] (the last row
    only with ``last_only``). ``args`` is the model's configuration, ``weights`` the checkpoint's tensors (names,
    shapes, quantization) or an empty mapping."""

    args: ModelArgs
    weights: Mapping[str, Any]

    def new_state(self) -> Any: ...

    def forward(self, token_ids: Any, state: Any, *, last_only: bool = False) -> np.ndarray: ...


@runtime_checkable
class GpuDecoding(Protocol):
    """Chooses the next tokens itself, with steps in flight, for the requests it can sample
    (``gpu_decode_blockers`` says why not for the others)."""

    def gpu_decode_blockers(self, params: SamplingParams) -> list[str]: ...

    def decode_tokens(self, state: Any, last_logits: np.ndarray, params: SamplingParams, max_tokens: int | None,
                      context: Sequence[int] = ()) -> Iterator[int]: ...

    def last_logits(self, state: Any) -> np.ndarray: ...


@runtime_checkable
class LiveSequence(Protocol):
    """Holds one sequence's state on its device at a time; ``activate`` makes ``state`` that one."""

    def activate(self, state: Any) -> None: ...


@runtime_checkable
class DeviceMemoryReport(Protocol):
    """Reports the bytes it holds in GPU memory (``device_memory()``: weights, kv_cache, state, scratch, total,
    peak)."""

    def device_memory(self) -> dict[str, int]: ...


@runtime_checkable
class ExpertCounts(Protocol):
    """Counts the tokens each expert of each layer received (``lily bench``'s expert-load figures)."""

    def expert_tokens(self, *, reset: bool = False) -> Any: ...


@runtime_checkable
class KernelProfiling(Protocol):
    """Can time each graph node of a prefill, where ``supports_profiling`` is true (the cuda runtime on the GPU, the
    cpu backend on the host clock)."""

    supports_profiling: bool

    def profile_prefill(self, token_ids: Any) -> list[tuple[str, str, float]]: ...

@runtime_checkable
class PrefillChunking(Protocol):
    """Runs a prompt fastest in forward calls of ``prefill_chunk`` tokens (its own chunk: larger calls are split
    into chunks of it, smaller ones run as they are); ``lily.Model`` feeds prompts in pieces of that size."""

    prefill_chunk: int


def peak_memory_gb(backend: Backend) -> float:
    """The most memory the model has held (GB): on a GPU backend the peak of what the engine holds in GPU memory
    (weights, KV cache, states, scratch), else this process's peak RSS."""
    if isinstance(backend, DeviceMemoryReport):
        return backend.device_memory()["peak"] / 1e9
    return host_memory_gb()


def host_memory_gb() -> float:
    """This process's peak resident set size (GB): host memory, whatever the backend holds on a GPU."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


# The fields of ModelArgs the compiled engines read (metal, cuda and cpu), under the same names in
# lily._ext.ModelConfig (src/lily_ext/bindings.cpp binds them onto lily::ModelConfig).
ENGINE_CONFIG_FIELDS = ("vocab_size", "hidden_size", "layer_types", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "rotary_dim", "linear_num_key_heads", "linear_num_value_heads",
                        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                        "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                        "rms_norm_eps", "rope_theta")
_ENGINE_CONFIG_NUMBERS = ("rms_norm_eps", "rope_theta")  # float32 in C++; every other field but layer_types a size


def engine_config(args: ModelArgs) -> Any:
    """``args`` as the compiled engines take it: a typed ``lily._ext.ModelConfig`` holding ``ENGINE_CONFIG_FIELDS``
    (the one way a configuration crosses into C++: the metal and cuda engines, ``lily plan`` and the cpu backend).
    A value the C++ type cannot hold raises ValueError naming the field."""
    from lily import _ext

    config = _ext.ModelConfig()
    for name in ENGINE_CONFIG_FIELDS:
        value = getattr(args, name)
        try:
            setattr(config, name, value)
        except TypeError:
            kind = ("a number" if name in _ENGINE_CONFIG_NUMBERS else "a list of layer types" if name == "layer_types"
                    else "a non-negative integer")
            raise ValueError(f"engine config: {name} must be {kind}; got {value!r}") from None
    return config


NAMES = ("reference", "metal", "cuda", "cpu")


def choose(name: str) -> str:
    """The backend ``name`` stands for: "auto" is metal where the extension drives real Metal, cuda where an NVIDIA
    driver, a GPU and the CUDA kernels are present, else cpu (reference when the extension is missing)."""
    if name == "auto":
        try:
            from lily import _ext
        except ImportError:
            return "reference"
        if getattr(_ext, "platform", "") == "metal" and hasattr(_ext, "Engine"):
            return "metal"
        from lily.backends.cuda import cuda_unavailable

        if hasattr(_ext, "Engine") and cuda_unavailable(system_driver=True) is None:
            return "cuda"
        return "cpu" if hasattr(_ext, "cpu") else "reference"
    if name not in NAMES:
        raise ValueError(f"backend must be 'auto', 'reference', 'metal', 'cuda' or 'cpu'; got {name!r}")
    if name == "metal":
        from lily.backends.metal import require_metal_runtime

        require_metal_runtime()
    if name == "cuda":
        from lily.backends.cuda import require_cuda

        require_cuda()
    return name


def create(name: str, checkpoint: Any, precision: str | None = None, max_context: int | None = None,
           progress: bool = False) -> Backend:
    """A backend of the chosen ``name`` ("reference", "metal", "cuda" or "cpu") over ``checkpoint``; ``precision``
    (metal and cuda; cpu is float32), ``max_context`` (the KV cache's limit) and ``progress`` (a load progress bar)
    apply to the engine backends, metal, cuda and cpu, and None keeps their defaults."""
    options = {key: value for key, value in (("precision", precision), ("max_context", max_context))
               if value is not None}
    options["progress"] = progress
    if name == "metal":
        from lily.backends.metal import MetalBackend

        return MetalBackend(checkpoint, **options)
    if name == "cuda":
        from lily.backends.cuda import CudaBackend

        return CudaBackend(checkpoint, **options)
    if name == "cpu":
        from lily.backends.cpu import CpuBackend

        options.pop("precision", None)  # Model.load refuses any but float32 for cpu
        return CpuBackend(checkpoint, **options)
    from lily.reference import ReferenceModel

    return ReferenceModel(checkpoint)
