"""Split generated Qwen3.5/3.6 text into reasoning, content and tool calls.

With thinking on, the generation prompt already ends in ``<think>\\n``, so the output starts inside
the reasoning: text before ``</think>`` is reasoning (a stray generated ``<think>`` at the start is
dropped). A tool call (``<tool_call>`` followed by ``<function=``) also ends the reasoning. Without a
``</think>`` the whole output is reasoning (it was cut short). With thinking off everything is content.

Tool calls use the XML ("qwen3-coder") form the chat template teaches::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are converted by the tool's JSON schema. A call that cannot be parsed (unclosed, unknown
function, a value that does not fit its type, stray text) stays in the content verbatim; parsing
never raises on model output. Reasoning and content are stripped of surrounding whitespace, as the
chat template does when it renders them back.

``parse_assistant`` parses a whole text; ``StreamingParser`` does the same incrementally, never
showing partial markup such as ``<tool_`` or ``</thi`` as text, and ends with the same result.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_FUNCTION_OPEN = "<function="
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"
# A tool call only counts once "<function=" follows the tag, so prose that mentions <tool_call> is
# left alone (the rule vLLM's qwen3 parser uses).
_CALL_START = re.compile(r"<tool_call>\s*<function=")
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAM_NAME = re.compile(r"<parameter=([^>\n]*)>")
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id, ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call; ``arguments`` are already converted to Python values."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedMessage:
    """An assistant turn split into its parts; ``reasoning`` is None when there was none."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete tool call."""

    call: ToolCall


Event = Union[ReasoningDelta, ContentDelta, ToolCallEvent]


# ---------------------------------------------------------------------------------------------
# Tool schemas and value conversion


class _Unconvertible(Exception):
    """A parameter value does not fit its declared type."""


def tool_call_arguments(arguments: Any) -> dict[str, Any]:
    """The ``arguments`` of a tool call in a conversation as a dict: a JSON object given as a string (the OpenAI
    wire form) or as a mapping; None and "" mean no arguments. ``ValueError`` saying what is wrong otherwise."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"expected a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


def tool_functions(tools: Any) -> list[Mapping[str, Any]] | None:
    """The function schema of each tool (OpenAI ``{"type": "function", "function": {...}}`` or a
    bare function); None when no tools were given. Raises ``ValueError`` naming the bad entry."""
    if tools is None:
        return None
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools: expected a list of tool schemas, got {type(tools).__name__}")
    functions = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{k}]: expected an object, got {type(tool).__name__}")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{k}]: expected a function with a string 'name'")
        functions.append(function)
    return functions


def _tool_schemas(tools: Any) -> dict[str, dict[str, Any]] | None:
    """Map each function name to its parameter schemas; None when no tools were given."""
    functions = tool_functions(tools)
    if functions is None:
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for function in functions:
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        schemas[function["name"]] = dict(properties) if isinstance(properties, Mapping) else {}
    return schemas


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, following anyOf/oneOf and enums."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared.lower()]
    if isinstance(declared, list):
        return [t.lower() for t in declared if isinstance(t, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            for option in schema[key]:
                types += [t for t in _schema_types(option) if t not in types]
    if not types and isinstance(schema.get("enum"), list) and schema["enum"]:
        if all(isinstance(v, str) for v in schema["enum"]):
            types = ["string"]
    return types


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _json_value(raw: str) -> Any:
    """A strict JSON value: no NaN or infinities, so that it survives a JSON round trip."""
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _structured(raw: str, kind: type) -> Any:
    """An object/array value: JSON first, then a Python literal (models sometimes write those)."""
    try:
        value = _json_value(raw)
    except ValueError:
        try:
            value = ast.literal_eval(raw.strip())
            if _json_value(json.dumps(value)) != value:
                raise _Unconvertible
        except Exception:  # literal_eval raises many kinds on garbage (and RecursionError)
            raise _Unconvertible from None
    if not isinstance(value, kind):
        raise _Unconvertible
    return value


def _convert_as(raw: str, kind: str) -> Any:
    text = raw.strip()
    if kind in ("integer", "int") or kind.startswith("int"):
        if _INTEGER.fullmatch(text):
            return int(text)
        if _NUMBER.fullmatch(text) and math.isfinite(value := float(text)) and value.is_integer():
            return int(value)
        raise _Unconvertible
    if kind in ("number", "float", "double") or kind.startswith("num"):
        if _INTEGER.fullmatch(text):
            return int(text)
        if _NUMBER.fullmatch(text) and math.isfinite(value := float(text)):
            return value
        raise _Unconvertible
    if kind in ("boolean", "bool"):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise _Unconvertible
    if kind in ("object", "dict"):
        return _structured(raw, dict)
    if kind in ("array", "list"):
        return _structured(raw, list)
    raise _Unconvertible


def convert_value(raw: str, schema: Any) -> Any:
    """Convert one parameter's text by its JSON schema (None: unknown parameter).

    Strings stay verbatim; integers, numbers, booleans, objects and arrays are parsed; ``null``
    becomes None unless the parameter is a string. Unknown parameters become the JSON value the text
    spells, or stay strings. Raises ``ValueError`` when the text fits none of the allowed types.
    """
    types = _schema_types(schema)
    if not types:
        try:
            return _json_value(raw)
        except ValueError:
            return raw
    if raw.strip() == "null" and ("null" in types or "string" not in types):
        return None
    for kind in types:
        if kind in ("string", "str", "null"):
            continue
        try:
            return _convert_as(raw, kind)
        except (_Unconvertible, ValueError):  # ValueError: e.g. an integer over Python's digit limit
            pass
    if "string" in types or "str" in types:
        return raw
    raise ValueError(f"value {raw[:40]!r} does not fit the types {types}")


def _parse_call(block: str, schemas: dict[str, dict[str, Any]] | None) -> ToolCall | None:
    """Parse ``<tool_call>…</tool_call>``; None if it is not a well-formed call of a known function."""
    match = _FUNCTION.fullmatch(block, len(CALL_OPEN), len(block) - len(CALL_CLOSE))
    if match is None:
        return None
    name, body = match.group(1).strip(), match.group(2)
    if not name or (schemas is not None and name not in schemas):
        return None
    params = schemas.get(name, {}) if schemas is not None else {}
    arguments: dict[str, Any] = {}
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            break
        opening = _PARAM_NAME.match(body, pos)
        if opening is None:
            return None
        key = opening.group(1).strip()
        if not key or key in arguments:
            return None
        start = opening.end()
        # The value ends at </parameter>; a missing closer is tolerated before the next parameter
        # or the end of the function.
        ends = [i for i in (body.find(_PARAM_CLOSE, start), body.find(_PARAM_OPEN, start)) if i >= 0]
        end = min(ends) if ends else len(body)
        raw = body[start:end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        try:
            arguments[key] = convert_value(raw, params.get(key))
        except ValueError:
            return None
        pos = end + len(_PARAM_CLOSE) if body.startswith(_PARAM_CLOSE, end) else end
    return ToolCall(name=name, arguments=arguments)


# ---------------------------------------------------------------------------------------------
# Whole-text parsing


def _call_finder(tool_calls: bool) -> Callable[[str, int], re.Match[str] | None]:
    """``_CALL_START.search``, or a search that never finds a call (no tools offered)."""
    return _CALL_START.search if tool_calls else (lambda text, pos=0: None)


def parse_assistant(text: str, *, tools: Any = None, thinking: bool = True, tool_calls: bool = True) -> ParsedMessage:
    """Split a complete assistant output into reasoning, content and tool calls.

    ``tools`` are the request's tool schemas (OpenAI form); with tools given, calls of other
    functions stay in the content. ``thinking`` says whether the prompt opened a think block.
    ``tool_calls=False`` (no tools offered, or ``tool_choice: "none"``) keeps call markup in the content.
    """
    schemas = _tool_schemas(tools)
    find_call = _call_finder(tool_calls)
    reasoning = None
    rest = text
    if thinking:
        body = text.lstrip()
        body = body[len(THINK_OPEN):] if body.startswith(THINK_OPEN) else text
        close = body.find(THINK_CLOSE)
        call = find_call(body)
        if call is not None and (close < 0 or call.start() < close):
            reasoning, rest = body[: call.start()], body[call.start():]
        elif close >= 0:
            reasoning, rest = body[:close], body[close + len(THINK_CLOSE):]
        else:
            reasoning, rest = body, ""
        reasoning = reasoning.strip() or None
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := find_call(rest, pos)) is not None:
        close = rest.find(CALL_CLOSE, start.start())
        if close < 0:
            break  # no call can complete any more: the rest is content
        content.append(rest[pos : start.start()])
        parsed = _parse_call(rest[start.start() : close + len(CALL_CLOSE)], schemas)
        if parsed is not None:
            calls.append(parsed)
            pos = close + len(CALL_CLOSE)
        else:
            content.append(CALL_OPEN)
            pos = start.start() + len(CALL_OPEN)
    content.append(rest[pos:])
    return ParsedMessage(reasoning=reasoning, content="".join(content).strip(), tool_calls=calls)


# ---------------------------------------------------------------------------------------------
# Streaming parsing


def _could_start(tail: str, in_reasoning: bool) -> bool:
    """Whether ``tail`` may grow into a tool-call start (or ``</think>`` while reasoning)."""
    if in_reasoning and THINK_CLOSE.startswith(tail):
        return True
    if len(tail) <= len(CALL_OPEN):
        return CALL_OPEN.startswith(tail)
    if not tail.startswith(CALL_OPEN):
        return False
    after = tail[len(CALL_OPEN):].lstrip()
    return _FUNCTION_OPEN.startswith(after)


def _held_from(buf: str, in_reasoning: bool) -> int:
    """The earliest index from which ``buf`` may still become markup; ``len(buf)`` if none."""
    # Only a short tail, or a tail from the last <tool_call> on (it may be followed by any amount of
    # whitespace), can grow into markup.
    window = len(CALL_OPEN) + len(_FUNCTION_OPEN)
    candidates = {i for i in range(max(0, len(buf) - window), len(buf)) if buf[i] == "<"}
    candidates.add(buf.rfind(CALL_OPEN))
    for i in sorted(candidates - {-1}):
        if _could_start(buf[i:], in_reasoning):
            return i
    return len(buf)


class _Channel:
    """A text stream whose leading and trailing whitespace is dropped, as str.strip() would:
    trailing whitespace is held back until more text follows it."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._pending_space = ""

    def push(self, text: str) -> str:
        if not self.parts:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            if self.parts:
                self._pending_space += text
            return ""
        out = self._pending_space + body
        self._pending_space = text[len(body):]
        self.parts.append(out)
        return out

    def text(self) -> str:
        return "".join(self.parts)


class StreamingParser:
    """Incremental ``parse_assistant``: feed text deltas, get typed events.

    ``feed`` returns ``ReasoningDelta``, ``ContentDelta`` and ``ToolCallEvent`` items; text that
    may still turn into markup is held back. ``finish`` flushes the rest; afterwards ``message``
    equals ``parse_assistant`` of the whole text (tool call ids aside).
    """

    _START, _REASONING, _CONTENT, _CALL = range(4)

    def __init__(self, *, tools: Any = None, thinking: bool = True, tool_calls: bool = True) -> None:
        self._schemas = _tool_schemas(tools)
        self._find_call = _call_finder(tool_calls)
        self._mode = self._START if thinking else self._CONTENT
        self._thinking = thinking
        self._buf = ""
        self._reasoning = _Channel()
        self._content = _Channel()
        self._calls: list[ToolCall] = []
        self._events: list[Event] = []
        # While a tool call is open, deltas are only collected until one completes </tool_call>,
        # so a long argument (a whole file) is neither rescanned nor copied on every delta.
        self._call_chunks: list[str] = []
        self._call_tail = ""
        self._finished = False

    def feed(self, delta: str) -> list[Event]:
        """Add generated text; return the events it completes."""
        if self._finished:
            raise RuntimeError("StreamingParser.feed called after finish")
        if self._mode == self._CALL:
            window = self._call_tail + delta
            if CALL_CLOSE not in window:
                self._call_chunks.append(delta)
                self._call_tail = window[-(len(CALL_CLOSE) - 1):]
                return []
        self._buf += "".join(self._call_chunks) + delta
        self._call_chunks = []
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """End of generation: flush everything held back."""
        if not self._finished:
            self._finished = True
            self._buf += "".join(self._call_chunks)
            self._call_chunks = []
            self._run(final=True)
        return self._take()

    @property
    def message(self) -> ParsedMessage:
        """Everything parsed so far (the final result after ``finish``)."""
        reasoning = self._reasoning.text() if self._thinking else ""
        return ParsedMessage(reasoning=reasoning or None, content=self._content.text(), tool_calls=list(self._calls))

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _emit(self, channel: _Channel, text: str, kind: type) -> None:
        if text and (out := channel.push(text)):
            self._events.append(kind(out))

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._mode == self._START:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                elif not final and THINK_OPEN.startswith(stripped):
                    return
                self._mode = self._REASONING
            elif self._mode == self._REASONING:
                close = buf.find(THINK_CLOSE)
                call = self._find_call(buf)
                if call is not None and (close < 0 or call.start() < close):
                    self._emit(self._reasoning, buf[: call.start()], ReasoningDelta)
                    self._buf, self._mode = buf[call.start():], self._CONTENT
                elif close >= 0:
                    self._emit(self._reasoning, buf[:close], ReasoningDelta)
                    self._buf, self._mode = buf[close + len(THINK_CLOSE):], self._CONTENT
                else:
                    held = len(buf) if final else _held_from(buf, in_reasoning=True)
                    self._emit(self._reasoning, buf[:held], ReasoningDelta)
                    self._buf = buf[held:]
                    return
            elif self._mode == self._CONTENT:
                call = self._find_call(buf)
                if call is not None:
                    self._emit(self._content, buf[: call.start()], ContentDelta)
                    self._buf, self._mode = buf[call.start():], self._CALL
                else:
                    held = len(buf) if final else _held_from(buf, in_reasoning=False)
                    self._emit(self._content, buf[:held], ContentDelta)
                    self._buf = buf[held:]
                    return
            else:  # inside a tool call: wait for its end, then parse it whole
                close = buf.find(CALL_CLOSE)
                if close < 0:
                    if final:  # no call can complete any more: the rest is content
                        self._emit(self._content, buf, ContentDelta)
                        self._buf = ""
                    else:
                        self._call_tail = buf[-(len(CALL_CLOSE) - 1):]
                    return
                parsed = _parse_call(buf[: close + len(CALL_CLOSE)], self._schemas)
                if parsed is not None:
                    self._calls.append(parsed)
                    self._events.append(ToolCallEvent(parsed))
                    self._buf = buf[close + len(CALL_CLOSE):]
                else:
                    self._emit(self._content, CALL_OPEN, ContentDelta)
                    self._buf = buf[len(CALL_OPEN):]
                self._mode = self._CONTENT
