"""The numpy fp32 reference of the Qwen3.5/3.6-MoE text model: the specification of every kernel.

Each public function below is one op, named as its kernel family (``metal/<op>.metal``, the index in
docs/kernels.md; prefill kernels share the op's function), or a layer made of ops (``*_layer``), and
reads like the model's maths. Shapes in docstrings use: T new tokens, S cached + new tokens, H hidden
size, Hq/Hkv attention query/key-value heads, D attention head dim, Hk/Hv DeltaNet key/value
heads, dk/dv DeltaNet head dims, C conv channels, K conv taps, E experts, I expert width, V vocab.

Inputs, outputs and every value passed between ops are float32; the DeltaNet recurrence runs on
an fp32 state, as the model specifies. Inside the other ops, sums (matmuls, norms, softmax,
conv) and activations are evaluated in fp64 and rounded once, so the reference is as close to
the exact maths as fp32 allows and does not depend on how tokens are batched. A weight is a
dense numpy array or a ``lily.quant.QuantizedTensor``; quantized weights are dequantized at the
call that uses them, a block or an expert at a time, so no full-model fp32 copy ever exists.

``ReferenceModel`` puts the ops together behind the backend interface of
``docs/architecture.md``: ``new_state()`` and ``forward(token_ids, state) -> logits [T, V]``.
"""

from __future__ import annotations

import copy as _copy
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lily.config import FULL_ATTENTION, ModelArgs
from lily.quant import QuantizedTensor

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint

Tensor = Any  # numpy.ndarray or lily.quant.QuantizedTensor

# Rows a KV cache holds before its first growth; it doubles from there.
KV_CACHE_MIN_CAPACITY = 256

# Output rows dequantized at once by `qmatmul`: bounds the temporary fp32 copy of a big
# quantized matrix (the 248320-row lm_head) to about 64 MiB at H = 2048.
_DEQUANT_ROW_BLOCK = 8192


def _f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    # exp(-softplus(-x)) = 1 / (1 + e^-x) without overflow.
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, dtype=np.float64)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return _sigmoid64(x).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=np.float64) * _sigmoid64(x)).astype(np.float32)


def _softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) without overflow.
    return np.logaddexp(0.0, np.asarray(x, dtype=np.float64)).astype(np.float32)


def _dequantize_rows(weight: Tensor, rows: slice | np.ndarray | int) -> np.ndarray:
    """Rows of a 2-D weight, or one expert of a 3-D stack, as fp32 (dequantizing only those)."""
    if isinstance(weight, QuantizedTensor):
        return _f32(weight[rows].dequantize())
    return _f32(weight[rows])


# ---------------------------------------------------------------------------------------------
# Dense ops
# ---------------------------------------------------------------------------------------------


def dequantize(weight: Tensor) -> np.ndarray:
    """A weight as fp32: ``scale * q + bias`` per group for a quantized one (exact in fp32), a copy of a dense one.

    weight: [..., out, in] dense or quantized  ->  [..., out, in]
    """
    return _dequantize_rows(weight, slice(None))


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w^T`` for a dense fp32 ``w``, accumulated in fp64 and rounded once to fp32: ``qmatmul`` on
    ``dequantize(W)``.

    x: [..., in]; w: [out, in]  ->  [..., out]
    """
    return (_f32(x).astype(np.float64) @ _f32(w).astype(np.float64).T).astype(np.float32)


def qmatmul(x: np.ndarray, weight: Tensor) -> np.ndarray:
    """``x @ W^T``, accumulated in fp64 and rounded once to fp32.

    The fp64 accumulation makes each output row independent of how many tokens share the call,
    so one-shot prefill, chunked prefill and decode agree to the last bit.
    x: [..., in]; weight: [out, in] dense or quantized  ->  [..., out]
    """
    x = _f32(x).astype(np.float64)
    out_features = weight.shape[0]
    out = np.empty(x.shape[:-1] + (out_features,), dtype=np.float32)
    for start in range(0, out_features, _DEQUANT_ROW_BLOCK):
        rows = slice(start, min(start + _DEQUANT_ROW_BLOCK, out_features))
        out[..., rows] = x @ _dequantize_rows(weight, rows).astype(np.float64).T
    return out


def embedding(token_ids: np.ndarray, table: Tensor) -> np.ndarray:
    """Embedding lookup (not scaled).

    token_ids: [T] int; table: [V, H] dense or quantized  ->  [T, H]
    """
    return _dequantize_rows(table, np.asarray(token_ids, dtype=np.int64))


def _rms_normalize64(x: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis.

    ``w`` is the multiplier: the canonical decoder, final and q/k norms are already ``1 + w``.
    x: [..., N]; w: [N]  ->  [..., N]
    """
    return (_rms_normalize64(_f32(x), eps) * _f32(w)).astype(np.float32)


def gated_rms_norm(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The DeltaNet output norm: RMS-normalise ``o``, multiply by ``w``, then by ``SiLU(z)``.

    The norm comes before the gate; ``w`` is a plain weight (no ``+1``), shared by all heads.
    o, z: [..., dv]; w: [dv]  ->  [..., dv]
    """
    z = np.asarray(_f32(z), dtype=np.float64)
    return (_rms_normalize64(_f32(o), eps) * _f32(w) * z * _sigmoid64(z)).astype(np.float32)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (eps added to the sum, FLA/HF style).

    x: [..., N]  ->  [..., N]
    """
    x = _f32(x)
    sum_square = np.sum(np.square(x.astype(np.float64)), axis=-1, keepdims=True)
    return (x / np.sqrt(sum_square + eps)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Gated full attention
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / rotary_dim), fp32 [rotary_dim / 2]: exponent, power and reciprocal each the IEEE
    fp32 result, rounded once from fp64 (numpy's own float32 ``power`` differs by an ulp between SIMD paths)."""
    exponent = (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim).astype(np.float32)
    power = (np.float64(np.float32(theta)) ** exponent.astype(np.float64)).astype(np.float32)
    return (1.0 / power.astype(np.float64)).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """Partial rotary embedding, rotate-half (NeoX) pairing, on the first ``rotary_dim`` dims.

    Pairs are (d, d + rotary_dim/2); the remaining dims pass through. Angles are formed in fp32,
    as every reference implementation (and the model's training) does: exponent, power, reciprocal and
    product each rounded once to fp32 from an fp64 result, so the angles are the IEEE fp32 ones on any
    CPU (numpy's own float32 ``power`` differs by an ulp between SIMD paths, and at position 250,000 an
    ulp of inv_freq moves the angle by 0.01 rad).
    x: [T, heads, D]; positions: [T] int  ->  [T, heads, D]
    """
    x = _f32(x)
    half = rotary_dim // 2
    inv_freq = rope_inv_freq(rotary_dim, theta)
    positions32 = np.asarray(positions, dtype=np.float32).astype(np.float64)
    angles = (positions32[:, None] * inv_freq.astype(np.float64)[None, :]).astype(np.float32)  # [T, half]
    cos = np.cos(angles.astype(np.float64))[:, None, :]
    sin = np.sin(angles.astype(np.float64))[:, None, :]
    first, second = x[..., :half].astype(np.float64), x[..., half:rotary_dim].astype(np.float64)
    out = x.copy()
    out[..., :half] = first * cos - second * sin
    out[..., half:rotary_dim] = second * cos + first * sin
    return out


def attention_prep(
    q_and_gate: np.ndarray,
    k: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    positions: np.ndarray,
    rotary_dim: int,
    theta: float,
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the q_proj output per head into query and gate, RMS-norm q and k, then rope them.

    The norms cover the whole head (all D dims) and come before RoPE. The gate is untouched.
    q_and_gate: [T, Hq, 2D] (per head: [query | gate]); k: [T, Hkv, D]; q_norm, k_norm: [D]
    (multipliers, already 1+w); positions: [T]  ->  q [T, Hq, D], gate [T, Hq, D], k [T, Hkv, D]
    """
    head_dim = k.shape[-1]
    q, gate = _f32(q_and_gate[..., :head_dim]), _f32(q_and_gate[..., head_dim:])
    q = rope(rms_norm(q, q_norm, eps), positions, rotary_dim, theta)
    k = rope(rms_norm(k, k_norm, eps), positions, rotary_dim, theta)
    return q, gate, k


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, gate: np.ndarray, offset: int | None = None) -> np.ndarray:
    """Causal grouped-query attention with a sigmoid output gate.

    Query t sits at position ``offset + t`` and sees keys 0 .. offset + t; by default
    ``offset = S - T`` (the new tokens are the last T of the cache). Query head h reads key/value
    head ``h // (Hq / Hkv)``. Scale 1/sqrt(D); softmax in fp64 for a clean reference.
    q, gate: [T, Hq, D]; k, v: [S, Hkv, D]  ->  [T, Hq, D] (= softmax(q k^T / sqrt(D)) v * sigmoid(gate))
    """
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if offset is None:
        offset = num_keys - num_tokens
    group = num_heads // num_kv_heads
    kv_head = np.arange(num_heads) // group
    q64 = q.astype(np.float64)
    k64 = k.astype(np.float64)[:, kv_head, :]  # [S, Hq, D]
    v64 = v.astype(np.float64)[:, kv_head, :]
    scores = np.einsum("thd,shd->hts", q64, k64) / np.sqrt(head_dim)  # [Hq, T, S]
    visible = np.arange(num_keys)[None, :] <= (offset + np.arange(num_tokens))[:, None]  # [T, S]
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v64).astype(np.float32)
    return out * _sigmoid(_f32(gate))


def attention_layer(
    x: np.ndarray,
    weights: Mapping[str, Tensor],
    cache: KVCache,
    positions: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    theta: float,
    eps: float,
) -> np.ndarray:
    """One gated full-attention token mixer (the ``self_attn`` block); appends to ``cache``.

    weights: the layer's ``self_attn.*`` tensors by their names below that prefix.
    x: [T, H]; positions: [T]  ->  [T, H]
    """
    num_tokens = x.shape[0]
    q_and_gate = qmatmul(x, weights["q_proj.weight"]).reshape(num_tokens, num_heads, 2 * head_dim)
    k = qmatmul(x, weights["k_proj.weight"]).reshape(num_tokens, num_kv_heads, head_dim)
    v = qmatmul(x, weights["v_proj.weight"]).reshape(num_tokens, num_kv_heads, head_dim)
    q, gate, k = attention_prep(
        q_and_gate, k, weights["q_norm.weight"], weights["k_norm.weight"], positions, rotary_dim, theta, eps
    )
    keys, values = cache.append(k, v)
    out = attention(q, keys, values, gate, offset=int(positions[0]))
    return qmatmul(out.reshape(num_tokens, num_heads * head_dim), weights["o_proj.weight"])


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------


def causal_conv1d(x: np.ndarray, w: np.ndarray, conv_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over time (no bias) followed by SiLU, continuing from ``conv_state``.

    ``out[t, c] = SiLU(sum_j w[c, j] * x~[t + j - (K-1), c])`` where x~ is ``conv_state``
    followed by ``x``; tap K-1 multiplies the current token. The new state is the last K-1 raw
    (pre-conv) inputs of x~.
    x: [T, C]; w: [C, K]; conv_state: [K-1, C]  ->  out [T, C], new conv_state [K-1, C]
    """
    num_tokens, num_taps = x.shape[0], w.shape[1]
    history = np.concatenate([_f32(conv_state), _f32(x)], axis=0)  # [K-1+T, C]
    out = np.zeros(x.shape, dtype=np.float64)
    for j in range(num_taps):
        out += _f32(w[:, j]) * history[j : j + num_tokens].astype(np.float64)
    return _silu(out), history[num_tokens:].copy()


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
    *, dtype: type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token, from ``state``.

    Value head j uses query/key head ``j // (Hv / Hk)``. For each token, per value head:
    decay ``S *= exp(g)``; error ``e = v - S^T k``; rank-1 write ``S += k (beta e)^T``; read
    ``o = S^T q`` AFTER the write. q and k come in already L2-normalised (q also scaled).
    ``dtype`` is the arithmetic's precision: float32 as the models run it, float64 for a reference free of rounding
    for kernels that order the arithmetic differently (the chunked prefill scan).
    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log-decay <= 0), beta: [T, Hv]; state: [Hv, dk, dv] fp32
    ->  o [T, Hv, dv], new state [Hv, dk, dv] (in ``dtype``)
    """
    num_v_heads = v.shape[1]
    k_head = np.arange(num_v_heads) // (num_v_heads // q.shape[1])
    cast = _f32 if dtype == np.float32 else (lambda x: np.asarray(x, dtype=dtype))
    q, k, v = cast(q)[:, k_head], cast(k)[:, k_head], cast(v)  # q, k now per value head
    decay, beta = np.exp(cast(g)), cast(beta)
    s = cast(state).copy()
    out = np.empty_like(v)
    for t in range(v.shape[0]):
        s *= decay[t][:, None, None]
        error = v[t] - np.einsum("hkv,hk->hv", s, k[t])
        s += k[t][:, :, None] * (beta[t][:, None] * error)[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def gated_delta(
    qkv: np.ndarray,
    z: np.ndarray,
    b: np.ndarray,
    a: np.ndarray,
    weights: Mapping[str, Tensor],
    conv_state: np.ndarray,
    recurrent_state: np.ndarray,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Gated DeltaNet mixer between its projections (the ``gated_delta_*`` kernels): causal conv + SiLU,
    L2 norms, gates, the delta rule and the gated RMSNorm, continuing from the layer's states.

    weights: ``conv1d.weight``, ``A_log``, ``dt_bias``, ``norm.weight`` of the layer's ``linear_attn``.
    Channels of ``qkv`` are ``[q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]``; only they are convolved.
    qkv: [T, C]; z: [T, Hv*dv]; b, a: [T, Hv]; conv_state: [K-1, C]; recurrent_state: [Hv, dk, dv]
    ->  y [T, Hv*dv], new conv_state, new recurrent_state
    """
    num_tokens = qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    mixed, conv_state = causal_conv1d(qkv, weights["conv1d.weight"], conv_state)
    q = mixed[:, :key_dim].reshape(num_tokens, num_k_heads, head_k_dim)
    k = mixed[:, key_dim : 2 * key_dim].reshape(num_tokens, num_k_heads, head_k_dim)
    v = mixed[:, 2 * key_dim :].reshape(num_tokens, num_v_heads, head_v_dim)
    q = l2_normalize(q) * np.float32(head_k_dim**-0.5)
    k = l2_normalize(k)

    beta = _sigmoid(b)
    a_log = _f32(weights["A_log"])
    g = -np.exp(a_log) * _softplus(_f32(a) + _f32(weights["dt_bias"]))  # log-decay, fp32

    o, recurrent_state = gated_delta_rule(q, k, v, g, beta, recurrent_state)
    z = _f32(z).reshape(num_tokens, num_v_heads, head_v_dim)
    y = gated_rms_norm(o, z, weights["norm.weight"], eps).reshape(num_tokens, num_v_heads * head_v_dim)
    return y, conv_state, recurrent_state


def gated_delta_layer(
    x: np.ndarray,
    weights: Mapping[str, Tensor],
    conv_state: np.ndarray,
    recurrent_state: np.ndarray,
    **dims: Any,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Gated DeltaNet token mixer (the ``linear_attn`` block): projections around ``gated_delta``.

    weights: the layer's ``linear_attn.*`` tensors by their names below that prefix
    (``in_proj_qkv.weight`` ...); dims: ``gated_delta``'s keyword arguments.
    x: [T, H]; conv_state: [K-1, C]; recurrent_state: [Hv, dk, dv]
    ->  out [T, H], new conv_state, new recurrent_state
    """
    projections = (qmatmul(x, weights[f"in_proj_{name}.weight"]) for name in ("qkv", "z", "b", "a"))
    y, conv_state, recurrent_state = gated_delta(*projections, weights, conv_state, recurrent_state, **dims)
    return qmatmul(y, weights["out_proj.weight"]), conv_state, recurrent_state


# ---------------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------------


def moe_route(router_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts (fp32), top-k, renormalise the k chosen probabilities to sum 1.

    Ties go to the lower expert id. Experts come out in descending probability.
    router_logits: [T, E]  ->  indices [T, k] int64, weights [T, k] fp32
    """
    logits = _f32(router_logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    indices = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(probs, indices, axis=-1)
    return indices.astype(np.int64), (chosen / chosen.sum(axis=-1, keepdims=True)).astype(np.float32)


def swiglu_experts(
    x: np.ndarray,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    indices: np.ndarray,
    weights: np.ndarray,
) -> np.ndarray:
    """Weighted sum of the selected SwiGLU experts: ``sum_r w_r * down_e(SiLU(gate_e x) * up_e x)``.

    x: [T, H]; gate_proj, up_proj: [E, I, H]; down_proj: [E, H, I] (dense or quantized);
    indices, weights: [T, k]  ->  [T, H]
    """
    x = _f32(x)
    out = np.zeros_like(x)
    for expert in np.unique(indices):
        tokens, ranks = np.nonzero(indices == expert)
        xs = x[tokens]
        hidden = _silu(qmatmul(xs, _dequantize_rows(gate_proj, int(expert)))) * qmatmul(
            xs, _dequantize_rows(up_proj, int(expert))
        )
        y = qmatmul(hidden, _dequantize_rows(down_proj, int(expert)))
        np.add.at(out, tokens, weights[tokens, ranks][:, None] * y)
    return out


def swiglu(x: np.ndarray, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> np.ndarray:
    """A dense SwiGLU MLP: ``down(SiLU(gate x) * up x)``.

    x: [T, H]; gate_proj, up_proj: [I, H]; down_proj: [H, I]  ->  [T, H]
    """
    return qmatmul(_silu(qmatmul(x, gate_proj)) * qmatmul(x, up_proj), down_proj)


def moe(x: np.ndarray, weights: Mapping[str, Tensor], *, num_experts_per_tok: int,
        on_route: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """The sparse MoE block: routed experts plus the sigmoid-gated, always-on shared expert.

    weights: the layer's ``mlp.*`` tensors by their names below that prefix (``gate.weight``,
    ``switch_mlp.gate_proj.weight`` ..., ``shared_expert.*``, ``shared_expert_gate.weight``).
    ``on_route`` (if given) is called with the chosen experts [T, k] (tests/test_dummy.py counts routing with it).
    x: [T, H]  ->  [T, H]
    """
    indices, routing_weights = moe_route(qmatmul(x, weights["gate.weight"]), num_experts_per_tok)
    if on_route is not None:
        on_route(indices)
    routed = swiglu_experts(
        x,
        weights["switch_mlp.gate_proj.weight"],
        weights["switch_mlp.up_proj.weight"],
        weights["switch_mlp.down_proj.weight"],
        indices,
        routing_weights,
    )
    shared = swiglu(
        x,
        weights["shared_expert.gate_proj.weight"],
        weights["shared_expert.up_proj.weight"],
        weights["shared_expert.down_proj.weight"],
    )
    return routed + _sigmoid(qmatmul(x, weights["shared_expert_gate.weight"])) * shared


# ---------------------------------------------------------------------------------------------
# Decode-time state
# ---------------------------------------------------------------------------------------------


def check_token_ids(token_ids: Any, vocab_size: int) -> np.ndarray:
    """``token_ids`` of a backend ``forward`` call as int64 [T]; ``ValueError`` unless they are a
    non-empty 1-D sequence of integers in ``[0, vocab_size)``."""
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"token_ids must be a non-empty 1-D sequence of integers; got shape {ids.shape}, dtype {ids.dtype}"
        )
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise ValueError(f"token_ids must lie in [0, {vocab_size}); got {ids[bad][0]}")
    return ids.astype(np.int64)


class KVCache:
    """Keys (after k_norm and RoPE) and values of one attention layer; capacity grows by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        self.length = 0
        self.keys = np.zeros((0, num_kv_heads, head_dim), dtype=np.float32)  # [capacity, Hkv, D]
        self.values = np.zeros_like(self.keys)

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store T new keys/values; return every cached key and value, [length, Hkv, D] each."""
        end = self.length + k.shape[0]
        # A restored state may hold read-only (e.g. memory-mapped) arrays: those are copied too.
        if end > self.keys.shape[0] or not (self.keys.flags.writeable and self.values.flags.writeable):
            capacity = max(end, 2 * self.keys.shape[0], KV_CACHE_MIN_CAPACITY)
            self.keys = self._grown(self.keys, capacity)
            self.values = self._grown(self.values, capacity)
        self.keys[self.length : end] = k
        self.values[self.length : end] = v
        self.length = end
        return self.keys[:end], self.values[:end]

    def _grown(self, cache: np.ndarray, capacity: int) -> np.ndarray:
        grown = np.zeros((capacity,) + cache.shape[1:], dtype=np.float32)
        grown[: self.length] = cache[: self.length]
        return grown


@dataclass
class DeltaNetState:
    """Conv state (the last K-1 raw ``in_proj_qkv`` outputs) and fp32 recurrent state of one layer."""

    conv: np.ndarray  # [K-1, C]
    recurrent: np.ndarray  # [Hv, dk, dv]


@dataclass
class State:
    """Everything a sequence carries between forward calls: one entry per layer, and the position."""

    layers: list[KVCache | DeltaNetState]
    position: int = 0

    def copy(self) -> State:
        """An independent snapshot: continuing either one leaves the other unchanged."""
        return _copy.deepcopy(self)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class _Scope(Mapping):
    """The weights below one name prefix, looked up on access (memory-mapped tensors stay lazy)."""

    def __init__(self, weights: Mapping[str, Tensor], prefix: str) -> None:
        self._weights, self._prefix = weights, prefix

    def __getitem__(self, name: str) -> Tensor:
        return self._weights[self._prefix + name]

    def __iter__(self) -> Iterator[str]:
        return (k[len(self._prefix) :] for k in self._weights if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ReferenceModel:
    """The numpy reference backend: ``new_state()`` and ``forward(token_ids, state)``.

    Built from a ``lily.checkpoint.Checkpoint`` (``.args``, ``.weights`` by canonical name).
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.args: ModelArgs = checkpoint.args
        self.weights: Mapping[str, Tensor] = checkpoint.weights
        #: called as ``on_route(layer, experts [T, k])`` by every MoE block of ``forward`` (None: not called)
        self.on_route: Callable[[int, np.ndarray], None] | None = None

    def _delta_net_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Shapes of one DeltaNet layer's conv state [K-1, C] and recurrent state [Hv, dk, dv]."""
        args = self.args
        return (args.linear_conv_kernel_dim - 1, args.conv_dim), (
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
        )

    def new_state(self) -> State:
        """Empty caches: no tokens seen, zero conv and recurrent states."""
        args = self.args
        conv_shape, recurrent_shape = self._delta_net_shapes()
        layers: list[KVCache | DeltaNetState] = []
        for layer_type in args.layer_types:
            if layer_type == FULL_ATTENTION:
                layers.append(KVCache(args.num_key_value_heads, args.head_dim))
            else:
                layers.append(
                    DeltaNetState(np.zeros(conv_shape, dtype=np.float32), np.zeros(recurrent_shape, dtype=np.float32))
                )
        return State(layers)

    def _check_inputs(self, token_ids: Any, state: State) -> np.ndarray:
        ids = check_token_ids(token_ids, self.args.vocab_size)
        if not self._owns(state):
            raise ValueError("state was not made by this model's new_state()")
        return ids

    def _owns(self, state: Any) -> bool:
        """Whether ``state`` has this model's layer pattern and state shapes."""
        if not isinstance(state, State) or len(state.layers) != len(self.args.layer_types):
            return False
        conv_shape, recurrent_shape = self._delta_net_shapes()
        kv_shape = (self.args.num_key_value_heads, self.args.head_dim)
        for layer_type, layer in zip(self.args.layer_types, state.layers):
            if layer_type == FULL_ATTENTION:
                ok = isinstance(layer, KVCache) and layer.keys.shape[1:] == kv_shape
            else:
                ok = (
                    isinstance(layer, DeltaNetState)
                    and layer.conv.shape == conv_shape
                    and layer.recurrent.shape == recurrent_shape
                )
            if not ok:
                return False
        return True

    def forward(self, token_ids: Any, state: State, *, last_only: bool = False) -> np.ndarray:
        """Run T tokens after the ``state.position`` tokens already seen; advance the state.

        One-shot prefill, chunked prefill and token-by-token decode are all this call.
        token_ids: [T] int  ->  logits [T, V] fp32, or the last row [1, V] with ``last_only``
        """
        ids = self._check_inputs(token_ids, state)
        args, w = self.args, self.weights
        eps = args.rms_norm_eps
        positions = state.position + np.arange(ids.shape[0])

        h = embedding(ids, w["embed_tokens.weight"])
        for layer, layer_state in enumerate(state.layers):
            prefix = f"layers.{layer}."
            a = rms_norm(h, w[prefix + "input_layernorm.weight"], eps)
            if isinstance(layer_state, KVCache):
                h = h + attention_layer(
                    a,
                    _Scope(w, prefix + "self_attn."),
                    layer_state,
                    positions,
                    num_heads=args.num_attention_heads,
                    num_kv_heads=args.num_key_value_heads,
                    head_dim=args.head_dim,
                    rotary_dim=args.rotary_dim,
                    theta=args.rope_theta,
                    eps=eps,
                )
            else:
                out, layer_state.conv, layer_state.recurrent = gated_delta_layer(
                    a,
                    _Scope(w, prefix + "linear_attn."),
                    layer_state.conv,
                    layer_state.recurrent,
                    num_k_heads=args.linear_num_key_heads,
                    num_v_heads=args.linear_num_value_heads,
                    head_k_dim=args.linear_key_head_dim,
                    head_v_dim=args.linear_value_head_dim,
                    eps=eps,
                )
                h = h + out
            m = rms_norm(h, w[prefix + "post_attention_layernorm.weight"], eps)
            on_route = None if self.on_route is None else functools.partial(self.on_route, layer)
            h = h + moe(m, _Scope(w, prefix + "mlp."), num_experts_per_tok=args.num_experts_per_tok, on_route=on_route)

        state.position += ids.shape[0]
        if last_only:
            h = h[-1:]
        return qmatmul(rms_norm(h, w["norm.weight"], eps), w["lm_head.weight"])
