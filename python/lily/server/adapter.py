"""The one boundary between the HTTP server and Lily's model API.

The server only talks to an `Engine`: tokenize a chat or a text, generate tokens. `LilyEngine`
implements it on `lily.Model`, which owns the chat template, the prompt cache and the
reasoning / tool-call parser; everything above this file is plain HTTP and JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from ..chat import ToolCall
from ..model import Model, Session, Token, chat_stream
from ..sampling import SamplingParams
from .requests import ChatRequest


@dataclass
class TokenEvent:
    """One generated token: its text, and for chats the text's share of reasoning and content."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class Generation(Protocol):
    """A running generation whose prompt is already prefilled; iterating decodes."""

    prompt_tokens: int
    cached_tokens: int

    def __iter__(self) -> Iterator[TokenEvent]: ...

    def close(self) -> None:
        """Stop decoding early (the client went away or the job was cancelled)."""


class Engine(Protocol):
    """What the server needs from a model."""

    model_id: str
    context_length: int
    vocab_size: int
    sampling_defaults: dict[str, float]  # generation_config.json values for omitted sampling fields
    max_token_bytes: int  # the most bytes one token covers (a cheap lower bound on a text's tokens)

    def encode_chat(self, chat: ChatRequest) -> list[int]:
        """Token ids of the rendered conversation; ``ValueError`` when it cannot be rendered."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text."""

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs."""

    def generate(
        self, prompt: list[int], chat: ChatRequest | None, sampling: SamplingParams, is_cancelled: Callable[[], bool]
    ) -> Generation:
        """Prefill ``prompt`` (``chat`` set for chat requests) and return the running generation."""


class _LilyGeneration:
    """Adapts a `Session.decode` iterator (for chats, already split into reasoning, content and
    tool calls by `lily.model.chat_stream`) to `TokenEvent`s."""

    def __init__(self, session: Session, tokens: Iterator[Token], *, is_chat: bool) -> None:
        self._tokens = tokens
        self._is_chat = is_chat
        self.prompt_tokens = session.stats.prompt_tokens
        self.cached_tokens = session.stats.cached_tokens

    def __iter__(self) -> Iterator[TokenEvent]:
        for token in self._tokens:
            yield TokenEvent(
                id=int(token.id),
                text=token.text,
                logprob=token.logprob,
                top_logprobs=list(token.top_logprobs or []),
                finish_reason=token.finish_reason,
                reasoning=token.reasoning,
                content=token.content if self._is_chat else token.text,
                tool_calls=list(token.tool_calls),
            )

    def close(self) -> None:
        """Stop decoding (the session keeps what was generated)."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()


def served_name(model: Model) -> str:
    """The model id the server reports: ``lily:<name>`` for a bundled model (as ``lily serve
    lily:demo`` names it), else the checkpoint's folder name."""
    from ..hub import BUNDLED_MODELS, resolve

    if model.path is None:
        return "lily"
    for name in BUNDLED_MODELS:
        try:
            if Path(model.path).resolve() == resolve(f"lily:{name}").resolve():
                return f"lily:{name}"
        except ValueError:  # not installed
            continue
    return Path(model.path).name


class LilyEngine:
    """`Engine` on a loaded `lily.Model`."""

    def __init__(self, model: Model, model_id: str | None = None) -> None:
        if model.tokenizer is None:
            raise ValueError(f"the model at {model.path} has no tokenizer (tokenizer.json); the server needs one")
        self.model = model
        self.model_id = model_id or served_name(model)
        self.context_length = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        self.sampling_defaults = model.sampling_defaults
        self.max_token_bytes = model.tokenizer.max_token_bytes

    def _template_kwargs(self, chat: ChatRequest) -> dict[str, Any]:
        return {
            "tools": chat.tools,
            "enable_thinking": (self.model.tokenizer.thinks_by_default if chat.enable_thinking is None
                                else chat.enable_thinking),
            "preserve_thinking": bool(chat.preserve_thinking),
        }

    def encode_chat(self, chat: ChatRequest) -> list[int]:
        """Token ids of the rendered conversation (the template's generation prompt included)."""
        return self.model.encode(chat.messages, **self._template_kwargs(chat))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text."""
        return self.model.tokenizer.encode(text)

    def token_text(self, token_id: int) -> str:
        """The text of one token (U+FFFD for a partial UTF-8 character)."""
        return self.model.tokenizer.decode([token_id])

    def generate(
        self, prompt: list[int], chat: ChatRequest | None, sampling: SamplingParams, is_cancelled: Callable[[], bool]
    ) -> Generation:
        """Prefill (through the prompt cache) and start decoding with `sampling`, the request's one SamplingParams;
        `is_cancelled` is polled between prefill chunks and between tokens."""
        if chat is None:
            session = self.model.prefill(prompt, cancel=is_cancelled)
            return _LilyGeneration(session, session.decode(sampling, cancel=is_cancelled), is_chat=False)
        template = self._template_kwargs(chat)
        # Passing the messages (not the ids) lets the model place its turn checkpoints.
        session = self.model.prefill(chat.messages, cancel=is_cancelled, **template)
        tokens = chat_stream(session.decode(sampling, cancel=is_cancelled), chat.tools, template["enable_thinking"])
        return _LilyGeneration(session, tokens, is_chat=True)


def load_engine(path: str, *, backend: str | None = None, precision: str | None = None) -> LilyEngine:
    """Load a checkpoint (a directory, a Hugging Face repo id or `lily:demo`) for serving."""
    model = Model.load(path, backend=backend or "auto", precision=precision)
    name = path if not path.startswith("lily:") and not Path(path).exists() else None  # a repo id names itself
    return LilyEngine(model, model_id=name)
