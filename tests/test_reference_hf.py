"""The numpy reference against HF transformers (fp32), the independent oracle.

Whole model: the reference, loaded from a tiny random checkpoint through ``load_checkpoint``,
against the ``Qwen3_5MoeForCausalLM`` that wrote it, for every tiny variant and both expert
layouts. Ops: each reference op against the matching torch/transformers function on fresh
random inputs, at boundary lengths.

Relative error is ``max|a - b| / max|b|`` with ``b`` the oracle's output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures import TINY_CONFIGS, relative_error
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen

from lily import reference
from lily.checkpoint import load_checkpoint
from lily.reference import ReferenceModel

LOGITS_TOLERANCE = 1e-4  # fp32 model vs fp32 model
OP_TOLERANCE = 2e-6  # one fp32 op vs the same op in torch
PROMPT_LENGTH = 64
GREEDY_PROMPT_LENGTH = 16
GREEDY_STEPS = 32


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)[None]).logits[0].numpy()


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_prefill_logits_match_hf(tiny_checkpoints, variant: str, layout: str) -> None:
    hf_model = tiny_checkpoints.model(variant)
    model = ReferenceModel(load_checkpoint(tiny_checkpoints.hf(variant, layout=layout)))
    seed = {"fused": 11, "per_expert": 12}[layout] + 100 * list(TINY_CONFIGS).index(variant)
    tokens = np.random.default_rng(seed).integers(0, hf_model.config.vocab_size, PROMPT_LENGTH)

    logits = model.forward(tokens, model.new_state())

    assert logits.dtype == np.float32
    assert relative_error(logits, hf_logits(hf_model, tokens)) <= LOGITS_TOLERANCE


def test_greedy_decode_matches_hf_cached_decode(tiny_checkpoints, variant: str) -> None:
    hf_model = tiny_checkpoints.model(variant)
    model = ReferenceModel(load_checkpoint(tiny_checkpoints.hf(variant)))
    seed = 21 + list(TINY_CONFIGS).index(variant)
    prompt = np.random.default_rng(seed).integers(0, hf_model.config.vocab_size, GREEDY_PROMPT_LENGTH)

    hf_tokens, hf_steps = [], []
    with torch.no_grad():
        out = hf_model(torch.from_numpy(prompt)[None], use_cache=True)
        for _ in range(GREEDY_STEPS):
            hf_steps.append(out.logits[0, -1].numpy())
            hf_tokens.append(int(hf_steps[-1].argmax()))
            out = hf_model(torch.tensor([[hf_tokens[-1]]]), cache=out.cache, use_cache=True)

    state = model.new_state()
    step_logits = model.forward(prompt, state)[-1]
    tokens, steps = [], []
    for _ in range(GREEDY_STEPS):
        steps.append(step_logits)
        tokens.append(int(step_logits.argmax()))
        step_logits = model.forward([tokens[-1]], state)[0]

    assert tokens == hf_tokens
    assert state.position == GREEDY_PROMPT_LENGTH + GREEDY_STEPS
    assert relative_error(np.stack(steps), np.stack(hf_steps)) <= LOGITS_TOLERANCE


# ---- ops against torch / transformers -------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("num_k_heads,num_v_heads,head_k_dim,head_v_dim", [(2, 4, 32, 64), (3, 3, 64, 64)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])  # float64: the chunked kernel tests' reference
def test_gated_delta_rule_matches_hf_chunked_and_recurrent(
    num_tokens: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, dtype: type
) -> None:
    rng = np.random.default_rng(1000 + num_tokens + num_v_heads)
    q = rng.standard_normal((num_tokens, num_k_heads, head_k_dim), dtype=np.float32)
    k = rng.standard_normal((num_tokens, num_k_heads, head_k_dim), dtype=np.float32)
    v = rng.standard_normal((num_tokens, num_v_heads, head_v_dim), dtype=np.float32)
    g = -rng.uniform(0.0, 2.0, (num_tokens, num_v_heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (num_tokens, num_v_heads)).astype(np.float32)
    state = rng.standard_normal((num_v_heads, head_k_dim, head_v_dim), dtype=np.float32) * 0.1

    out, new_state = reference.gated_delta_rule(
        reference.l2_normalize(q) * np.float32(head_k_dim**-0.5), reference.l2_normalize(k), v, g, beta, state,
        dtype=dtype,
    )
    assert out.dtype == dtype and new_state.dtype == dtype

    def torch_args():
        tensors = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
        return dict(zip(("query", "key", "value", "g", "beta"), tensors)) | dict(
            initial_state=torch.from_numpy(state)[None], output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    for oracle in (hf_qwen.torch_recurrent_gated_delta_rule, hf_qwen.torch_chunk_gated_delta_rule):
        expected_out, expected_state = oracle(**torch_args())
        assert relative_error(out, expected_out[0].numpy()) <= 1e-5, oracle.__name__
        assert relative_error(new_state, expected_state[0].numpy()) <= 1e-5, oracle.__name__


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 37])
def test_causal_conv1d_matches_torch_conv1d(num_tokens: int) -> None:
    channels, taps = 96, 4
    rng = np.random.default_rng(2000 + num_tokens)
    x = rng.standard_normal((num_tokens, channels), dtype=np.float32)
    w = rng.standard_normal((channels, taps), dtype=np.float32)
    conv_state = rng.standard_normal((taps - 1, channels), dtype=np.float32)

    out, new_state = reference.causal_conv1d(x, w, conv_state)

    history = torch.from_numpy(np.concatenate([conv_state, x])).T[None]  # [1, C, K-1+T]
    expected = F.silu(F.conv1d(history, torch.from_numpy(w)[:, None, :], groups=channels))[0].T
    assert relative_error(out, expected.numpy()) <= OP_TOLERANCE
    np.testing.assert_array_equal(new_state, np.concatenate([conv_state, x])[-(taps - 1) :])


@pytest.mark.parametrize(
    "rotary_dim,theta,start", [(16, 1e7, 0), (32, 1e6, 5), (64, 1e7, 250_000)], ids=["quarter", "half", "far"]
)
def test_rope_matches_hf_rotary_embedding(rotary_dim: int, theta: float, start: int) -> None:
    head_dim, num_heads, num_tokens = 64, 3, 9
    config = hf_qwen.Qwen3_5MoeTextConfig(
        head_dim=head_dim,
        hidden_size=128,
        num_attention_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": rotary_dim / head_dim,
            "mrope_section": [rotary_dim // 6, rotary_dim // 6, rotary_dim // 2 - 2 * (rotary_dim // 6)],
            "mrope_interleaved": True,
        },
    )
    rng = np.random.default_rng(3000 + rotary_dim)
    x = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    positions = start + np.arange(num_tokens)

    got = reference.rope(x, positions, rotary_dim, theta)

    position_ids = torch.from_numpy(positions)[None, None].expand(3, 1, -1)  # the 3 M-RoPE streams
    cos, sin = hf_qwen.Qwen3_5MoeTextRotaryEmbedding(config)(torch.zeros(1), position_ids)
    x_torch = torch.from_numpy(x).transpose(0, 1)[None]  # [1, heads, T, D]
    expected, _ = hf_qwen.apply_rotary_pos_emb(x_torch, x_torch, cos, sin)
    assert relative_error(got, expected[0].transpose(0, 1).numpy()) <= OP_TOLERANCE
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("num_tokens,num_cached", [(1, 0), (1, 40), (7, 0), (5, 33)])
def test_attention_matches_torch_sdpa(num_tokens: int, num_cached: int) -> None:
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    rng = np.random.default_rng(4000 + num_tokens + num_cached)
    q = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    gate = rng.standard_normal((num_tokens, num_heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((num_cached + num_tokens, num_kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((num_cached + num_tokens, num_kv_heads, head_dim), dtype=np.float32)

    got = reference.attention(q, k, v, gate, offset=num_cached)

    visible = torch.ones(num_tokens, num_cached + num_tokens, dtype=torch.bool).tril(diagonal=num_cached)
    as_torch = [torch.from_numpy(a).transpose(0, 1)[None] for a in (q, k, v)]  # [1, heads, len, D]
    expected = F.scaled_dot_product_attention(*as_torch, attn_mask=visible, enable_gqa=True)[0].transpose(0, 1)
    expected = expected * torch.sigmoid(torch.from_numpy(gate))
    assert relative_error(got, expected.numpy()) <= OP_TOLERANCE


def test_moe_route_matches_hf_router() -> None:
    num_tokens, hidden, num_experts, top_k = 40, 64, 16, 4
    config = hf_qwen.Qwen3_5MoeTextConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k)
    router = hf_qwen.Qwen3_5MoeTopKRouter(config)
    rng = np.random.default_rng(5000)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((num_experts, hidden), dtype=np.float32)))
        _, expected_weights, expected_indices = router(torch.from_numpy(x))

    indices, weights = reference.moe_route(reference.qmatmul(x, router.weight.detach().numpy()), top_k)

    np.testing.assert_array_equal(indices, expected_indices.numpy())
    assert relative_error(weights, expected_weights.numpy()) <= OP_TOLERANCE


def test_moe_route_breaks_ties_by_lower_expert_id() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    indices, weights = reference.moe_route(logits, 3)
    np.testing.assert_array_equal(indices, [[1, 3, 2], [0, 1, 2]])
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(weights[1], 1.0 / 3.0, rtol=1e-6)


def layer_weights(checkpoint, prefix: str) -> dict:
    """The checkpoint's tensors below ``prefix``, named relative to it."""
    return {name[len(prefix) :]: t for name, t in checkpoint.weights.items() if name.startswith(prefix)}


@pytest.mark.parametrize("variant_name", ["kv64", "dk32"])
def test_gated_delta_net_and_moe_blocks_match_hf(tiny_checkpoints, variant_name: str) -> None:
    """Layer 0's DeltaNet mixer and MoE block, each on the same random hidden states."""
    hf_model = tiny_checkpoints.model(variant_name)
    checkpoint = load_checkpoint(tiny_checkpoints.hf(variant_name))
    config = hf_model.config
    empty = ReferenceModel(checkpoint).new_state().layers[0]
    x = np.random.default_rng(6000).standard_normal((23, config.hidden_size), dtype=np.float32)

    mixer_out, _, _ = reference.gated_delta_layer(
        x,
        layer_weights(checkpoint, "layers.0.linear_attn."),
        empty.conv,
        empty.recurrent,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        eps=config.rms_norm_eps,
    )
    moe_out = reference.moe(
        x, layer_weights(checkpoint, "layers.0.mlp."), num_experts_per_tok=config.num_experts_per_tok
    )

    hf_layer = hf_model.model.layers[0]
    with torch.no_grad():
        expected_mixer = hf_layer.linear_attn(torch.from_numpy(x)[None])[0].numpy()
        expected_moe = hf_layer.mlp(torch.from_numpy(x)[None])[0].numpy()
    assert relative_error(mixer_out, expected_mixer) <= 1e-5
    assert relative_error(moe_out, expected_moe) <= 1e-5
