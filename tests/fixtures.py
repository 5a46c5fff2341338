"""Tiny random ``qwen3_5_moe`` checkpoints for the tests.

API
---
``TINY_CONFIGS[variant]``
    text_config dicts of the tiny test models:

    * ``"kv64"``: the primary fixture (4 layers, attention at layer 3,
      dk = dv = 64, 8 experts top-2).
    * ``"dk32"``: as kv64 but ``linear_key_head_dim`` 32, so key-dim / value-dim mix-ups show.
    * ``"d96"``: as kv64 but attention head_dim 96.
    * ``"gqa4"``: hidden 192, 6 layers with attention at layers 2 and 5
      (``full_attention_interval`` 3), 8 q / 2 kv heads, GDN 2 k-heads / 6 v-heads,
      half rotary, 16 experts top-4.

``text_config(variant)``
    a deep copy of ``TINY_CONFIGS[variant]``.

``build_hf_model(variant, seed=0, *, randomize=True)``
    a transformers ``Qwen3_5MoeForCausalLM`` in fp32, eval mode, with every parameter random
    (``variant`` may also be a text_config dict).

``save_hf_checkpoint(model, out_dir, *, layout="fused"|"per_expert",
dtype="float32"|"bfloat16"|"float16", shards=1)``
    writes the real HF checkpoint layout (``model.language_model.*``, ``lm_head.weight``,
    fused or per-expert experts, a ``qwen3_5_moe`` config with nested ``text_config``, fake
    ``mtp.*`` and ``model.visual.*`` tensors, an index file when ``shards > 1``).

``save_mlx_checkpoint(hf_dir, out_dir, *, bits=4, dtype="bfloat16")``
    runs ``mlx_lm.convert`` (affine, group 64) on an HF fused checkpoint.

``relative_error(got, expected)``
    ``max|got - expected| / max|expected|`` in fp64, ``expected`` being the oracle's output.

Every Linear input dimension is a multiple of 64, so MLX group-64 quantization applies to all
of them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

_ROPE_QUARTER = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [3, 3, 2],
    "mrope_interleaved": True,
}

_KV64: dict = dict(
    vocab_size=1024,
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters=_ROPE_QUARTER,
    eos_token_id=1,
)

_GQA4: dict = dict(
    vocab_size=1152,
    hidden_size=192,
    num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.5,
        "mrope_section": [6, 6, 4],
        "mrope_interleaved": True,
    },
    eos_token_id=[1, 2],
)

TINY_CONFIGS: dict[str, dict] = {
    "kv64": _KV64,
    "dk32": {**_KV64, "linear_key_head_dim": 32},
    "gqa4": _GQA4,
    # head_dim 96: attention rows that are not a whole number of 64-float blocks (the CPU backend's register tiles)
    "d96": {**_KV64, "head_dim": 96, "rope_parameters": {**_ROPE_QUARTER, "mrope_section": [4, 4, 4]}},
}

_TINY_VISION_CONFIG = dict(
    depth=1,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)


def load_script(relative_path: str):
    """A script of the repository (``scripts/...``, not a package module) imported as a module, registered in
    ``sys.modules`` under ``script_<stem>`` (dataclasses and pickling look it up there)."""
    path = Path(__file__).resolve().parents[1] / relative_path
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def relative_error(got, expected) -> float:
    """max|got - expected| / max|expected|, in fp64; the shapes must match."""
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def text_config(variant: str) -> dict:
    """A deep copy of the text_config of ``variant`` (KeyError names the known variants)."""
    if variant not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny variant {variant!r}; known: {sorted(TINY_CONFIGS)}")
    return copy.deepcopy(TINY_CONFIGS[variant])


def _full_attention_interval(layer_types: list[str]) -> int | None:
    """The interval that reproduces ``layer_types`` (what mlx-lm reads), or None if none does."""
    if "full_attention" not in layer_types:
        return None
    step = layer_types.index("full_attention") + 1
    pattern = ["full_attention" if (i + 1) % step == 0 else "linear_attention" for i in range(len(layer_types))]
    return step if pattern == list(layer_types) else None


def build_hf_model(variant: str | dict, seed: int = 0, *, randomize: bool = True):
    """A transformers ``Qwen3_5MoeForCausalLM`` (fp32, eval) with every parameter randomised.

    ``variant`` is a key of ``TINY_CONFIGS`` or a text_config dict. Norm weights ~ N(0, 0.1)
    (so the 1+w convention matters), ``A_log = log(U(0.01, 16))``, everything else
    (``dt_bias`` included) ~ N(0, 0.1). ``randomize=False`` keeps transformers' own
    initialisation (faster, for tests where the values do not matter).
    """
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = copy.deepcopy(variant) if isinstance(variant, dict) else text_config(variant)
    cfg = Qwen3_5MoeTextConfig(**config)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    if not randomize:
        return model
    gen = torch.Generator().manual_seed(1234 + seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                uniform = torch.rand(param.shape, generator=gen) * (16.0 - 0.01) + 0.01
                param.copy_(torch.log(uniform))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def _real_layout_tensors(model, layout: str) -> dict:
    """The model's tensors under the real checkpoint names (``model.language_model.*``)."""
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    intermediate = model.config.moe_intermediate_size
    out: dict = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous()
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        if layout == "per_expert" and ".mlp.experts." in name:
            prefix = name.rsplit(".", 1)[0]
            for e in range(tensor.shape[0]):
                if name.endswith("gate_up_proj"):
                    out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :intermediate].clone()
                    out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, intermediate:].clone()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
            continue
        out[name] = tensor
    return out


def _extra_tensors(hidden: int, seed: int) -> dict:
    """A few MTP and vision tensors, as in the real checkpoint, that a text loader must skip."""
    import torch

    gen = torch.Generator().manual_seed(99 + seed)
    shapes = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.norm.weight": (hidden,),
        "mtp.layers.0.mlp.experts.0.gate_proj.weight": (64, hidden),
        "model.visual.patch_embed.proj.weight": (64, 3, 2, 16, 16),
        "model.visual.blocks.0.norm1.weight": (64,),
    }
    return {k: torch.randn(s, generator=gen) * 0.1 for k, s in shapes.items()}


def _checkpoint_config(model) -> dict:
    text = model.config.to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        text.pop(key, None)
    text["model_type"] = "qwen3_5_moe_text"
    interval = _full_attention_interval(text["layer_types"])
    if interval is not None:
        text["full_attention_interval"] = interval
    text["attn_output_gate"] = True
    text["mamba_ssm_dtype"] = "float32"
    vision = dict(_TINY_VISION_CONFIG, out_hidden_size=model.config.hidden_size)
    vocab = model.config.vocab_size
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": vocab - 24,
        "video_token_id": vocab - 23,
        "vision_start_token_id": vocab - 22,
        "vision_end_token_id": vocab - 21,
        "tie_word_embeddings": False,
    }


def save_hf_checkpoint(
    model,
    out_dir: str | Path,
    *,
    layout: str = "fused",
    dtype: str = "float32",
    shards: int = 1,
    seed: int = 0,
) -> Path:
    """Write ``model`` in the real HF checkpoint layout into ``out_dir``; returns the directory."""
    import torch
    from safetensors.torch import save_file

    torch_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in torch_dtypes:
        raise ValueError(f"dtype must be one of {sorted(torch_dtypes)}, got {dtype!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors = _real_layout_tensors(model, layout)
    tensors.update(_extra_tensors(model.config.hidden_size, seed))
    tensors = {k: v.to(torch_dtypes[dtype]).contiguous() for k, v in tensors.items()}

    config = _checkpoint_config(model)
    config["text_config"]["dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": model.config.eos_token_id, "do_sample": False})
    )

    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return out_dir
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({k: file_name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def save_mlx_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, bits: int = 4, dtype: str = "bfloat16") -> Path:
    """Quantize a fused HF checkpoint with ``mlx_lm.convert`` (affine, group 64) into ``out_dir``.

    ``out_dir`` must not exist yet. Checks that the router and shared-expert gate came out at
    8 bits, as in the mlx-community files.
    """
    import contextlib
    import io

    from mlx_lm.convert import convert

    out_dir = Path(out_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            str(hf_dir),
            mlx_path=str(out_dir),
            quantize=True,
            q_bits=bits,
            q_group_size=64,
            dtype=dtype,
        )
    quant = json.loads((out_dir / "config.json").read_text())["quantization"]
    for key in ("language_model.model.layers.0.mlp.gate", "language_model.model.layers.0.mlp.shared_expert_gate"):
        if quant.get(key, {}).get("bits") != 8:
            raise AssertionError(f"mlx_lm.convert did not quantize {key} at 8 bits: {quant.get(key)}")
    return out_dir
