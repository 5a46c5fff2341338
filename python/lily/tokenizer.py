"""Tokenizer, chat template and streaming detokenizer for Qwen3.5/3.6 checkpoints.

``Tokenizer.from_dir`` reads a checkpoint's ``tokenizer.json`` (byte-level BPE, through the
``tokenizers`` library) and its ``tokenizer_config.json`` / ``generation_config.json`` /
``config.json`` / ``chat_template.jinja``. The chat template is rendered with jinja2 in a sandbox
that offers what Hugging Face templates expect (``tojson`` without key sorting, ``raise_exception``,
``strftime_now``, the ``generation`` tag). A checkpoint without a template gets the packaged
official Qwen3.6 template (``lily/templates/qwen3_6.jinja``).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

from lily.chat import THINK_CLOSE, THINK_OPEN, tool_call_arguments, tool_functions
from lily.config import read_json_object

PACKAGED_TEMPLATE = Path(__file__).parent / "templates" / "qwen3_6.jinja"
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """A chat template failed to render, or raised an error for the given messages."""


class TokenizerError(ValueError):
    """A tokenizer directory or a token id is unusable."""


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level (GPT-2) map from bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


def check_text(text: str, where: str) -> None:
    """Refuse a string that is not encodable text: a lone UTF-16 surrogate (``"\\ud800"``, what a
    client sends after cutting a string inside an emoji) has no UTF-8 form and no tokens."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where} contains a lone UTF-16 surrogate ({text[exc.start]!r} at "
                             f"character {exc.start}), which is not valid text") from None


def _check_id(token_id: Any, vocab_size: int) -> None:
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab_size:
        raise TokenizerError(f"token id {token_id!r} is outside the vocabulary (0..{vocab_size - 1})")


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _eos_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja2's own tojson: no key sorting and no HTML escaping, as in HF transformers, so
    # tool schemas keep the caller's key order and characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment HF-style templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template line {exc.lineno}: {exc.message}") from None


# ---------------------------------------------------------------------------------------------
# Message validation


def _text_content(content: Any, where: str) -> str | list[dict[str, str]] | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
                continue
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}[{k}]: expected an object, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(f"{where}[{k}]: content part type {kind!r} is not supported (text only)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{k}].text: expected a string")
            parts.append({"type": "text", "text": part["text"]})
        return parts
    raise ValueError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function: expected an object")
    fwhere = f"{where}.function" if "function" in call else where
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{fwhere}.name: expected a non-empty string")
    try:
        arguments = tool_call_arguments(function.get("arguments", {}))
    except ValueError as exc:
        raise ValueError(f"{fwhere}.arguments: {exc}") from None
    normalized = {k: v for k, v in call.items() if k != "function"} if "function" in call else {}
    normalized["type"] = call.get("type", "function")
    normalized["function"] = {"name": name, "arguments": arguments}
    return normalized


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and return copies ready for templating.

    Content may be a string or a list of text parts; assistant ``reasoning`` is accepted as an
    alias of ``reasoning_content``; tool-call ``arguments`` given as a JSON string become a dict.
    Raises ``ValueError`` naming the message index and field that is wrong.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ValueError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    messages = list(messages)
    if not messages:
        raise ValueError("messages: the list is empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(_ROLES)}, got {role!r}")
        if role == "system" and i != 0:
            raise ValueError(f"{where}: a system message is only allowed first")
        msg = dict(message)
        msg["content"] = _text_content(message.get("content"), f"{where}.content")
        if role == "assistant":
            reasoning = message.get("reasoning_content")
            field = "reasoning_content"
            if reasoning is None:
                reasoning, field = message.get("reasoning"), "reasoning"
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.{field}: expected a string, got {type(reasoning).__name__}")
            msg.pop("reasoning", None)
            msg.pop("reasoning_content", None)
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            calls = message.get("tool_calls")
            if calls is not None:
                if isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
                    raise ValueError(f"{where}.tool_calls: expected a list")
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif "tool_calls" in message and message["tool_calls"]:
            raise ValueError(f"{where}.tool_calls: only assistant messages can carry tool calls")
        # Drop None fields (OpenAI clients send content=None, tool_calls=None), as transformers does:
        # templates test for missing keys and some would render a literal "None".
        out.append({k: v for k, v in msg.items() if v is not None})
    return out


def _normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tool_functions(tools) is None:
        return None
    return [dict(t) for t in tools]


# ---------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A checkpoint's tokenizer and chat template. Build it with ``Tokenizer.from_dir``."""

    def __init__(self, backend: _HFTokenizer, *, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()) -> None:
        self._backend = backend
        self._config = dict(config or {})
        self.chat_template: str = chat_template if chat_template is not None else PACKAGED_TEMPLATE.read_text("utf-8")
        self._template = compile_chat_template(self.chat_template)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        #: every added token (special or not) by its text
        self.special_tokens: dict[str, int] = {tok.content: i for i, tok in sorted(added.items())}
        self._skipped_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.eos_token = _token_text(self._config.get("eos_token"))
        self.bos_token = _token_text(self._config.get("bos_token"))
        self.pad_token = _token_text(self._config.get("pad_token"))
        eos: list[int] = []
        for text in (self.eos_token, *_STOP_TOKENS):
            if text is not None and (i := backend.token_to_id(text)) is not None:
                eos.append(i)
        eos.extend(i for i in extra_eos_ids if 0 <= i < self.vocab_size)
        #: every id that ends generation: <|im_end|>, <|endoftext|>, the configs' eos ids
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.pad_token_id = backend.token_to_id(self.pad_token) if self.pad_token else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional config files of a checkpoint directory."""
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"{root}: not a directory")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: missing (Lily needs the checkpoint's tokenizer.json)")
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises a bare Exception on bad files
            raise TokenizerError(f"{tok_file}: cannot load ({exc})") from None
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise TokenizerError(
                f"{tok_file}: decoder {type(backend.decoder).__name__} is not supported; Lily expects a "
                "byte-level BPE tokenizer (Qwen3.5/3.6)"
            )
        config_file = root / "tokenizer_config.json"
        config = read_json_object(config_file, TokenizerError) if config_file.is_file() else {}
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (root / name).is_file():
                data = read_json_object(root / name, TokenizerError)
                extra_eos += _eos_list(data.get("eos_token_id"))
                text_config = data.get("text_config")
                if isinstance(text_config, Mapping):
                    extra_eos += _eos_list(text_config.get("eos_token_id"))
        return cls(backend, config=config, chat_template=cls._find_template(root, config), extra_eos_ids=extra_eos)

    @staticmethod
    def _find_template(root: Path, config: Mapping[str, Any]) -> str | None:
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                return jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{jinja_file}: cannot read ({exc})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{root / 'tokenizer_config.json'}: chat_template must be a string")
        return template

    # -- ids and text ---------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given by its text (e.g. ``"<think>"``), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level form for BPE tokens), or None."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` becomes its id. No BOS."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a string, got {type(text).__name__}")
        check_text(text, "text")
        # encode_batch releases the GIL (encode does not): a long text does not stall other threads.
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. ``skip_special_tokens`` drops control
        tokens such as ``<|im_end|>`` but keeps ``<think>`` and ``<tool_call>``."""
        ids = list(ids)
        for token_id in ids:
            _check_id(token_id, self.vocab_size)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _id_bytes(self) -> list[bytes]:
        """The UTF-8 bytes each id stands for (built on first use: ~250k entries)."""
        # str.translate maps each byte-level character to the code point of its byte, so that
        # latin-1 encoding yields the raw bytes: much faster than a per-character loop.
        to_latin1 = {ord(c): b for c, b in _byte_decoder().items()}
        table = [b""] * self.vocab_size
        for token, i in self._backend.get_vocab(with_added_tokens=True).items():
            if token in self.special_tokens:
                table[i] = token.encode("utf-8")
            else:
                try:
                    table[i] = token.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:
                    raise TokenizerError(f"vocabulary entry {token!r} (id {i}) is not byte-level BPE") from None
        return table

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of n bytes has at least
        n / max_token_bytes tokens."""
        return max(len(b) for b in self._id_bytes)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for this vocabulary."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, preserve_thinking: bool = False,
                            **kwargs: Any) -> str:
        """Render ``messages`` (and ``tools``) with the checkpoint's chat template.

        ``enable_thinking=False`` pre-fills an empty think block, ``True`` opens one; None leaves the
        choice to the template (``thinks_by_default``). ``preserve_thinking=True`` keeps the reasoning
        of every earlier assistant turn (Qwen3.6). Extra keyword arguments reach the template as
        variables. Raises ``ValueError`` for malformed messages and ``ChatTemplateError`` when the
        template rejects them.
        """
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
            "messages": normalize_messages(messages),
            "tools": _normalize_tools(tools),
            "add_generation_prompt": add_generation_prompt,
            "preserve_thinking": preserve_thinking,
        }
        if enable_thinking is not None:  # undefined in the template otherwise, as transformers leaves it
            context["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc.message or exc}") from None


    @cached_property
    def thinks_by_default(self) -> bool:
        """Whether the chat template opens a think block for the answer when ``enable_thinking`` is
        not given: Qwen3.6's does; the demo model's does not (docs/demo-model.md)."""
        prompt = self.apply_chat_template([{"role": "user", "content": "Hi"}])
        return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class StreamingDetokenizer:
    """Turns token ids, fed one at a time, into text deltas.

    Bytes of an incomplete UTF-8 character are held back until the character completes (a token
    may carry half an emoji); ``finish`` flushes what is left. The deltas concatenate to
    ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._table = tokenizer._id_bytes
        self._skip = tokenizer._skipped_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly complete text (possibly empty)."""
        _check_id(token_id, len(self._table))
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._table[token_id])

    def finish(self) -> str:
        """Flush held-back bytes (an unfinished character becomes U+FFFD) and reset."""
        return self._decoder.decode(b"", final=True)
