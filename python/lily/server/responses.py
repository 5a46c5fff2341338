"""Building OpenAI-shaped responses and stream chunks from generated tokens."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ..chat import THINK_CLOSE, ToolCall
from .adapter import Engine, TokenEvent


def new_id(prefix: str) -> str:
    """A random OpenAI-style id such as `chatcmpl-…`."""
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """The `usage` object, with `prompt_tokens_details.cached_tokens` always present."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def _logprob_entry(engine: Engine, token_id: int, logprob: float) -> dict:
    text = engine.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(engine: Engine, token: TokenEvent, top_logprobs: int) -> dict:
    """One entry of `choices[].logprobs.content`."""
    entry = _logprob_entry(engine, token.id, token.logprob if token.logprob is not None else 0.0)
    entry["top_logprobs"] = [_logprob_entry(engine, i, lp) for i, lp in token.top_logprobs[:top_logprobs]]
    return entry


class ChatAssembler:
    """Turns generated chat tokens into deltas (streaming) or one message (non-streaming)."""

    def __init__(self, engine: Engine, *, logprobs: bool, top_logprobs: int) -> None:
        self.engine = engine
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict] = []
        self.logprob_entries: list[dict] = []
        self._pending_logprobs: list[dict] = []
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self._reasoning_open = True
        self._think_tokens = 0
        self._text_tail = ""
        self.finish_reason: str | None = None

    def add(self, token: TokenEvent) -> dict | None:
        """Feed one token; returns the delta to stream, or None when nothing is visible yet."""
        self.completion_tokens += 1
        if self.logprobs:
            entry = chat_logprobs(self.engine, token, self.top_logprobs)
            self.logprob_entries.append(entry)
            self._pending_logprobs.append(entry)
        self._count_reasoning(token)
        if token.finish_reason is not None:
            self.finish_reason = token.finish_reason
        delta: dict[str, Any] = {}
        if token.reasoning:
            self.reasoning.append(token.reasoning)
            delta.update(reasoning_content=token.reasoning, reasoning=token.reasoning)
        if token.content:
            self.content.append(token.content)
        if token.reasoning or token.content:
            delta["content"] = token.content  # always present: some clients fail on deltas without it
        if token.tool_calls:
            delta["tool_calls"] = [self._tool_call(call) for call in token.tool_calls]
            delta.setdefault("content", None)
        return delta or None

    def _count_reasoning(self, token: TokenEvent) -> None:
        """Reasoning tokens are every token up to the one that closes the think block, including
        those whose text the parser holds back (whitespace) or drops (the closing tag)."""
        if not self._reasoning_open:
            return
        if token.content or token.tool_calls:  # the answer has begun
            self._reasoning_open = False
            self._think_tokens += bool(token.reasoning)
        else:
            self._think_tokens += 1
            window = self._text_tail + token.text
            self._reasoning_open = THINK_CLOSE not in window
            self._text_tail = window[-(len(THINK_CLOSE) - 1) :]
        if self.reasoning or token.reasoning:
            self.reasoning_tokens = self._think_tokens

    def final_reason(self) -> str:
        """The finish_reason of the choice: tool_calls when the answer ended in tool calls."""
        reason = self.finish_reason or "stop"
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def take_logprobs(self) -> dict | None:
        """Logprobs of the tokens not yet attached to a streamed chunk."""
        if not self.logprobs:
            return None
        pending, self._pending_logprobs = self._pending_logprobs, []
        return {"content": pending}

    def _tool_call(self, call: ToolCall) -> dict:
        wire = {"index": len(self.tool_calls), **call.to_openai()}
        self.tool_calls.append(wire)
        return wire

    def message(self) -> dict:
        """The non-streaming `choices[0].message`."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.tool_calls else None}
        if self.reasoning:
            reasoning = "".join(self.reasoning)
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        if self.tool_calls:
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in self.tool_calls]
        return message


class ChunkWriter:
    """Formats Server-Sent Events for one streamed completion."""

    def __init__(self, object_name: str, completion_id: str, model: str, include_usage: bool) -> None:
        self.object_name = object_name
        self.completion_id = completion_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())

    def chunk(self, choice: dict | None, usage_body: dict | None = None) -> str:
        """One `data:` event; `choice=None` gives the usage chunk with `choices: []`."""
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }
        if self.include_usage:
            body["usage"] = usage_body
        return event(body)


def event(body: dict) -> str:
    """An SSE `data:` event carrying a JSON body."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


def completion_logprobs(engine: Engine, tokens: list[TokenEvent], top_logprobs: int, offset: int) -> dict:
    """The legacy `choices[].logprobs` of /v1/completions."""
    texts, lps, tops, offsets = [], [], [], []
    for token in tokens:
        texts.append(engine.token_text(token.id))
        lps.append(token.logprob)
        tops.append({engine.token_text(i): lp for i, lp in token.top_logprobs[:top_logprobs]} if top_logprobs else None)
        offsets.append(offset)
        offset += len(token.text)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
