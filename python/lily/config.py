"""The validated text configuration of a ``qwen3_5_moe`` checkpoint (``ModelArgs``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)

_POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "max_position_embeddings",
)

# Keys that the architecture fixes: a checkpoint saying otherwise is a different model.
_FIXED_VALUES: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attn_output_gate": True,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


class ConfigError(ValueError):
    """A config.json that is not a valid Qwen3.5/3.6-MoE text configuration."""


def read_json_object(path: Path, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object stored in ``path``; an unreadable file, invalid JSON or another JSON value
    raises ``error`` with a message that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def eos_id_list(value: Any, where: str, error: type[ValueError] = ConfigError) -> list[int]:
    """An ``eos_token_id`` field (one id, a list of ids, or absent) as a list of ids; anything else
    raises ``error`` prefixed by ``where`` (the file and field)."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise error(f"{where}: must be a non-negative integer or a list of them, got {value!r}")
    return values


@dataclass(frozen=True)
class ModelArgs:
    """The text-model hyper-parameters of a Qwen3.5/3.6-35B-A3B-family checkpoint."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    quantization: Mapping[str, Any] | None = None

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (64 for the real model)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the gated full-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        """Width of the DeltaNet q and k projections (linear_num_key_heads × linear_key_head_dim)."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Width of the DeltaNet v and z projections (linear_num_value_heads × linear_value_head_dim)."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet causal conv (q | k | v)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, source: str = "config") -> "ModelArgs":
        """Validate a ``qwen3_5_moe`` (nested ``text_config``) or ``qwen3_5_moe_text`` config.

        ``source`` names the file in error messages. Raises :class:`ConfigError`.
        """
        return _Parser(source).parse(config)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        """Read and validate a config.json (or the config.json inside a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        return cls.from_dict(read_json_object(path, ConfigError), source=str(path))


class _Parser:
    """Reads one config dict, raising ConfigError messages that name the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.prefix = ""

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{field}: {message}")

    def parse(self, config: Mapping[str, Any]) -> ModelArgs:
        if not isinstance(config, Mapping):
            raise ConfigError(f"{self.source}: expected a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type == "qwen3_5_moe":
            text = config.get("text_config")
            if not isinstance(text, Mapping):
                raise self.error("text_config", "missing or not an object (required for model_type qwen3_5_moe)")
            if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
                self.prefix = "text_config."
                raise self.error("model_type", f"expected 'qwen3_5_moe_text', got {text.get('model_type')!r}")
            if config.get("tie_word_embeddings", False) is not False:
                raise self.error("tie_word_embeddings", "tied embeddings are not supported (expected false)")
            self.prefix = "text_config."
            top = config
        elif model_type == "qwen3_5_moe_text":
            text = top = config
        else:
            raise self.error(
                "model_type",
                f"unsupported model type {model_type!r}; Lily runs 'qwen3_5_moe' (Qwen3.5/3.6-35B-A3B) only",
            )

        ints = {name: self.positive_int(text, name) for name in _POSITIVE_INT_FIELDS}
        for key, expected in _FIXED_VALUES.items():
            if key in text and text[key] != expected:
                raise self.error(key, f"unsupported value {text[key]!r}; this architecture needs {expected!r}")
        tie = text.get("tie_word_embeddings", False)
        if tie is not False:
            raise self.error("tie_word_embeddings", f"tied embeddings are not supported (got {tie!r})")

        layer_types = self.layer_types(text, ints["num_hidden_layers"])
        rope_theta, partial = self.rope(text)
        eps = self.number(text, "rms_norm_eps")
        if not 0 < eps < 1:
            raise self.error("rms_norm_eps", f"must be in (0, 1), got {eps!r}")

        self.check_divisible(ints, "num_attention_heads", "num_key_value_heads")
        self.check_divisible(ints, "linear_num_value_heads", "linear_num_key_heads")
        if ints["num_experts_per_tok"] > ints["num_experts"]:
            raise self.error(
                "num_experts_per_tok",
                f"{ints['num_experts_per_tok']} exceeds num_experts {ints['num_experts']}",
            )
        rotary = ints["head_dim"] * partial
        if rotary != int(rotary) or rotary <= 0 or int(rotary) % 2 or rotary > ints["head_dim"]:
            raise self.error(
                "rope_parameters.partial_rotary_factor",
                f"{partial!r} × head_dim {ints['head_dim']} gives rotary dim {rotary:g}; "
                "it must be an even integer, positive and at most head_dim",
            )

        return ModelArgs(
            layer_types=layer_types,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            tie_word_embeddings=False,
            eos_token_ids=self.eos_ids(text, top),
            quantization=self.quantization(top),
            **ints,
        )

    def positive_int(self, d: Mapping[str, Any], name: str) -> int:
        if name not in d:
            raise self.error(name, "missing required field")
        value = d[name]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(name, f"must be a positive integer, got {value!r}")
        return value

    def number(self, d: Mapping[str, Any], name: str, field: str | None = None) -> float:
        field = field or name
        if name not in d:
            raise self.error(field, "missing required field")
        value = d[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(field, f"must be a finite number, got {value!r}")
        return float(value)

    def check_divisible(self, ints: dict[str, int], heads: str, groups: str) -> None:
        if ints[heads] % ints[groups]:
            raise self.error(heads, f"{ints[heads]} is not divisible by {groups} {ints[groups]}")

    def layer_types(self, text: Mapping[str, Any], n_layers: int) -> tuple[str, ...]:
        interval = text.get("full_attention_interval")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0):
            raise self.error("full_attention_interval", f"must be a positive integer, got {interval!r}")
        from_interval = None
        if interval is not None or text.get("layer_types") is None:
            step = interval if interval is not None else 4
            from_interval = tuple(FULL_ATTENTION if (i + 1) % step == 0 else LINEAR_ATTENTION for i in range(n_layers))
        types = text.get("layer_types")
        if types is None:
            return from_interval
        if not isinstance(types, list) or len(types) != n_layers:
            length = len(types) if isinstance(types, list) else type(types).__name__
            raise self.error("layer_types", f"must be a list of num_hidden_layers={n_layers} entries, got {length}")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise self.error(f"layer_types[{i}]", f"unknown layer type {t!r}; expected one of {LAYER_TYPES}")
        if from_interval is not None and tuple(types) != from_interval:
            raise self.error(
                "layer_types",
                f"disagrees with full_attention_interval={interval} (mlx-lm builds layers from the interval)",
            )
        return tuple(types)

    def rope(self, text: Mapping[str, Any]) -> tuple[float, float]:
        params = text.get("rope_parameters")
        if params is None:
            # Legacy layout: rope_theta / partial_rotary_factor at the top of text_config.
            legacy_scaling = text.get("rope_scaling")
            if legacy_scaling:
                kind = (
                    legacy_scaling.get("rope_type", legacy_scaling.get("type"))
                    if isinstance(legacy_scaling, Mapping)
                    else legacy_scaling
                )
                if kind not in (None, "default"):
                    raise self.error(
                        "rope_scaling", f"unsupported RoPE scaling {kind!r}; only 'default' RoPE is supported"
                    )
            theta = self.number(text, "rope_theta")
            partial = self.number(text, "partial_rotary_factor") if "partial_rotary_factor" in text else 0.25
        else:
            if not isinstance(params, Mapping):
                raise self.error("rope_parameters", f"must be an object, got {type(params).__name__}")
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                raise self.error(
                    "rope_parameters.rope_type", f"unsupported RoPE type {kind!r}; only 'default' is supported"
                )
            theta = self.number(params, "rope_theta", "rope_parameters.rope_theta")
            if "partial_rotary_factor" in params:
                partial = self.number(params, "partial_rotary_factor", "rope_parameters.partial_rotary_factor")
            elif "partial_rotary_factor" in text:
                partial = self.number(text, "partial_rotary_factor")
            else:
                partial = 0.25
        if theta <= 0:
            raise self.error("rope_parameters.rope_theta", f"must be positive, got {theta!r}")
        if not 0 < partial <= 1:
            raise self.error("rope_parameters.partial_rotary_factor", f"must be in (0, 1], got {partial!r}")
        return theta, partial

    def eos_ids(self, text: Mapping[str, Any], top: Mapping[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        for d in (text, top):
            field = f"{self.prefix if d is text else ''}eos_token_id"
            for v in eos_id_list(d.get("eos_token_id"), f"{self.source}: {field}"):
                if v not in ids:
                    ids.append(v)
        return tuple(ids)

    def quantization(self, top: Mapping[str, Any]) -> Mapping[str, Any] | None:
        quant = top.get("quantization")
        if quant is None:
            quant = top.get("quantization_config")
            if quant is None:
                return None
        if not isinstance(quant, Mapping):
            raise ConfigError(f"{self.source}: quantization: must be an object, got {type(quant).__name__}")
        return quant


# The text configuration of Qwen3.6-35B-A3B (its config.json on the Hugging Face Hub), for plans and dummy weights
# without a checkpoint.
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
