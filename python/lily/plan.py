"""``lily plan``: the decode graph of a configuration, built by the compiled engine without running it (no weights,
no GPU), with its dispatches, barrier stages and bytes per token next to the minimum a decode token must move
(every weight byte once, the recurrent and conv states read and written, the KV cache read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lily.backends import engine_config
from lily.backends.engine import PRECISIONS, engine_switches
from lily.config import FULL_SIZE_CONFIG, ModelArgs, full_size_args  # noqa: F401 (lily.plan's names)


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
    conv_state, kv_cache, total}, memory {weights, kv_cache, state, scratch, total, peak} (bytes the engine holds for
    this step: the KV cache at ``kv_capacity``, no prefill buffers), kv_bytes_per_token (what the KV cache grows by
    per token of context), max_context (the model's position limit), dispatches_by_kernel, context, kv_capacity,
    fast_paths_left_out (one line per fast path the shape does not fit, where the engine runs a general kernel
    instead); with ``with_graph`` also buffers [(name, bytes)] and nodes [{kernel, label, groups, threads, reads,
    writes, barrier_before}] with ranges (buffer, offset, length).
    """
    from lily import _ext

    if not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be a non-negative integer; got {context!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    chosen = engine_switches(dict(switches or {}))
    try:
        plan = _ext.plan_decode(engine_config(args), context, precision, chosen, with_graph)
    except RuntimeError as exc:  # the engine's config check names the field
        raise ValueError(str(exc)) from None
    plan["max_context"] = args.max_position_embeddings
    return plan


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
    memory = plan["memory"]
    per_token = plan["kv_bytes_per_token"]
    contexts = sorted({c for c in KV_GROWTH_CONTEXTS if c < plan["max_context"]} | {plan["max_context"]})
    growth = ", ".join(f"{_size(per_token * tokens)} at {tokens:,}" for tokens in contexts)
    held = [
        (f"memory held at {plan['context']} tokens", _size(memory["total"]), ""),
        ("  weights", _size(memory["weights"]), ""),
        (f"  KV cache ({plan['kv_capacity']:,} rows)", _size(memory["kv_cache"]),
         f"{per_token / 1e3:,.1f} KB per token: {growth}" if per_token else ""),
        ("  DeltaNet and conv state", _size(memory["state"]), ""),
        ("  scratch (decode)", _size(memory["scratch"]), ""),
    ]
    width = max(len(r[0]) for r in rows + held)
    lines = [f"{'per decode token':<{width}}  {'plan':>14}  target / minimum"]
    lines += [f"{name:<{width}}  {value:>14}  {target}" for name, value, target in rows]
    lines += [f"{name:<{width}}  {value:>14}  {note}".rstrip() for name, value, note in held]
    lines += [f"fast path left out: {line}" for line in plan.get("fast_paths_left_out", ())]
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


# Contexts at which `lily plan` states the KV cache's size, below the model's own limit (stated last).
KV_GROWTH_CONTEXTS = (32_768, 131_072)

# What one decode token may cost: the dispatch and barrier-stage budgets `lily plan` reports against.
PLAN_TARGETS = {"dispatches": 360, "stages": 300}
