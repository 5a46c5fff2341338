"""Dummy weights (lily.dummy, ``load_format="dummy"``, ``lily bench --dummy-weights``): the in-memory form of a 4-bit
MLX checkpoint, zero-mean groups, every backend on them, a hidden state that neither blows up nor collapses over 40
layers, realistic routing (and a control with non-zero-mean weights that does collapse), bad arguments, the CLI."""

from __future__ import annotations

import json
import types
from collections.abc import Mapping

import numpy as np
import pytest

from fixtures import text_config
from lily import Model, bench, dummy, reference
from lily.checkpoint import CheckpointError, canonical_shapes
from lily.cli import main
from lily.config import FULL_SIZE_CONFIG, ConfigError, full_size_args
from lily.quant import QuantizedTensor, round_to_dtype


def tiny_config(**changes) -> dict:
    return {"model_type": "qwen3_5_moe_text", **text_config("kv64"), **changes}


def deep_config(layers: int = 40) -> dict:
    """kv64's widths at the full-size depth and layer pattern (attention every 4th layer), 32 experts top-4."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return tiny_config(num_hidden_layers=layers, num_experts=32, num_experts_per_tok=4, layer_types=kinds)


def test_the_form_of_a_4bit_mlx_checkpoint_with_zero_mean_groups():
    checkpoint = dummy.dummy_checkpoint(tiny_config())
    weights = checkpoint.weights
    assert list(weights) == list(canonical_shapes(checkpoint.args))
    assert checkpoint.files == () and checkpoint.format == "dummy"
    for name in weights:
        tensor = weights[name]
        assert weights.locations(name) is None
        if name.endswith(("conv1d.weight", "norm.weight", "layernorm.weight", "A_log", "dt_bias")):
            assert isinstance(tensor, np.ndarray) and tensor.dtype == np.float32 and tensor.shape == weights.shape(name)
            assert np.array_equal(round_to_dtype(tensor, weights.dtype(name)), tensor)
            continue
        assert isinstance(tensor, QuantizedTensor) and tensor.shape == weights.shape(name)
        bits = 8 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 4
        assert weights.quantization(name) == (bits, 64) and tensor.dtype == "bfloat16"
        for part in (tensor.scales, tensor.biases):
            assert np.array_equal(round_to_dtype(part, "bfloat16"), part), f"{name}: not bf16 values"
        # zero mean, exactly: codes uniform in [0, 2^bits - 1], bias = -scale * (2^bits - 1) / 2
        assert np.array_equal(tensor.biases, tensor.scales * np.float32(-((1 << bits) - 1) / 2)), name
        assert (tensor.scales > 0).all()
    codes = weights["layers.0.mlp.switch_mlp.gate_proj.weight"].codes().reshape(-1)
    histogram = np.bincount(codes, minlength=16) / codes.size
    assert np.abs(histogram - 1 / 16).max() < 0.1 / 16, histogram
    values = weights["layers.0.linear_attn.in_proj_qkv.weight"].dequantize()
    assert abs(values.mean()) < 0.02 * values.std()
    assert values.std() == pytest.approx(1 / np.sqrt(values.shape[-1]), rel=0.1)  # keeps its input's RMS
    assert (weights["norm.weight"] == 1).all()


def test_generated_on_demand_the_same_each_time_and_for_any_thread_count(monkeypatch):
    monkeypatch.setattr(dummy, "_CHUNK_WORDS", 1 << 12)  # lm_head's 16K words: 4 chunks, on several threads
    monkeypatch.setattr(dummy.os, "cpu_count", lambda: 4)
    weights = dummy.dummy_checkpoint(tiny_config()).weights
    name = "lm_head.weight"
    first = weights[name]
    assert first.weight.size == 4 * dummy._CHUNK_WORDS
    kept = (first.weight.copy(), first.scales.copy())
    del first  # nothing is cached once dropped: the next access generates it again
    monkeypatch.setattr(dummy.os, "cpu_count", lambda: 1)
    again = weights[name]
    assert np.array_equal(again.weight, kept[0]) and np.array_equal(again.scales, kept[1])
    chunks = kept[0].reshape(4, -1)
    assert len({chunk.tobytes() for chunk in chunks}) == 4  # each chunk its own stream
    other = dummy.dummy_checkpoint(tiny_config(), seed=1).weights[name]
    assert not np.array_equal(other.weight, kept[0])


def test_full_size_shapes_and_bytes_without_generating():
    checkpoint = dummy.dummy_checkpoint(dummy.FULL_SIZE)
    assert checkpoint.args == dummy.dummy_checkpoint(FULL_SIZE_CONFIG).args
    assert checkpoint.args.quantization["bits"] == 4
    weights = checkpoint.weights
    assert weights.shape("lm_head.weight") == (248320, 2048)
    assert weights.shape("layers.39.mlp.switch_mlp.down_proj.weight") == (256, 2048, 512)
    params = sum(int(np.prod(weights.shape(n))) for n in weights)
    assert params == pytest.approx(34.66e9, rel=0.002)  # performance.md §2.1
    # 4-bit g64 with bf16 scales and biases, routers 8-bit, conv bf16: 19.51 GB (performance.md §2.1)
    assert bench.stored_bytes(weights) == pytest.approx(19.51e9, rel=0.003)
    assert full_size_args().num_hidden_layers == 40


def test_sources_directory_config_file_dict_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    by_dir = dummy.dummy_checkpoint(tmp_path)
    by_file = dummy.dummy_checkpoint(tmp_path / "config.json")
    by_dict = dummy.dummy_checkpoint(tiny_config())
    assert by_dir.args == by_file.args == by_dict.args and by_dir.path == tmp_path
    assert np.array_equal(by_dir.weights["embed_tokens.weight"].weight, by_dict.weights["embed_tokens.weight"].weight)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        dummy.dummy_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not found"):
        dummy.dummy_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        dummy.dummy_checkpoint(tiny_config(num_experts_per_tok=99))
    with pytest.raises(ValueError, match="load_format must be one of"):
        Model.load(tmp_path, load_format="dumy", backend="reference")
    with pytest.raises(ValueError, match="quantize= and revision= do not apply"):
        Model.load(tmp_path, load_format="dummy", backend="reference", quantize=4)
    with pytest.raises(TypeError, match="config dict"):
        Model.load(tiny_config(), backend="reference")  # a dict without load_format='dummy'
    with pytest.raises(TypeError, match="path_or_repo must be .* got int"):
        Model.load(42, backend="reference", load_format="dummy")
    with pytest.raises(TypeError, match="load_format='dummy' takes .* got int"):
        dummy.dummy_checkpoint(42)


@pytest.fixture(scope="module")
def tiny_models():
    """The kv64 shape with dummy weights on every backend (metal in float32: the exact path)."""
    models = {name: Model.load(tiny_config(), backend=name, load_format="dummy") for name in ("reference", "cpu")}
    from lily import _ext

    if _ext.platform != "none":
        models["metal"] = Model.load(tiny_config(), backend="metal", precision="float32", load_format="dummy")
    return models


def test_every_backend_runs_dummy_weights_and_agrees(tiny_models):
    ids = np.random.default_rng(7).integers(0, 1024, 40).tolist()
    expected = tiny_models["reference"].logits(ids)
    assert np.isfinite(expected).all() and expected.std() > 0.1
    for name, model in tiny_models.items():
        assert model.load_format == "dummy" and model.fingerprint == tiny_models["reference"].fingerprint
        got = model.logits(ids)
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error < 1e-4, f"{name}: relative error {error}"
        tokens = model.generate(ids, max_tokens=8, temperature=0.0, stop_token_ids=()).token_ids
        assert tokens == tiny_models["reference"].generate(ids, max_tokens=8, temperature=0.0,
                                                           stop_token_ids=()).token_ids, name


class _NonZeroMean(Mapping):
    """The control: the same codes and scales with zero biases, so every dequantized weight is >= 0."""

    def __init__(self, weights):
        self.weights = weights

    def __getitem__(self, name):
        t = self.weights[name]
        if not isinstance(t, QuantizedTensor):
            return t
        return QuantizedTensor(t.weight, t.scales, np.zeros_like(t.biases), t.bits, t.group_size, t.dtype)

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)


def run_deep(weights, args, tokens: int, monkeypatch):
    """Residual-stream RMS at every norm of the hidden state, the routing of every layer, the last hidden states."""
    model = reference.ReferenceModel(types.SimpleNamespace(args=args, weights=weights))
    counts = np.zeros((args.num_hidden_layers, args.num_experts), np.int64)
    model.on_route = lambda layer, experts: np.add.at(counts[layer], experts.reshape(-1), 1)
    seen = []
    plain = reference.rms_norm

    def recording(x, w, eps):
        if x.ndim == 2 and x.shape[-1] == args.hidden_size:  # the hidden state (not the q/k head norms)
            seen.append(np.asarray(x, np.float64))
        return plain(x, w, eps)

    monkeypatch.setattr(reference, "rms_norm", recording)
    ids = np.random.default_rng(3).integers(0, args.vocab_size, tokens)
    model.forward(ids, model.new_state())
    monkeypatch.setattr(reference, "rms_norm", plain)
    rms = np.array([np.sqrt(np.mean(h**2)) for h in seen])
    last = seen[-1] / np.linalg.norm(seen[-1], axis=1, keepdims=True)
    similarity = (last @ last.T)[~np.eye(tokens, dtype=bool)].mean()
    return rms, counts, similarity


def test_deep_model_keeps_a_sane_hidden_state_and_realistic_routing(monkeypatch):
    checkpoint = dummy.dummy_checkpoint(deep_config())
    args, tokens = checkpoint.args, 96
    rms, counts, similarity = run_deep(checkpoint.weights, args, tokens, monkeypatch)
    assert len(rms) == 2 * 40 + 1 and np.isfinite(rms).all()
    assert rms[0] == pytest.approx(1.0, rel=0.1)  # unit-RMS embedding rows
    assert 1.0 <= rms.max() <= 10.0 and rms[-1] / rms[0] < 10, rms  # no blow-up (it grows about as sqrt(depth))
    assert similarity < 0.2, similarity  # no collapse: tokens stay apart
    mean = tokens * args.num_experts_per_tok / args.num_experts
    assert (counts.sum(axis=1) == tokens * args.num_experts_per_tok).all()
    assert (counts > 0).sum(axis=1).min() >= 0.9 * args.num_experts, counts
    assert counts.max() <= 4 * mean, counts.max()

    # the control: non-zero-mean weights blow the hidden state up, make every token alike, and route them all alike
    rms, counts, similarity = run_deep(_NonZeroMean(checkpoint.weights), args, tokens, monkeypatch)
    assert rms.max() > 100 and similarity > 0.9
    assert counts.max() == tokens and (counts > 0).sum(axis=1).max() <= 2 * args.num_experts_per_tok


def test_expert_load_counted_by_a_cpu_probe_equals_the_cpu_backend(tiny_models):
    by_cpu = bench.expert_load(tiny_models["cpu"], 64, seed=5)
    by_probe = bench.expert_load(tiny_models["reference"], 64, seed=5)  # a cpu backend over the same weights
    assert np.array_equal(by_cpu.counts, by_probe.counts)
    assert (by_cpu.counts.sum(axis=1) == 64 * 2).all()
    summary = by_cpu.summary()
    assert summary["mean_expert_tokens"] == 64 * 2 / 8 and summary["max_expert_tokens"] == by_cpu.counts.max()
    assert summary["min_experts_used"] == (by_cpu.counts > 0).sum(axis=1).min()
    assert bench.format_expert_load(by_cpu).startswith("expert load over a 64-token prefill (cpu backend")


def test_bench_cli_with_dummy_weights(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    base = ["bench", "--dummy-weights", "--model", str(tmp_path), "--backend", "cpu", "-p", "32", "-n", "4", "-r", "1"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "4-bit dummy" in out
    line = next(line for line in out.splitlines() if line.startswith("expert load over a 32-token prefill"))
    assert "experts used in every layer" in line
    assert main(base + ["-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    load = rows[0]["expert_load"]
    assert rows[0]["load_format"] == "dummy" and load["tokens"] == 32 and load["experts"] == 8
    assert rows[0]["model_size"] == bench.stored_bytes(dummy.dummy_checkpoint(tiny_config()).weights)
    assert main(base + ["-o", "json", "--no-expert-load"]) == 0
    assert "expert_load" not in json.loads(capsys.readouterr().out)[0]
    assert main(["bench", "--full-size", "--backend", "cpu"]) == 1
    assert "--full-size needs --dummy-weights" in capsys.readouterr().err
    assert main(["bench", "--dummy-weights", "--model", str(tmp_path / "nope"), "--backend", "cpu"]) == 1
    assert "not found" in capsys.readouterr().err
