"""lily.checkpoint against mlx-lm's own loader (sanitize) and converter, plus every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures
from lily.checkpoint import CheckpointError, SafetensorsFile, canonical_shapes, load_checkpoint
from lily.config import ConfigError
from lily.quant import QuantizedTensor, round_to_dtype

_MLX_PREFIXES = (("language_model.model.", ""), ("language_model.lm_head.", "lm_head."))


def _mlx_params(directory: Path) -> dict[str, np.ndarray]:
    """mlx-lm's view of a checkpoint: sanitised parameters under canonical names, as numpy."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(directory))
    out = {}
    for name, value in tree_flatten(model.parameters()):
        for prefix, repl in _MLX_PREFIXES:
            if name.startswith(prefix):
                name = repl + name[len(prefix) :]
        if value.dtype in (mx.bfloat16, mx.float16):
            value = value.astype(mx.float32)
        out[name] = np.array(value)
    return out


def _mlx_canonical(params: dict[str, np.ndarray], name: str) -> np.ndarray:
    value = params[name]
    return value.reshape(value.shape[:2]) if name.endswith("conv1d.weight") else value


def _assert_matches_mlx(ckpt, params: dict[str, np.ndarray], *, norm_dtype: str = "float32") -> None:
    """Every canonical tensor equals mlx-lm's parameter bit for bit (norms: after rounding to
    ``norm_dtype``, since mlx adds the +1 in the storage dtype while Lily adds it in fp32)."""
    weights = ckpt.weights
    plain = {n[: -len(".scales")] + ".weight" for n in params if n.endswith(".scales")}
    assert set(weights) == {n for n in params if not n.endswith((".scales", ".biases"))}
    for name in weights:
        tensor = weights[name]
        if name in plain:
            module = name[: -len(".weight")]
            assert isinstance(tensor, QuantizedTensor), name
            np.testing.assert_array_equal(tensor.weight, params[name], err_msg=name)
            np.testing.assert_array_equal(tensor.scales, params[module + ".scales"], err_msg=name)
            np.testing.assert_array_equal(tensor.biases, params[module + ".biases"], err_msg=name)
            continue
        assert isinstance(tensor, np.ndarray) and tensor.dtype == np.float32, name
        expected = _mlx_canonical(params, name)
        if ckpt.format == "hf" and name.endswith("norm.weight") and "linear_attn" not in name:
            tensor = round_to_dtype(tensor, norm_dtype)
        np.testing.assert_array_equal(tensor, expected, err_msg=name)


def test_hf_fused_matches_mlx_sanitize(variant_hf_dir: Path, variant: str) -> None:
    ckpt = load_checkpoint(variant_hf_dir)
    assert ckpt.format == "hf"
    assert set(ckpt.weights) == set(canonical_shapes(ckpt.args))
    assert ckpt.args.layer_types == tuple(fixtures.TINY_CONFIGS[variant]["layer_types"])
    _assert_matches_mlx(ckpt, _mlx_params(variant_hf_dir))
    for name in ckpt.weights:
        assert ckpt.weights[name].shape == ckpt.weights.shape(name)


def test_hf_norms_and_experts_against_torch(tiny_checkpoints, tiny_hf_dir: Path) -> None:
    """The conventions themselves, checked on the torch parameters: 1+w norms (except the
    DeltaNet gated norm), gate rows first in gate_up, conv [C, 1, K] squeezed, fp32 A_log."""
    model = tiny_checkpoints.model("kv64")
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = load_checkpoint(tiny_hf_dir).weights
    inter = model.config.moe_intermediate_size
    np.testing.assert_array_equal(w["norm.weight"], sd["model.norm.weight"] + 1)
    np.testing.assert_array_equal(
        w["layers.3.self_attn.q_norm.weight"], sd["model.layers.3.self_attn.q_norm.weight"] + 1
    )
    np.testing.assert_array_equal(w["layers.0.linear_attn.norm.weight"], sd["model.layers.0.linear_attn.norm.weight"])
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(w["layers.1.mlp.switch_mlp.gate_proj.weight"], gate_up[:, :inter])
    np.testing.assert_array_equal(w["layers.1.mlp.switch_mlp.up_proj.weight"], gate_up[:, inter:])
    np.testing.assert_array_equal(
        w["layers.2.linear_attn.conv1d.weight"], sd["model.layers.2.linear_attn.conv1d.weight"][:, 0, :]
    )
    assert w["layers.0.linear_attn.A_log"].dtype == np.float32


def test_per_expert_sharded_bf16_equals_fused(tiny_checkpoints) -> None:
    fused = load_checkpoint(tiny_checkpoints.hf("kv64", dtype="bfloat16")).weights
    split = load_checkpoint(tiny_checkpoints.hf("kv64", layout="per_expert", dtype="bfloat16", shards=3))
    assert len(split.files) == 3
    assert set(split.weights) == set(fused)
    for name in fused:
        np.testing.assert_array_equal(split.weights[name], fused[name], err_msg=name)
        assert split.weights.dtype(name) == "bfloat16"


def test_float16_checkpoint_matches_mlx_sanitize(tiny_checkpoints) -> None:
    directory = tiny_checkpoints.hf("dk32", dtype="float16")
    ckpt = load_checkpoint(directory)
    assert ckpt.weights.dtype("lm_head.weight") == "float16"
    _assert_matches_mlx(ckpt, _mlx_params(directory), norm_dtype="float16")


def test_transformers_save_pretrained_layout(tiny_checkpoints, tiny_hf_dir: Path, tmp_path: Path) -> None:
    """transformers writes the text-only model per expert under ``model.*``; same tensors."""
    tiny_checkpoints.model("kv64").save_pretrained(tmp_path / "saved")
    saved = load_checkpoint(tmp_path / "saved").weights
    fused = load_checkpoint(tiny_hf_dir).weights
    assert set(saved) == set(fused)
    for name in fused:
        np.testing.assert_array_equal(saved[name], fused[name], err_msg=name)


def test_tensors_are_read_only_and_shared_while_held(tiny_hf_dir: Path) -> None:
    weights = load_checkpoint(tiny_hf_dir).weights
    norm = weights["norm.weight"]
    assert weights["norm.weight"] is norm
    with pytest.raises(ValueError):
        norm[0] = 0.0
    with pytest.raises(ValueError):
        weights["lm_head.weight"][0, 0] = 0.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mlx_4bit_matches_mlx_lm(tiny_checkpoints, dtype: str) -> None:
    directory = tiny_checkpoints.mlx("kv64", bits=4, dtype=dtype)
    ckpt = load_checkpoint(directory)
    assert ckpt.format == "mlx"
    params = _mlx_params(directory)
    _assert_matches_mlx(ckpt, params)
    w = ckpt.weights
    assert w.quantization("layers.0.mlp.gate.weight") == (8, 64)
    assert w.quantization("layers.0.mlp.shared_expert_gate.weight") == (8, 64)
    assert w.quantization("embed_tokens.weight") == (4, 64)
    assert w.quantization("layers.0.linear_attn.conv1d.weight") is None
    assert w.dtype("lm_head.weight") == dtype
    # A_log keeps the source (fp32) dtype in mlx_lm.convert; Lily always hands out fp32.
    assert w.dtype("layers.0.linear_attn.A_log") == "float32"


def test_mlx_4bit_variants_match_mlx_lm(variant_mlx4_dir: Path) -> None:
    _assert_matches_mlx(load_checkpoint(variant_mlx4_dir), _mlx_params(variant_mlx4_dir))


@pytest.mark.parametrize(("source_dtype", "bits"), [("float32", 4), ("bfloat16", 4), ("bfloat16", 8)])
def test_quantize_on_load_is_bit_identical_to_mlx_convert(tiny_checkpoints, source_dtype: str, bits: int) -> None:
    converted = tiny_checkpoints.mlx("kv64", bits=bits, dtype=source_dtype, source_dtype=source_dtype)
    ours = load_checkpoint(tiny_checkpoints.hf("kv64", dtype=source_dtype), quantize=bits)
    _assert_matches_mlx(ours, _mlx_params(converted), norm_dtype=source_dtype)
    reference_config = json.loads((converted / "config.json").read_text())["quantization"]
    assert dict(ours.args.quantization) == reference_config


_TORCH_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint32: "U32"}


@pytest.mark.parametrize("which", ["mlx", "hf"])
def test_locations_point_at_the_bytes(tiny_mlx4_dir: Path, tiny_hf_dir: Path, which: str) -> None:
    directory, prefix = (
        (tiny_mlx4_dir, "language_model.model.") if which == "mlx" else (tiny_hf_dir, "model.language_model.")
    )
    ckpt = load_checkpoint(directory)
    stored = {}
    for f in ckpt.files:
        stored.update({k: (f, v) for k, v in load_file(f).items()})
    checked = 0
    for name in ckpt.weights:
        locations = ckpt.weights.locations(name)
        if locations is None:
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        for key, loc in locations.items():
            suffix = {"weight": name[len(module) :], "scales": ".scales", "biases": ".biases"}[key]
            raw = (
                ("language_model." if which == "mlx" else "") + module + suffix
                if name.startswith("lm_head")
                else prefix + module + suffix
            )
            if which == "hf":  # the fused down_proj keeps its HF name (no .weight)
                raw = raw.replace("switch_mlp.down_proj.weight", "experts.down_proj")
            file, tensor = stored[raw]
            with open(loc.file, "rb") as fh:
                fh.seek(loc.offset)
                data = fh.read(loc.nbytes)
            assert loc.file == file and loc.dtype == _TORCH_DTYPE_NAMES[tensor.dtype], (name, key)
            assert data == tensor.contiguous().view(torch.uint8).numpy().tobytes(), (name, key)
            checked += 1
    assert checked >= len(ckpt.weights) // 2


def test_tiny_mlx_load_is_fast(tiny_mlx4_dir: Path) -> None:
    load_checkpoint(tiny_mlx4_dir)  # warm the page cache
    start = time.perf_counter()
    ckpt = load_checkpoint(tiny_mlx4_dir)
    for name in ckpt.weights:
        ckpt.weights[name]
    assert time.perf_counter() - start < 0.5


_RSS_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from lily.checkpoint import load_checkpoint
    from lily.quant import QuantizedTensor

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    # ru_maxrss survives exec (it would report the parent's peak), so use the kernel's per-process
    # high-water mark, reset after the imports.
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    ckpt = load_checkpoint(sys.argv[1])
    total = 0.0
    for name in ckpt.weights:
        t = ckpt.weights[name]
        total += float((t.weight if isinstance(t, QuantizedTensor) else t).sum())
        del t
    print(status("VmHWM") - base)
    """)


def test_peak_memory_of_a_full_pass_stays_near_checkpoint_size(tmp_path: Path) -> None:
    config = dict(
        fixtures.text_config("kv64"),
        hidden_size=256,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_experts=48,
        moe_intermediate_size=256,
        vocab_size=4096,
    )
    directory = tmp_path / "big"
    model = fixtures.build_hf_model(config, randomize=False)
    fixtures.save_hf_checkpoint(model, directory, dtype="bfloat16", shards=2)
    del model
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert size > 150e6
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(directory)], capture_output=True, text=True, check=True
    )
    peak = int(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth {peak / 1e6:.1f} MB, checkpoint {size / 1e6:.1f} MB")
    # The memory maps alone account for up to 1x; conversions are per tensor.
    assert 0.5 * size < peak <= 1.2 * size, f"peak RSS growth {peak / 1e6:.1f} MB for a {size / 1e6:.1f} MB checkpoint"


# --- bad input ---------------------------------------------------------------------------------


def _copy(directory: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(directory, tmp_path / directory.name))


def _rewrite(file: Path, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _expect_error(directory: Path, *fragments: str, quantize: int | None = None, error=CheckpointError) -> str:
    with pytest.raises(error) as info:
        load_checkpoint(directory, quantize=quantize)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_tensor(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    _expect_error(d, "missing tensor", "'model.language_model.layers.2.linear_attn.A_log'")


def test_missing_quantization_tensors(tiny_mlx4_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_mlx4_dir, tmp_path)
    module = "language_model.model.layers.1.linear_attn.in_proj_a"
    _rewrite(d / "model.safetensors", lambda t: t.pop(module + ".biases"))
    _expect_error(d, "model.safetensors.index.json", "missing tensor", module + ".biases")
    (d / "model.safetensors.index.json").unlink()
    _expect_error(d, "model.safetensors", "missing", module + ".biases")
    _rewrite(d / "model.safetensors", lambda t: t.pop(module + ".scales"))
    _expect_error(d, "model.safetensors", "missing tensor", module + ".scales")
    d = Path(shutil.copytree(tiny_mlx4_dir, tmp_path / "second"))
    (d / "model.safetensors.index.json").unlink()
    _rewrite(d / "model.safetensors", lambda t: [t.pop(f"language_model.lm_head.{p}") for p in ("weight", "scales")])
    _expect_error(d, "model.safetensors", "biases", "has no matching", "lm_head.weight")
    _rewrite(d / "model.safetensors", lambda t: t.pop("language_model.lm_head.biases"))
    _expect_error(d, "missing tensor", "'language_model.lm_head.weight'")


def test_missing_expert_in_per_expert_layout(tiny_checkpoints, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoints.hf("kv64", layout="per_expert"), tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.language_model.layers.1.mlp.experts.5.up_proj.weight"))
    _expect_error(d, "missing tensor", "layers.1.mlp.experts.5.up_proj")


def test_unexpected_tensor(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    extra = "model.language_model.layers.4.input_layernorm.weight"  # the model has 4 layers
    _rewrite(d / "model.safetensors", lambda t: t.update({extra: torch.zeros(128)}))
    _expect_error(d, "unexpected tensor", extra, "model.safetensors")


def test_wrong_shape(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.update({name: torch.zeros(64, 128)}))
    _expect_error(d, "wrong shape", name, "[64, 128]", "[128, 128]")


def test_wrong_dtype(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    name = "model.language_model.norm.weight"
    _rewrite(d / "model.safetensors", lambda t: t.update({name: torch.zeros(128, dtype=torch.int32)}))
    _expect_error(d, "wrong dtype", "I32", name)


def test_wrong_packed_shape_in_mlx(tiny_mlx4_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_mlx4_dir, tmp_path)
    # Claim 8 bits for a 4-bit module: the packed width no longer fits.
    _edit_config(
        d,
        lambda c: c["quantization"].update(
            {"language_model.model.layers.0.linear_attn.in_proj_z": {"group_size": 64, "bits": 8}}
        ),
    )
    _expect_error(d, "wrong shape", "language_model.model.layers.0.linear_attn.in_proj_z.weight", "8 bits")


def test_truncated_file(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _expect_error(d, "truncated", "model.safetensors")
    f.write_bytes(b"\x01\x02")
    _expect_error(d, "truncated", "model.safetensors")


def test_corrupt_header(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    broken = bytearray(data)
    broken[8 : 8 + 10] = b"#" * 10
    f.write_bytes(bytes(broken))
    _expect_error(d, "corrupt safetensors header", "not valid JSON", "model.safetensors")
    huge = bytearray(data)
    huge[:8] = (len(data) * 2).to_bytes(8, "little")
    f.write_bytes(bytes(huge))
    _expect_error(d, "corrupt safetensors header", "model.safetensors")
    # Shift one tensor's offsets so that its size no longer matches its shape.
    header = json.loads(bytes(data[8 : 8 + header_len]))
    name = "model.language_model.norm.weight"
    header[name]["data_offsets"][1] -= 4
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_len
    f.write_bytes(bytes(data[:8]) + text.ljust(header_len) + bytes(data[8 + header_len :]))
    _expect_error(d, "corrupt safetensors header", name)


def test_index_with_missing_shard(tiny_checkpoints, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoints.hf("kv64", shards=3), tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    _expect_error(d, "model.safetensors.index.json", "model-00002-of-00003.safetensors", "does not exist")


def test_corrupt_index(tiny_checkpoints, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoints.hf("kv64", shards=2), tmp_path)
    (d / "model.safetensors.index.json").write_text("{ not json")
    _expect_error(d, "model.safetensors.index.json", "not valid JSON")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    _expect_error(d, "model.safetensors.index.json", "weight_map")


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        ({"mode": "mxfp4"}, ("quantization.mode", "mxfp4")),
        ({"bits": 3}, ("quantization.bits", "3")),
        ({"group_size": 16}, ("quantization.group_size", "16")),
    ],
)
def test_unknown_quantization(tiny_mlx4_dir: Path, tmp_path: Path, edit: dict, fragments: tuple) -> None:
    d = _copy(tiny_mlx4_dir, tmp_path)
    _edit_config(d, lambda c: c["quantization"].update(edit))
    _expect_error(d, "config.json", *fragments)


def test_unsupported_hf_quantization_config(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_config(
        d, lambda c: c.update({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    _expect_error(d, "config.json", "fp8")


def test_missing_and_invalid_config(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    _edit_config(d, lambda c: c["text_config"].update({"num_experts_per_tok": 99}))
    _expect_error(d, "config.json", "num_experts_per_tok", error=ConfigError)
    (d / "config.json").unlink()
    _expect_error(d, "missing config.json")
    _expect_error(tmp_path / "nowhere", "not found")


def test_quantize_argument_errors(tiny_mlx4_dir: Path, tiny_hf_dir: Path) -> None:
    _expect_error(tiny_mlx4_dir, "already quantized", quantize=4)
    _expect_error(tiny_hf_dir, "quantize", "3", quantize=3)


def test_skips_vision_and_mtp_tensors(tiny_hf_dir: Path) -> None:
    raw = SafetensorsFile(tiny_hf_dir / "model.safetensors").tensors
    assert any(n.startswith("mtp.") for n in raw) and any(n.startswith("model.visual.") for n in raw)
    names = set(load_checkpoint(tiny_hf_dir).weights)
    assert not any("mtp" in n or "visual" in n for n in names)


def test_generation_config_eos_is_merged(tiny_hf_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    assert load_checkpoint(d).args.eos_token_ids == (1, 7)



@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"eos_token_id": "1"}', "eos_token_id: must be a non-negative integer"),
        ('{"eos_token_id": -1}', "eos_token_id: must be a non-negative integer"),
        ('{"eos_token_id": true}', "eos_token_id: must be a non-negative integer"),
        ('{"eos_token_id": [1, null]}', "eos_token_id: must be a non-negative integer"),
        ("[1]", "expected a JSON object, got list"),
        ('{"eos_token_id": ', "not valid JSON"),
    ],
)
def test_bad_generation_config_names_file_and_field(
    tiny_hf_dir: Path, tmp_path: Path, text: str, fragment: str
) -> None:
    d = _copy(tiny_hf_dir, tmp_path)
    (d / "generation_config.json").write_text(text)
    _expect_error(d, "generation_config.json", fragment)
