"""lily.config.ModelArgs: the config layouts it reads and the invalid configs it rejects."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fixtures import TINY_CONFIGS, text_config
from lily.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, ModelArgs


def _wrapped(text: dict) -> dict:
    """A top-level qwen3_5_moe config around ``text``, as in the real checkpoints."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {**copy.deepcopy(text), "model_type": "qwen3_5_moe_text"},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }


def _real_35b_text_config() -> dict:
    """The published Qwen3.6-35B-A3B text_config values."""
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 262144,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "eos_token_id": 248044,
        "dtype": "bfloat16",
    }


def test_real_35b_config() -> None:
    args = ModelArgs.from_dict(_wrapped(_real_35b_text_config()))
    assert args.full_attention_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39)
    assert len(args.linear_attention_layers) == 30
    assert args.rotary_dim == 64
    assert args.rope_theta == 1e7
    assert args.linear_key_dim == 2048 and args.linear_value_dim == 4096 and args.conv_dim == 8192
    assert args.eos_token_ids == (248044,)
    assert args.max_position_embeddings == 262144
    assert args.quantization is None


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_generated_checkpoint_configs(variant: str, tiny_checkpoints) -> None:
    expected = TINY_CONFIGS[variant]
    for directory in (tiny_checkpoints.hf(variant), tiny_checkpoints.mlx(variant)):
        args = ModelArgs.from_file(directory / "config.json")
        assert ModelArgs.from_file(directory) == args
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_value_heads",
        ):
            assert getattr(args, key) == expected[key], key
        assert args.layer_types == tuple(expected["layer_types"])
        assert args.partial_rotary_factor == expected["rope_parameters"]["partial_rotary_factor"]
        assert args.rope_theta == expected["rope_parameters"]["rope_theta"]
        eos = expected["eos_token_id"]
        assert args.eos_token_ids == tuple(eos if isinstance(eos, list) else [eos])
    mlx_args = ModelArgs.from_file(tiny_checkpoints.mlx(variant))
    assert mlx_args.quantization["bits"] == 4 and mlx_args.quantization["group_size"] == 64


def test_text_only_config_from_transformers() -> None:
    from transformers import Qwen3_5MoeTextConfig

    hf = Qwen3_5MoeTextConfig(**text_config("dk32")).to_dict()
    args = ModelArgs.from_dict(hf)
    assert args == ModelArgs.from_dict(_wrapped(text_config("dk32")))
    assert args.linear_key_dim == 2 * 32 and args.linear_value_dim == 4 * 64 and args.conv_dim == 2 * 64 + 256


def test_legacy_rope_fields_and_interval_only() -> None:
    text = _real_35b_text_config()
    del text["rope_parameters"], text["layer_types"]
    text["rope_theta"] = 5e6
    text["partial_rotary_factor"] = 0.5
    text["full_attention_interval"] = 5
    args = ModelArgs.from_dict(_wrapped(text))
    assert args.rope_theta == 5e6 and args.rotary_dim == 128
    assert args.full_attention_layers == (4, 9, 14, 19, 24, 29, 34, 39)
    del text["partial_rotary_factor"], text["full_attention_interval"]
    args = ModelArgs.from_dict(_wrapped(text))
    assert args.partial_rotary_factor == 0.25  # transformers' backwards-compatible default
    assert args.full_attention_layers == tuple(range(3, 40, 4))


def test_mlx_style_rope_type_key_and_eos_lists() -> None:
    text = _real_35b_text_config()
    text["rope_parameters"] = {"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    text["eos_token_id"] = [248046, 248044]
    config = _wrapped(text)
    config["eos_token_id"] = 248044
    assert ModelArgs.from_dict(config).eos_token_ids == (248046, 248044)


def _set(path: str, value):
    def edit(config: dict) -> None:
        *parents, leaf = path.split(".")
        target = config
        for p in parents:
            target = target[p]
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value

    return edit


_DELETE = object()

_BAD = [
    ("model_type", "llama", "model_type"),
    ("text_config", _DELETE, "text_config"),
    ("text_config.model_type", "qwen3_next", "text_config.model_type"),
    ("text_config.hidden_size", _DELETE, "text_config.hidden_size"),
    ("text_config.num_experts", _DELETE, "text_config.num_experts"),
    ("text_config.rms_norm_eps", _DELETE, "text_config.rms_norm_eps"),
    ("text_config.head_dim", 0, "text_config.head_dim"),
    ("text_config.vocab_size", -5, "text_config.vocab_size"),
    ("text_config.num_hidden_layers", True, "text_config.num_hidden_layers"),
    ("text_config.moe_intermediate_size", "512", "text_config.moe_intermediate_size"),
    ("text_config.num_experts_per_tok", 300, "num_experts_per_tok"),
    ("text_config.num_key_value_heads", 3, "text_config.num_attention_heads"),
    ("text_config.linear_num_key_heads", 5, "text_config.linear_num_value_heads"),
    ("text_config.layer_types", ["linear_attention"] * 39, "text_config.layer_types"),
    ("text_config.layer_types", ["linear_attention"] * 39 + ["sliding_attention"], "text_config.layer_types[39]"),
    ("text_config.full_attention_interval", 3, "text_config.layer_types"),
    ("text_config.full_attention_interval", 0, "text_config.full_attention_interval"),
    ("text_config.rope_parameters.partial_rotary_factor", 0.3, "partial_rotary_factor"),
    ("text_config.rope_parameters.partial_rotary_factor", 69 / 256, "partial_rotary_factor"),
    ("text_config.rope_parameters.partial_rotary_factor", 1.5, "partial_rotary_factor"),
    ("text_config.rope_parameters.rope_type", "yarn", "rope_type"),
    ("text_config.rope_parameters.rope_theta", _DELETE, "rope_theta"),
    ("text_config.rope_parameters.rope_theta", float("nan"), "rope_theta"),
    ("text_config.rms_norm_eps", 0, "rms_norm_eps"),
    ("text_config.attn_output_gate", False, "attn_output_gate"),
    ("text_config.hidden_act", "gelu", "hidden_act"),
    ("text_config.tie_word_embeddings", True, "text_config.tie_word_embeddings"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("text_config.eos_token_id", [1, "x"], "eos_token_id"),
    ("quantization", [4, 64], "quantization"),
]


@pytest.mark.parametrize(("path", "value", "field"), _BAD, ids=[f"{p}={v!r}"[:60] for p, v, _ in _BAD])
def test_invalid_configs_name_field_and_file(tmp_path: Path, path: str, value, field: str) -> None:
    config = _wrapped(_real_35b_text_config())
    _set(path, value)(config)
    file = tmp_path / "config.json"
    file.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        ModelArgs.from_file(file)
    message = str(info.value)
    assert str(file) in message and field in message, message


def test_unreadable_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        ModelArgs.from_file(tmp_path / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        ModelArgs.from_file(bad)


def test_layer_type_constants() -> None:
    args = ModelArgs.from_dict(_wrapped(text_config("gqa4")))
    assert set(args.layer_types) == {LINEAR_ATTENTION, FULL_ATTENTION}
    assert args.full_attention_layers == (2, 5)
    assert args.rotary_dim == 32
