"""``lily plan``: the decode graph of a configuration, built by the compiled engine without running it (no weights,
no GPU), with its dispatches, barrier stages and bytes per token next to the minimum a decode token must move
(every weight byte once, the recurrent and conv states read and written, the KV cache read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lily.backends.metal import PRECISIONS, SWITCHES, TEST_OPTIONS, engine_config
from lily.config import ModelArgs

# The text configuration of Qwen3.6-35B-A3B (its config.json on the Hugging Face Hub), for plans without a checkpoint.
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


def full_size_args() -> ModelArgs:
    """ModelArgs of the full-size Qwen3.6-35B-A3B (no checkpoint needed)."""
    return ModelArgs.from_dict(FULL_SIZE_CONFIG, source="Qwen3.6-35B-A3B (built in)")


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
