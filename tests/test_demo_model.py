"""The embedded demo model `lily:demo` (python/lily/demo/): files, config, 4-bit layout and quality.

Quality is checked with mlx-lm (CPU, fp32 compute) on text from the two plays that training never saw
(scripts/demo/, written by `scripts/train_demo.py prepare`). See docs/demo-model.md for the numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "python" / "lily" / "demo"
HELDOUT = REPO / "scripts" / "demo"

# The Qwen3.5 tokenizer rules, written out here independently of scripts/train_demo.py.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Measured 52.6 on this 296-token slice (4-bit, fp32 compute); a unigram model of the training text scores
# 582 and an untrained model about 2000. 70 leaves room for CPU rounding differences and nothing more.
SAMPLE_PPL_BOUND = 70.0
SHIPPED_BYTES_LIMIT = 8 * 1024 * 1024


def read_json(name: str) -> dict:
    return json.loads((DEMO / name).read_text(encoding="utf-8"))


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, read by hand (no safetensors / mlx import)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def test_shipped_files_and_size() -> None:
    names = {p.name for p in DEMO.iterdir() if p.is_file() and p.suffix != ".py"}
    required = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json"}
    assert required <= names
    assert not names & {"README.md", "model.safetensors.index.json"}
    total = sum((DEMO / n).stat().st_size for n in names)
    assert total <= SHIPPED_BYTES_LIMIT, f"demo model is {total} bytes"


def test_config_is_the_qwen3_5_moe_architecture() -> None:
    config = read_json("config.json")
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5_moe" and text["model_type"] == "qwen3_5_moe_text"
    layers = text["num_hidden_layers"]
    expected_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    assert layers == 8 and text["layer_types"] == expected_types
    assert text["full_attention_interval"] == 4 and text["attn_output_gate"] is True
    assert (text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (
        256, 4, 2, 64)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (2, 4)
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 64
    assert (text["num_experts"], text["num_experts_per_tok"]) == (16, 4)
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["max_position_embeddings"] == 4096 and text["tie_word_embeddings"] is False
    # Every Linear input width must be a multiple of the quantization group.
    in_dims = [text["hidden_size"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"],
               text["num_attention_heads"] * text["head_dim"],
               text["linear_num_value_heads"] * text["linear_value_head_dim"]]
    assert all(d % 64 == 0 for d in in_dims), in_dims
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"], quant["mode"]) == (4, 64, "affine")
    for i in range(layers):
        for name in ("mlp.gate", "mlp.shared_expert_gate"):
            assert quant[f"language_model.model.layers.{i}.{name}"] == {"group_size": 64, "bits": 8}


def test_tokenizer_and_generation_config() -> None:
    spec = read_json("tokenizer.json")
    added = {t["content"]: t for t in spec["added_tokens"]}
    assert all(added[t]["special"] for t in CONTROL)
    assert not any(added[t]["special"] for t in USER_DEFINED)
    size = len(spec["model"]["vocab"]) + len(set(added) - set(spec["model"]["vocab"]))
    vocab = read_json("config.json")["text_config"]["vocab_size"]
    assert vocab % 64 == 0 and size <= vocab < size + 64, (size, vocab)
    assert spec["normalizer"]["type"] == "NFC"
    split = spec["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split" and split["pattern"]["Regex"] == QWEN35_SPLIT
    assert spec["decoder"]["type"] == "ByteLevel"

    tok_config = read_json("tokenizer_config.json")
    assert tok_config["tokenizer_class"] == "Qwen3_5Tokenizer"
    assert (tok_config["eos_token"], tok_config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    generation = read_json("generation_config.json")
    assert generation["eos_token_id"] == [added["<|im_end|>"]["id"], added["<|endoftext|>"]["id"]]


def test_weights_are_mlx_4bit_in_the_real_layout() -> None:
    text = read_json("config.json")["text_config"]
    header = safetensors_header(DEMO / "model.safetensors")
    hidden, experts, inter = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
    for i, kind in enumerate(text["layer_types"]):
        prefix = f"language_model.model.layers.{i}."
        mixer = "linear_attn.in_proj_qkv" if kind == "linear_attention" else "self_attn.q_proj"
        assert header[prefix + mixer + ".weight"]["dtype"] == "U32"
        gate = header[prefix + "mlp.switch_mlp.gate_proj.weight"]
        assert gate["dtype"] == "U32" and gate["shape"] == [experts, inter, hidden * 4 // 32]
        assert header[prefix + "mlp.switch_mlp.gate_proj.scales"]["shape"] == [experts, inter, hidden // 64]
        assert header[prefix + "mlp.switch_mlp.down_proj.weight"]["shape"] == [experts, hidden, inter * 4 // 32]
        assert header[prefix + "mlp.gate.weight"]["shape"] == [experts, hidden * 8 // 32]
    assert header["language_model.lm_head.weight"]["shape"] == [text["vocab_size"], hidden * 4 // 32]
    assert header["language_model.model.layers.0.linear_attn.A_log"]["dtype"] == "F32"


def test_the_chat_template_answers_at_once_unless_asked_to_think(tmp_path) -> None:
    """The demo was trained on plain text, never to think: its template closes the think block unless
    enable_thinking is true, and is otherwise the packaged Qwen3.6 template."""
    from lily.tokenizer import Tokenizer

    demo = Tokenizer.from_dir(DEMO)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # no chat_template.jinja: the packaged template
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    packaged = Tokenizer.from_dir(tmp_path)
    hi = [{"role": "user", "content": "Hi"}]
    assert not demo.thinks_by_default and packaged.thinks_by_default
    assert demo.apply_chat_template(hi) == packaged.apply_chat_template(hi, enable_thinking=False)
    assert demo.apply_chat_template(hi, enable_thinking=True) == packaged.apply_chat_template(hi)
    history = [*hi, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nWell met."},
               {"role": "user", "content": "Again"}]
    for preserve in (False, True):
        assert (demo.apply_chat_template(history, add_generation_prompt=False, preserve_thinking=preserve)
                == packaged.apply_chat_template(history, add_generation_prompt=False, preserve_thinking=preserve))


@pytest.fixture(scope="module")
def demo_model():
    import lily

    return lily.Model.load("lily:demo", backend="cpu", progress=False)


HELLO = [{"role": "user", "content": "Hello"}]


def test_model_chat_answers_a_greeting_with_the_defaults(demo_model) -> None:
    result = demo_model.chat(HELLO, seed=0)
    assert result.content.strip() and not result.reasoning


def test_lily_chat_answers_hello() -> None:
    """`printf 'Hello\\n' | lily chat`, every setting at its default."""
    proc = subprocess.run([sys.executable, "-m", "lily.cli", "chat"], input="Hello\n", capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout.split("[answer] ", 1)
    assert len(answer) == 2 and answer[1].strip() and "[thinking]" not in proc.stdout
    assert "while still thinking" not in proc.stderr


def test_the_server_answers_hi_with_content(demo_model) -> None:
    """The README's OpenAI snippet against `lily serve`: the message has content."""
    import openai
    from server_helpers import ServerThread

    from lily.server.adapter import LilyEngine

    with ServerThread(LilyEngine(demo_model)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="lily:demo", messages=[{"role": "user", "content": "Hi"}])
    message = reply.choices[0].message
    assert message.content.strip() and not getattr(message, "reasoning_content", None)


@pytest.fixture(scope="module")
def mlx_demo():
    """The shipped model loaded by mlx-lm, widened to fp32 compute (the 4-bit codes are unchanged)."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(DEMO))
    model.set_dtype(mx.float32)
    return model, tokenizer


def test_heldout_perplexity_4bit(mlx_demo) -> None:
    import mlx.core as mx

    model, tokenizer = mlx_demo
    ids = tokenizer.encode((HELDOUT / "heldout_sample.txt").read_text(encoding="utf-8"))
    assert 250 <= len(ids) <= 400
    logits = np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32), dtype=np.float64)
    # Independent NLL in float64 numpy from the raw logits.
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    ppl = math.exp(-logprobs[np.arange(len(ids) - 1), ids[1:]].mean())
    assert ppl < SAMPLE_PPL_BOUND, ppl


def test_greedy_text_is_mostly_real_words(mlx_demo) -> None:
    from mlx_lm import generate

    model, tokenizer = mlx_demo
    words = set((HELDOUT / "heldout_words.txt").read_text(encoding="utf-8").split())
    generated = []
    for prompt in ("To be, or not to be", "KING.\nMy lord,"):
        text = generate(model, tokenizer, prompt=tokenizer.encode(prompt), max_tokens=60)
        generated += [w for w in re.findall(r"[a-z]+(?:'[a-z]+)*", text.lower()) if len(w) >= 3]
    assert len(generated) >= 20, generated
    known = sum(w in words for w in generated) / len(generated)
    assert known >= 0.8, (known, generated)
