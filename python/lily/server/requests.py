"""Validation of OpenAI-style request bodies for `lily.server`.

Every check raises `ApiError` naming the offending field, so a bad request becomes one 400 with the
OpenAI error shape and never reaches the engine. Unknown fields are ignored, as OpenAI clients send
many extensions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from ..chat import tool_call_arguments
from ..sampling import SamplingParamError, SamplingParams, sampling_params
from ..tokenizer import check_text

# OpenAI's documented limits; stop strings are not limited to 4 here because local clients send more.
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
SEED_RANGE = (-(2**63), 2**64)

# OpenAI's values; any one but "none" turns thinking on (the model has no finer budget).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error to send to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = extra or {}
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        error.update(self.extra)
        return {"error": error}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code=code)


@dataclass
class ChatRequest:
    """A validated /v1/chat/completions request."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    enable_thinking: bool | None
    preserve_thinking: bool | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


@dataclass
class CompletionRequest:
    """A validated /v1/completions request: `prompt` is text or token ids."""

    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body: strict UTF-8, then JSON, which must be an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"Request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8") from None
    if not text.strip():
        raise ApiError(400, "Request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
        _reject_surrogates(body, "")
    except ApiError:
        raise
    except ValueError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "Request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"Request body must be a JSON object, got {_type_name(body)}", code="invalid_json")
    return body


def _reject_surrogates(value: Any, where: str) -> None:
    """A lone UTF-16 surrogate is valid JSON but not text: refuse it here, naming the field,
    instead of failing in the tokenizer."""
    if isinstance(value, str):
        try:
            check_text(value, f"'{where or 'body'}'")
        except ValueError as exc:
            raise ApiError(400, str(exc), param=where or None, code="invalid_text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_surrogates(key, where or "body")
            _reject_surrogates(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_surrogates(item, f"{where}[{i}]")


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN/Infinity, which are not JSON.
    raise ValueError(f"'{name}' is not a valid JSON value")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {_type_name(value)}", "invalid_type")
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(name, f"must be {limit}, got {value}")
    return value


def _boolean(body: dict, name: str, default: bool | None, *, prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(prefix + name, f"expected a boolean, got {_type_name(value)}", "invalid_type")
    return value


def _n(body: dict) -> None:
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value != 1):  # True == 1 in Python
            raise _bad(name, f"only {name}=1 is supported, got {value!r}", "unsupported_value")


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(_boolean(body, "stream", False))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _bad("stream_options", f"expected an object, got {_type_name(options)}", "invalid_type")
    include_usage = _boolean(options, "include_usage", False, prefix="stream_options.")
    return stream, bool(include_usage) and stream


def _client_fields(body: dict) -> None:
    """Fields accepted without effect, checked only for their type."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"expected a string, got {_type_name(user)}", "invalid_type")
    _boolean(body, "parallel_tool_calls", None)


def _model(body: dict) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise _bad("model", f"expected a string, got {_type_name(value)}", "invalid_type")
    return value


# The sampling fields a request names as SamplingParams does (OpenAI's names); max_tokens and logprobs are mapped.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "logit_bias", "seed", "stop")
# Fields JSON may send as whole floats (5.0) where SamplingParams takes integers.
_INTEGER_FIELDS = ("max_tokens", "top_k", "seed", "top_logprobs")


def _sampling(body: dict, vocab_size: int, defaults: Mapping[str, float], *, legacy_logprobs: bool) -> SamplingParams:
    """The request's one ``SamplingParams``, built by ``lily.sampling.sampling_params`` with `defaults` for omitted
    fields: a value out of its range gets SamplingParams' own message, as from the Python API and the CLI; then the
    limits of this API, narrower than Lily's own (``_check_api_limits``)."""
    _n(body)
    options = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(max_name) is not None:
        options["max_tokens"] = body[max_name]
    if legacy_logprobs:
        # /v1/completions: `logprobs` is the number of alternatives per token (0-5).
        top = _integer(body, "logprobs", None, 0, MAX_LEGACY_LOGPROBS)
        options.update(logprobs=top is not None, top_logprobs=top or 0)
    else:
        logprobs, top = body.get("logprobs"), body.get("top_logprobs")
        options.update(logprobs=False if logprobs is None else logprobs, top_logprobs=0 if top is None else top)
    for name in _INTEGER_FIELDS:
        if isinstance(options.get(name), float) and options[name].is_integer():
            options[name] = int(options[name])
    if options.get("top_k") == -1:
        options["top_k"] = 0  # -1 and 0 both mean "no top-k" (vLLM / llama.cpp conventions)
    seed = options.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise _over_limit("seed", "in [-2**63, 2**64) (a 64-bit integer, signed or not)", seed)
        options["seed"] = seed % 2**64
    try:
        params = sampling_params(options, defaults)
        params.validate(vocab_size)
    except SamplingParamError as exc:
        param = max_name if exc.field == "max_tokens" else exc.field
        raise ApiError(400, str(SamplingParamError(param, exc.expected, exc.value)), param=param,
                       code="invalid_value") from None
    _check_api_limits(params, legacy_logprobs=legacy_logprobs)
    return params


def _over_limit(param: str, limit: str, value: Any) -> ApiError:
    return ApiError(400, f"{param} must be {limit}; got {value!r}", param=param, code="invalid_value")


def _check_api_limits(params: SamplingParams, *, legacy_logprobs: bool) -> None:
    """The limits of the OpenAI API (and a few of this server's own), which Lily's Python API does not have: checked
    after SamplingParams' rules, so only a value those accept reaches them."""
    if params.temperature > 2:
        raise _over_limit("temperature", "at most 2 (the OpenAI API's limit)", params.temperature)
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(params, name) <= 2:
            raise _over_limit(name, "in [-2, 2] (the OpenAI API's range)", getattr(params, name))
    if params.repetition_penalty > 10:
        raise _over_limit("repetition_penalty", "at most 10 (this server's limit)", params.repetition_penalty)
    for token, bias in params.logit_bias.items():
        if not -100 <= bias <= 100:
            raise _over_limit("logit_bias", "biases in [-100, 100] (the OpenAI API's range)", {token: bias})
    if len(params.stop) > MAX_STOP_STRINGS:
        raise _over_limit("stop", f"at most {MAX_STOP_STRINGS} strings (this server's limit)", len(params.stop))
    if not legacy_logprobs:
        if params.top_logprobs > MAX_TOP_LOGPROBS:
            raise _over_limit("top_logprobs", f"at most {MAX_TOP_LOGPROBS} (the OpenAI API's limit)",
                              params.top_logprobs)
        if params.top_logprobs and not params.logprobs:
            raise _bad("top_logprobs", "requires 'logprobs': true")


def _text_content(content: Any, where: str, *, allow_null: bool) -> str | None:
    """A message's content as text: a string, or an array of text parts joined."""
    if content is None:
        if allow_null:
            return None
        raise _bad(where, "content must not be null", "invalid_type")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"content must be a string or an array of parts, got {_type_name(content)}", "invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"{where}[{i}]", f"content part must be an object, got {_type_name(part)}", "invalid_type")
        kind = part.get("type")
        if kind != "text":
            raise _bad(
                f"{where}[{i}]", f"only text content parts are supported, got type {kind!r}", "unsupported_value"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{where}[{i}].text", f"expected a string, got {_type_name(text)}", "invalid_type")
        texts.append(text)
    return "".join(texts)


def _tool_call_history(calls: Any, where: str) -> list[dict[str, Any]]:
    """Assistant `tool_calls` from the history, with `arguments` decoded to a mapping for the template."""
    if not isinstance(calls, list):
        raise _bad(where, f"expected an array, got {_type_name(calls)}", "invalid_type")
    out = []
    for i, call in enumerate(calls):
        here = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _bad(f"{here}.function", "expected an object with 'name' and 'arguments'", "invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{here}.function.name", "expected a non-empty string", "invalid_type")
        try:
            arguments = tool_call_arguments(function.get("arguments"))
        except ValueError as exc:
            raise _bad(f"{here}.function.arguments", str(exc)) from None
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty array of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"expected an object, got {_type_name(message)}", "invalid_type")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(_ROLES)}; got {role!r}")
        role = "system" if role == "developer" else role
        is_assistant = role == "assistant"
        content = _text_content(message.get("content"), f"{where}.content", allow_null=is_assistant)
        entry: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
        if is_assistant:
            if message.get("tool_calls") is not None:
                entry["tool_calls"] = _tool_call_history(message["tool_calls"], f"{where}.tool_calls")
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad(f"{where}.reasoning_content", "expected a string", "invalid_type")
                entry["reasoning_content"] = reasoning
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        out.append(entry)
    return out


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, str]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"expected an array, got {_type_name(tools)}", "invalid_type")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (
                not isinstance(tool, dict)
                or tool.get("type", "function") != "function"
                or not isinstance(function, dict)
            ):
                raise _bad(f"tools[{i}]", "expected {'type': 'function', 'function': {...}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise _bad(f"tools[{i}].function.name", "expected a non-empty string", "invalid_type")
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise _bad(f"tools[{i}].function.parameters", "expected a JSON schema object", "invalid_type")
        tools = tools or None
    if choice is None or choice == "auto":
        return tools, "auto"
    if choice == "none":
        return None, "none"
    if choice == "required" or isinstance(choice, dict):
        # Generation is not constrained, so a call cannot be guaranteed: refuse rather than act as "auto".
        if isinstance(choice, dict):
            name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
            if not any(t["function"]["name"] == name for t in tools or []):
                raise _bad("tool_choice", f"names function {name!r}, which is not in 'tools'")
        raise _bad(
            "tool_choice",
            "forcing a tool call ('required' or a named function) is not supported: this server does not "
            "constrain generation; use 'auto' (the default) or 'none'",
            "unsupported_value",
        )
    raise _bad("tool_choice", f"expected 'none', 'auto', 'required' or a function object, got {choice!r}")


def _thinking(body: dict) -> tuple[bool | None, bool | None]:
    """The thinking switches, most specific first: chat_template_kwargs, enable_thinking, reasoning_effort."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", f"expected an object, got {_type_name(kwargs)}", "invalid_type")
    enable = _boolean(kwargs, "enable_thinking", None, prefix="chat_template_kwargs.")
    preserve = _boolean(kwargs, "preserve_thinking", None, prefix="chat_template_kwargs.")
    top_level = _boolean(body, "enable_thinking", None)
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise _bad("reasoning_effort", f"expected a string, got {_type_name(effort)}", "invalid_type")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}")
    if enable is None:
        enable = top_level
    if enable is None and effort is not None:
        enable = effort != "none"
    return enable, preserve


def _response_format(body: dict) -> None:
    value = body.get("response_format")
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "text":
        raise _bad("response_format", f"only {{'type': 'text'}} is supported, got {value!r}", "unsupported_value")


def parse_chat_request(
    body: dict[str, Any], vocab_size: int, defaults: Mapping[str, float] = MappingProxyType({})
) -> ChatRequest:
    """Validate a /v1/chat/completions body; `defaults` (generation_config.json) replace omitted sampling fields."""
    _response_format(body)
    _client_fields(body)
    tools, tool_choice = _tools(body)
    enable_thinking, preserve_thinking = _thinking(body)
    stream, include_usage = _stream(body)
    return ChatRequest(
        messages=_messages(body),
        tools=tools,
        tool_choice=tool_choice,
        enable_thinking=enable_thinking,
        preserve_thinking=preserve_thinking,
        sampling=_sampling(body, vocab_size, defaults, legacy_logprobs=False),
        stream=stream,
        include_usage=include_usage,
        model=_model(body),
    )


def _prompt(body: dict, vocab_size: int) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    # A one-element batch is accepted; larger batches are n > 1 in disguise.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise _bad("prompt", "expected a string or an array of token ids (one prompt per request)", "invalid_type")
    for token in prompt:
        if not 0 <= token < vocab_size:
            raise _bad("prompt", f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return prompt


def parse_completion_request(
    body: dict[str, Any], vocab_size: int, defaults: Mapping[str, float] = MappingProxyType({})
) -> CompletionRequest:
    """Validate a /v1/completions body; `defaults` (generation_config.json) replace omitted sampling fields."""
    if body.get("echo"):
        raise _bad("echo", "echo is not supported", "unsupported_value")
    if body.get("suffix"):
        raise _bad("suffix", "suffix is not supported", "unsupported_value")
    prompt = _prompt(body, vocab_size)
    _client_fields(body)
    stream, include_usage = _stream(body)
    return CompletionRequest(
        prompt=prompt,
        sampling=_sampling(body, vocab_size, defaults, legacy_logprobs=True),
        stream=stream,
        include_usage=include_usage,
        model=_model(body),
    )
