"""The ``cpu`` backend: the compiled engine (``lily._ext.Engine``) on its CPU runtime, behind the backend interface.

The graphs are the ones the GPU backends run (``src/lily_ext/models/qwen3_5_moe.cpp``), in float32; the CPU runtime
(``src/lily_ext/cpu/``) runs each node's kernel as a C++ function on a thread pool: quantized matrices are read where
the checkpoint file maps them (never copied), a few rows run a GEMV on the packed codes, more rows a blocked GEMM
that dequantizes a small tile at a time, and experts run as one small GEMM per expert over the rows routed to it.

The state is the engine's (``lily.backends.engine.EngineState``): sessions copy, save and restore it as on the GPU
backends. Capabilities: ``ExpertCounts`` (the expert load ``lily bench`` reports for dummy weights); the token is
chosen by the host sampler, as with the reference backend.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from lily.backends.engine import DEFAULT_MAX_CONTEXT, EngineBackend, EngineState

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint


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


class _CpuEngine(EngineBackend):
    """``EngineBackend`` over the CPU runtime (``threads`` workers)."""

    def __init__(self, checkpoint: Checkpoint, threads: int, **options: Any) -> None:
        self._threads = threads
        super().__init__(checkpoint, **options)

    def _require_runtime(self) -> None:
        """The CPU runtime is in every build."""

    def _runtime_arguments(self) -> dict[str, Any]:
        return {"runtime": "cpu", "threads": self._threads}


class CpuBackend:
    """The ``cpu`` backend: ``new_state()`` and ``forward(token_ids, state, *, last_only=False)``.

    ``threads``: worker threads (default ``default_threads()``: ``LILY_NUM_THREADS`` or the usable CPUs).
    ``max_context``: the KV cache's limit in tokens (it grows in blocks up to it). Engine switches are turned off by
    ``LILY_DISABLE_<NAME>`` as on the GPU backends; the ones the CPU runtime has no kernels for are off here.
    """

    def __init__(self, checkpoint: Checkpoint, *, threads: int | None = None,
                 max_context: int = DEFAULT_MAX_CONTEXT, progress: bool = False) -> None:
        if threads is None:
            threads = default_threads()
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer; got {threads!r}")
        from lily import _ext

        # LILY_CPU_ISA is read once, when the extension loads; one it could not take is refused here, by name.
        refusal = _ext.cpu.isa_environment_refusal()
        if refusal:
            raise ValueError(refusal)
        self.args = checkpoint.args
        self.weights = checkpoint.weights  # shapes and names for `lily bench`; the engine reads the files
        # The host samples every token (the runtime has no token-choice kernels).
        self._engine = _CpuEngine(checkpoint, threads, precision="float32", switches={"gpu_token": False},
                                  max_context=max_context, progress=progress)

    @property
    def threads(self) -> int:
        """Threads the engine runs on."""
        from lily import _ext

        return int(_ext.cpu.threads(self._engine._engine))

    @property
    def owned_bytes(self) -> int:
        """Bytes of weights copied at load (those not one byte range of a file in a dtype the kernels read: norms
        widened to float32, weights quantized on load)."""
        return self._engine.materialised_bytes

    @property
    def supports_profiling(self) -> bool:
        """``profile_prefill`` works here: the CPU runtime times each node on the host clock."""
        return self._engine.supports_profiling

    def profile_prefill(self, token_ids: Any) -> list[tuple[str, str, float]]:
        """Where a prefill's time goes: (kernel, label, milliseconds) of every node of a prefill of ``token_ids`` (at
        least 2) on a new sequence, each node's call timed on the host clock (its threads included), so the times
        add up to the prefill's kernel time (``EngineBackend.profile_prefill``)."""
        return self._engine.profile_prefill(token_ids)

    def expert_tokens(self, *, reset: bool = False) -> np.ndarray:
        """Routed (token, slot) pairs per layer and expert, uint64 [layers, experts], counted over every ``forward``
        since loading or the last call with ``reset=True`` (which zeroes them after reading): ``lily bench``'s
        expert load."""
        from lily import _ext

        return np.array(_ext.cpu.expert_tokens(self._engine._engine, reset))

    def new_state(self) -> EngineState:
        """Empty caches: no tokens seen, zero conv and recurrent states."""
        return self._engine.new_state()

    def forward(self, token_ids: Any, state: EngineState, *, last_only: bool = False) -> np.ndarray:
        """Run T tokens after the ``state.position`` tokens already seen; advance the state.

        token_ids: [T] int  ->  logits [T, V] fp32, or [1, V] (the last token's) with ``last_only``.
        """
        return self._engine.forward(token_ids, state, last_only=last_only)
