"""Every error the server answers, security defaults, and a property test with random bodies.

Each error must come back as `{"error": {"message", "type", "param", "code"}}` with the right
status, and the server must keep serving afterwards.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import NO_THINKING, ServerThread, echo, raw_request, scripted_model
from tokenizer_fixture import write_tiny_tokenizer

from lily.server import ServerConfig
from lily.server.adapter import LilyEngine
from lily.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = {"messages": [{"role": "user", "content": "hello"}], **NO_THINKING}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("server-errors-tokenizer"))


@pytest.fixture(scope="module")
def model(tokenizer_dir):
    return scripted_model(tokenizer_dir, echo)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(LilyEngine(model, model_id="scripted"), max_body_bytes=64 * 1024, body_timeout_s=0.5) as running:
        yield running


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    """The response is an OpenAI error object with this status (and param / code when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http: httpx.Client) -> None:
    reply = http.post(CHAT, json=HELLO)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "You said: hello"


@pytest.mark.parametrize(
    "body",
    [b"", b"   ", b"{", b"not json", b"[1, 2]", b'"text"', b"null", b'{"messages": NaN}', b'{"a": 1}{', b"[" * 50000],
    ids=["empty", "blank", "open-brace", "words", "array", "string", "null", "nan", "trailing", "deep"],
)
def test_malformed_json_is_400(http, body):
    for path in (CHAT, COMPLETIONS):
        error = assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
        assert error["code"] == "invalid_json"
    assert_still_serving(http)


def test_invalid_utf8_is_400(http):
    body = b'{"messages": [{"role": "user", "content": "caf\xe9 \xff"}]}'
    error = assert_error(http.post(CHAT, content=body), 400, code="invalid_utf8")
    assert "UTF-8" in error["message"]
    json.dumps(error)  # the message itself is clean text
    assert_still_serving(http)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

CHAT_BAD_FIELDS = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": "ten"}, "max_completion_tokens"),
    # Longer than the whole context (4096): refused, not shortened to fit.
    ({"max_tokens": 10**10}, "max_tokens"),
    ({"max_completion_tokens": 4097, "max_tokens": 5}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": "all"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"enable_thinking": 1}, "enable_thinking"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    # Forcing a call cannot be honoured without constrained decoding: refused, not treated as "auto".
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"n": True}, "n"),
    ({"best_of": True}, "best_of"),
    ({"reasoning_effort": "x"}, "reasoning_effort"),
    ({"user": 5}, "user"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    # A lone surrogate (a string cut inside an emoji) in any string field names that field.
    ({"messages": [{"role": "user", "content": "cut \ud83d"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "\ud800"}, {"role": "user", "content": "hi"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]}, "messages[0].content[0].text"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "description": "\ud800"}}]},
     "tools[0].function.description"),
    ({"stop": ["ok", "\udc00"]}, "stop[1]"),
    ({"model": 5}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize("fields, param", CHAT_BAD_FIELDS, ids=[p for _, p in CHAT_BAD_FIELDS])
def test_bad_chat_parameters_are_400(http, fields, param):
    # json.dumps escapes non-ASCII (a lone surrogate becomes \\ud800, as JavaScript clients send it)
    error = assert_error(http.post(CHAT, content=json.dumps({**HELLO, **fields})), 400, param=param)
    assert param.split("[")[0].split(".")[0] in error["message"]


COMPLETION_BAD_FIELDS = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "cut \ud83d"}, "prompt"),
    ({"prompt": ["\ud800"]}, "prompt[0]"),
    ({"prompt": "x", "best_of": True}, "best_of"),
    ({"prompt": "x", "user": ["me"]}, "user"),
]


@pytest.mark.parametrize(
    "fields, param", COMPLETION_BAD_FIELDS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_BAD_FIELDS)]
)
def test_bad_completion_parameters_are_400(http, fields, param):
    assert_error(http.post(COMPLETIONS, content=json.dumps(fields)), 400, param=param)


def test_a_surrogate_error_names_the_field_and_is_not_500(http):
    body = json.dumps({**HELLO, "messages": [{"role": "user", "content": "ab\ud83d"}]})
    assert "\\ud83d" in body
    error = assert_error(http.post(CHAT, content=body),
                         400, param="messages[0].content", code="invalid_text")
    assert "surrogate" in error["message"] and "messages[0].content" in error["message"]
    assert_still_serving(http)


def test_an_infinite_number_says_so(http):
    body = json.dumps(HELLO)[:-1] + ', "temperature": 1e999}'
    error = assert_error(http.post(CHAT, content=body), 400, param="temperature")
    assert "finite" in error["message"] and "got number" not in error["message"]


def test_unknown_fields_are_ignored(http):
    reply = http.post(
        CHAT, json={**HELLO, "user": "me", "metadata": {"a": 1}, "parallel_tool_calls": True, "store": False}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "You said: hello"


def test_over_context_prompt_is_400_and_never_truncated(model, caplog):
    tokenizer = Tokenizer.from_dir(model.path)
    with (
        ServerThread(LilyEngine(model, model_id="scripted"), max_context=64) as small,
        httpx.Client(base_url=small.base_url, timeout=10) as http,
    ):
        long_text = "a fairly long message " * 20
        messages = [{"role": "user", "content": long_text}]
        n_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages, enable_thinking=False)))
        for stream in (False, True):
            error = assert_error(
                http.post(CHAT, json={"messages": messages, "stream": stream, **NO_THINKING}),
                400,
                code="context_length_exceeded",
            )
            assert error["n_prompt_tokens"] == n_prompt and error["n_ctx"] == 64
            assert f"{n_prompt} tokens" in error["message"] and "64 tokens" in error["message"]

        # Token-id prompts at the boundary: 64 tokens do not fit, 63 leave room for exactly one.
        assert_error(http.post(COMPLETIONS, json={"prompt": [5] * 64}), 400, code="context_length_exceeded")
        turn = tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
        )
        with caplog.at_level("INFO", logger="lily.server"):
            reply = http.post(COMPLETIONS, json={"prompt": [5] * (63 - len(turn)) + turn, "max_tokens": 10}).json()
        assert reply["choices"][0]["text"] == tokenizer.decode(tokenizer.encode("You said: hi")[:1])
        assert reply["usage"]["prompt_tokens"] == 63 and reply["usage"]["completion_tokens"] == 1
        assert reply["choices"][0]["finish_reason"] == "length"
        # The log says why: the context was full before max_tokens.
        assert [r.getMessage() for r in caplog.records if "context limit" in r.getMessage()] == [
            'a generation stopped at the context limit (finish_reason "length"): 63 prompt + 1 generated tokens '
            "fill the 64-token context before max_tokens=10"]
        assert_error(http.post(COMPLETIONS, json={"prompt": [5], "max_tokens": 65}), 400, param="max_tokens",
                     code="context_length_exceeded")
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 64


def test_max_context_above_the_model_limit_is_refused(model):
    with pytest.raises(ValueError, match="max_context"):
        ServerThread(LilyEngine(model, model_id="scripted"), max_context=10**7)


def test_unknown_routes_are_404(http):
    for method, path in (
        ("GET", "/"),
        ("GET", "/v2/chat"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/chat/completions/x"),
    ):
        error = assert_error(http.request(method, path), 404, code="not_found")
        assert path in error["message"]
    assert_error(http.get(CHAT), 405, code="method_not_allowed")
    assert_error(http.post("/health"), 405)


def test_oversized_bodies_are_413(http, server):
    big = {**HELLO, "padding": "x" * (server.config.max_body_bytes + 1)}
    assert_error(http.post(CHAT, json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(100):
            yield b" " * 1024

    assert_error(http.post(CHAT, content=chunks()), 413, code="request_too_large")
    assert_still_serving(http)


def test_half_sent_body_times_out(server, http):
    start = time.monotonic()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    answer = raw_request(server.port, head.encode() + b'{"messa', timeout=10)  # returns when the server hangs up
    elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b'"request_timeout"' in answer
    assert server.config.body_timeout_s <= elapsed < 5
    assert_still_serving(http)


def test_generation_failure_is_500_and_the_next_request_is_served(http, model):
    def broken(prompt: str) -> str:
        raise RuntimeError("model exploded")

    model.backend.respond = broken
    fresh = {**HELLO, "messages": [{"role": "user", "content": "break, please"}]}
    try:
        error = assert_error(http.post(CHAT, json=fresh), 500)
        assert error["type"] == "server_error" and "exploded" not in error["message"]
        fresh["messages"][0]["content"] += " again"
        with http.stream("POST", CHAT, json={**fresh, "stream": True}) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line]
        assert json.loads(events[-2][len("data: ") :])["error"]["type"] == "server_error"
        assert events[-1] == "data: [DONE]"
    finally:
        model.backend.respond = echo
    assert_still_serving(http)


class _BrokenTokenizerEngine(LilyEngine):
    def encode_text(self, text: str) -> list[int]:
        raise RuntimeError("tokenizer exploded")


def test_unexpected_exception_is_500_in_the_error_shape(model):
    with ServerThread(_BrokenTokenizerEngine(model, model_id="scripted")) as broken:
        with httpx.Client(base_url=broken.base_url, timeout=10) as http:
            error = assert_error(http.post(COMPLETIONS, json={"prompt": "hello"}), 500, code="internal_error")
            assert error["type"] == "server_error" and "exploded" not in error["message"]
            assert_still_serving(http)


def test_api_key(model):
    with (
        ServerThread(LilyEngine(model, model_id="scripted"), api_key="s3cret") as secured,
        httpx.Client(base_url=secured.base_url, timeout=10) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/v1/models/x"), ("GET", "/nowhere")):
                response = http.request(method, path, json=HELLO, headers=headers)
                assert_error(response, 401, code="invalid_api_key")
                assert response.json()["error"]["type"] == "authentication_error"
            # /health stays open for load balancers, as in vLLM and llama.cpp (and "/health/" is not it).
            assert http.get("/health", headers=headers).json() == {"status": "ok"}
            assert_error(http.get("/health/", headers=headers), 401, code="invalid_api_key")
        assert http.post(CHAT, json=HELLO, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/health", headers={"X-Api-Key": "s3cret"}).status_code == 200


def test_no_cors_unless_asked(server, model):
    origin = {"Origin": "http://evil.example"}
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        response = http.post(CHAT, json=HELLO, headers=origin)
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
        preflight = http.options(CHAT, headers={**origin, "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers

    allowed = "http://app.example"
    with (
        ServerThread(LilyEngine(model, model_id="scripted"), cors_origin=allowed, api_key="k") as cors,
        httpx.Client(base_url=cors.base_url, timeout=10) as http,
    ):
        preflight = http.options(
            CHAT,
            headers={
                "Origin": allowed,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization",
            },
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == allowed
        response = http.post(CHAT, json=HELLO, headers={"Origin": allowed, "Authorization": "Bearer k"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == allowed
        response = http.post(CHAT, json=HELLO, headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in response.headers


def test_defaults_are_safe():
    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.api_key is None and config.cors_origin is None


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "n",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "response_format",
        "chat_template_kwargs",
        "reasoning_effort",
        "enable_thinking",
        "prompt",
        "echo",
        "suffix",
    ]
)
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
            "content": st.none()
            | st.text(max_size=30)
            | st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
                max_size=2,
            ),
        }
    ),
    max_size=3,
)


@st.composite
def _bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(_values)).encode()
    body = {
        "messages": draw(_messages),
        "prompt": draw(st.text(max_size=20) | st.lists(st.integers(-5, 1100), max_size=5)),
        "max_tokens": 4,
    }
    body.update(draw(st.dictionaries(_fields, _values, max_size=4)))
    return json.dumps(body).encode()


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=_bodies(), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_random_bodies_never_5xx(http, body, path):
    started = time.monotonic()
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert time.monotonic() - started < 5
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
        else:
            assert response.json()["choices"]
    else:
        assert response.status_code in (400, 404) and set(response.json()["error"]) >= {
            "message",
            "type",
            "param",
            "code",
        }


def test_still_serving_after_random_bodies(http):
    assert_still_serving(http)
