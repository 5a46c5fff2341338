"""``lily plan``: the decode graph of a configuration, built by the compiled engine without running it (no weights,
no GPU), with its dispatches, barrier stages and bytes per token next to the minimum a decode token must move
(every weight byte once, the recurrent and conv states read and written, the KV cache read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lily.backends.metal import PRECISIONS, SWITCHES, TEST_OPTIONS, engine_config
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
    conv_state, kv_cache, total}, dispatches_by_kernel, context, kv_capacity, fast_paths_left_out (one line per
    fast path the shape does not fit, where the engine runs a general kernel instead); with ``with_graph`` also buffers
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
    lines += [f"fast path left out: {line}" for line in plan.get("fast_paths_left_out", ())]
    return "\n".join(lines)


# What one decode token may cost: the dispatch and barrier-stage budgets `lily plan` reports against.
PLAN_TARGETS = {"dispatches": 360, "stages": 300}
