"""The OpenAI-compatible server driven by the official `openai` client.

The model is a real `lily.Model` (tokenizer, chat template, sampler, prompt cache, output parser)
on a `ScriptedBackend` whose logits force a scripted answer, so reasoning and tool calls can be
tested with a tiny vocabulary. The expected answers are the scripts themselves.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from server_helpers import (
    NO_THINKING,
    REASONING,
    ServerThread,
    echo,
    last_user_text,
    raw_request,
    scripted_model,
    wait_until,
)
from tokenizer_fixture import write_tiny_tokenizer

from lily.server.adapter import LilyEngine
from lily.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("server-tokenizer"))


@pytest.fixture(scope="module")
def model(tokenizer_dir):
    return scripted_model(tokenizer_dir, echo)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(LilyEngine(model, model_id="scripted")) as running:
        yield running


@pytest.fixture()
def backend(model):
    """The scripted backend, reset to the echo script after each test. The prompt cache is
    emptied first: a cached prompt keeps the logits, and so the first token, of an older script."""
    model.prompt_cache.clear()
    yield model.backend
    model.backend.respond = echo
    model.backend.forward_delay_s = 0.0
    model.prefill_step_size = 512


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def prompt_ids(tokenizer_dir, messages, **kwargs) -> list[int]:
    """The prompt the template makes of `messages`, tokenized (independently of the server)."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    return tokenizer.encode(tokenizer.apply_chat_template(messages, **kwargs))


def script_ids(tokenizer_dir, text: str) -> list[int]:
    return Tokenizer.from_dir(tokenizer_dir).encode(text)


def set_script(backend, text: str) -> None:
    backend.respond = lambda prompt: text


def test_chat_non_streaming(client, backend, tokenizer_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    before = time.time()
    reply = client.chat.completions.create(model="scripted", messages=messages, extra_body=NO_THINKING)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == "scripted"
    assert before - 1 <= reply.created <= time.time() + 1
    choice = reply.choices[0]
    assert choice.index == 0 and choice.finish_reason == "stop"
    assert choice.message.role == "assistant" and choice.message.content == "You said: hello there"
    assert not choice.message.tool_calls
    expected_prompt = prompt_ids(tokenizer_dir, messages, enable_thinking=False)
    assert reply.usage.prompt_tokens == len(expected_prompt)
    # The answer's tokens plus the <|im_end|> that ended it.
    assert reply.usage.completion_tokens == len(script_ids(tokenizer_dir, "You said: hello there")) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(client, backend, server, tokenizer_dir):
    messages = [{"role": "user", "content": "stream me"}]
    chunks = list(
        client.chat.completions.create(
            model="scripted",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_THINKING,
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "You said: stream me"
    choice_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(script_ids(tokenizer_dir, "You said: stream me")) + 1
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids(tokenizer_dir, messages, enable_thinking=False))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])

    # The wire itself: every delta has a content key, and the stream ends with [DONE].
    body = {"messages": messages, "stream": True, **NO_THINKING}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all("content" in p["choices"][0]["delta"] for p in payloads)
    assert all("usage" not in p for p in payloads)


def test_thinking_on_and_off(client, backend):
    messages = [{"role": "user", "content": "why"}]
    reply = client.chat.completions.create(model="scripted", messages=messages)
    message = reply.choices[0].message
    assert message.content == "You said: why"
    assert message.model_extra["reasoning_content"] == REASONING.format("why")
    assert message.model_extra["reasoning"] == REASONING.format("why")
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0

    chunks = list(client.chat.completions.create(model="scripted", messages=messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d for d in deltas if d.model_extra.get("reasoning_content")]
    assert reasoning and all(d.model_extra["reasoning"] == d.model_extra["reasoning_content"] for d in reasoning)
    assert all(d.content == "" for d in reasoning)
    assert "".join(d.model_extra["reasoning_content"] for d in reasoning) == REASONING.format("why")
    assert "".join(d.content or "" for d in deltas) == "You said: why"

    for switch in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"enable_thinking": False},
        {"reasoning_effort": "none"},
    ):
        reply = client.chat.completions.create(model="scripted", messages=messages, extra_body=switch)
        assert reply.choices[0].message.content == "You said: why"
        assert "reasoning_content" not in (reply.choices[0].message.model_extra or {}), switch


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WEATHER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def tool_script(prompt: str) -> str:
    """Calls the tool when the template listed it; answers from a tool response when there is one."""
    last_user_turn = prompt.rsplit("<|im_start|>user\n", 1)[1]
    if "<tool_response>" in last_user_turn:
        result = last_user_turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        return f"The forecast says {result}."
    return WEATHER_CALL if "get_weather" in prompt else "No tools."


def test_tool_calls(client, backend):
    backend.respond = tool_script
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(
        model="scripted", messages=messages, tools=[WEATHER_TOOL], extra_body=NO_THINKING
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(
        client.chat.completions.create(
            model="scripted", messages=messages, tools=[WEATHER_TOOL], stream=True, extra_body=NO_THINKING
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks)

    # Without tools the template lists none, so the script does not call one.
    reply = client.chat.completions.create(model="scripted", messages=messages, extra_body=NO_THINKING)
    assert reply.choices[0].message.content == "No tools." and reply.choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(
        model="scripted", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", extra_body=NO_THINKING
    )
    assert reply.choices[0].message.content == "No tools."

    # Second turn: the call (arguments as a JSON string, as clients send it) and the tool's answer.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    reply = client.chat.completions.create(
        model="scripted", messages=history, tools=[WEATHER_TOOL], extra_body=NO_THINKING
    )
    assert reply.choices[0].message.content == "The forecast says sunny, 21C."
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("offer", [{}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}], ids=["no-tools", "choice-none"])
def test_tool_markup_without_offered_tools_stays_content(client, backend, stream, offer):
    set_script(backend, "Calling.\n" + WEATHER_CALL)  # the model writes a call that was not offered
    request = dict(model="scripted", messages=[{"role": "user", "content": "Paris?"}], extra_body=NO_THINKING, **offer)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **request) if c.choices]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**request).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    assert content == "Calling.\n" + WEATHER_CALL and calls == [] and finish == "stop"


def test_reasoning_tokens_count_whitespace_and_the_closing_tag(client, backend, tokenizer_dir):
    script = "Think it over.\n \n\n</think>\n\nDone."
    set_script(backend, script)
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "q"}])
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    ids = tokenizer.encode(script)
    # Independently: the tokens up to and including the one whose text completes "</think>".
    through_close = next(n for n in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:n]))
    assert any(not tokenizer.decode([t]).strip() for t in ids[:through_close])  # whitespace-only tokens
    assert reply.choices[0].message.content == "Done."
    assert reply.usage.completion_tokens_details.reasoning_tokens == through_close
    assert reply.usage.completion_tokens == len(ids) + 1


def test_tool_call_after_reasoning(client, backend):
    set_script(backend, "I should look it up.\n</think>\n\n" + WEATHER_CALL)
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL]
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "I should look it up."
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert reply.choices[0].finish_reason == "tool_calls"


def test_history_reasoning_and_preserve_thinking(client, backend):
    backend.respond = lambda prompt: "kept" if "EARLIER-REASONING" in prompt else "dropped"
    for key in ("reasoning_content", "reasoning"):
        messages = [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer one", key: "EARLIER-REASONING"},
            {"role": "user", "content": [{"type": "text", "text": "second"}]},
        ]
        answers = {}
        for preserve in (False, True):
            body = {"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": preserve}}
            answers[preserve] = (
                client.chat.completions.create(model="scripted", messages=messages, extra_body=body)
                .choices[0]
                .message.content
            )
        assert answers == {False: "dropped", True: "kept"}, key


def test_stop_strings(client, backend):
    set_script(backend, "alpha beta gamma delta")
    messages = [{"role": "user", "content": "letters"}]
    reply = client.chat.completions.create(
        model="scripted", messages=messages, stop=["mm", "gamma"], extra_body=NO_THINKING
    )
    assert reply.choices[0].message.content == "alpha beta ga" and reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model="scripted", messages=messages, stop="ta g", stream=True, extra_body=NO_THINKING
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "alpha be"


def test_max_tokens(client, backend, tokenizer_dir):
    text = "one two three four five six"
    set_script(backend, text)
    ids = script_ids(tokenizer_dir, text)
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    for limit, field in ((3, "max_tokens"), (1, "max_completion_tokens")):
        reply = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "count"}], extra_body={field: limit, **NO_THINKING}
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == limit
        assert reply.choices[0].message.content == tokenizer.decode(ids[:limit])


def test_logprobs(client, backend, tokenizer_dir):
    set_script(backend, "abc def")
    reply = client.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "x"}],
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_THINKING,
    )
    entries = reply.choices[0].logprobs.content
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    ids = script_ids(tokenizer_dir, "abc def") + [tokenizer.token_to_id("<|im_end|>")]
    assert [e.token for e in entries] == [tokenizer.decode([i]) for i in ids]
    # The forced token takes (almost) all the probability; the runner-up is 50 logits behind.
    assert all(-1e-6 < e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[1].logprob < -49 for e in entries)
    assert all(bytes(e.bytes) == e.token.encode() for e in entries)


def test_cached_tokens_on_second_turn(client, backend, tokenizer_dir):
    system = {"role": "system", "content": "You are a careful assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "first question"}]
    before = backend.tokens_processed
    reply1 = client.chat.completions.create(model="scripted", messages=turn1, extra_body=NO_THINKING)
    assert reply1.usage.prompt_tokens_details.cached_tokens == 0
    assert backend.tokens_processed - before == reply1.usage.prompt_tokens + reply1.usage.completion_tokens - 1

    turn2 = turn1 + [
        {"role": "assistant", "content": reply1.choices[0].message.content},
        {"role": "user", "content": "second question"},
    ]
    before = backend.tokens_processed
    reply2 = client.chat.completions.create(model="scripted", messages=turn2, extra_body=NO_THINKING)
    assert reply2.choices[0].message.content == "You said: second question"
    usage = reply2.usage
    assert usage.prompt_tokens == len(prompt_ids(tokenizer_dir, turn2, enable_thinking=False))
    # At least the first turn up to its answer's header (system and user messages) is cached...
    first_prompt = prompt_ids(tokenizer_dir, turn1, enable_thinking=False)
    answer_header = (
        len(first_prompt) - 1 - first_prompt[::-1].index(Tokenizer.from_dir(tokenizer_dir).token_to_id("<|im_start|>"))
    )
    assert usage.prompt_tokens_details.cached_tokens >= answer_header
    # ...and only the rest was run through the model.
    new_tokens = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert backend.tokens_processed - before == new_tokens + usage.completion_tokens - 1


def test_models_and_health(server):
    client = httpx.Client(base_url=server.base_url, timeout=10)
    assert client.get("/health").json() == {"status": "ok"}
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["scripted"]
    assert listing["data"][0]["object"] == "model" and listing["data"][0]["max_model_len"] == 4096
    assert client.get("/v1/models/scripted").json()["id"] == "scripted"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and "gpt-4" in info.value.body["message"]


def test_eight_concurrent_requests_in_queue_order(client, backend, server):
    gate = threading.Event()
    started: list[str] = []

    def respond(prompt: str) -> str:
        user = last_user_text(prompt)
        started.append(user)
        if user == "request 0":
            gate.wait(10)
        return f"answer to {user}"

    backend.respond = respond
    backend.forward_delay_s = 0.002
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        results[i] = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": f"request {i}"}],
            stream=i % 2 == 1,
            extra_body=NO_THINKING,
        )
        if i % 2 == 1:
            results[i] = "".join(c.choices[0].delta.content or "" for c in results[i] if c.choices)
        else:
            results[i] = results[i].choices[0].message.content

    threads = [threading.Thread(target=ask, args=(0,))]
    threads[0].start()
    assert wait_until(lambda: started == ["request 0"])
    for i in range(1, 8):
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        assert wait_until(lambda: server.state.scheduler.waiting == i)
    gate.set()
    for thread in threads:
        thread.join(30)
    assert started == [f"request {i}" for i in range(8)]
    assert results == {i: f"answer to request {i}" for i in range(8)}


def test_client_disconnect_stops_decoding(server, backend, client):
    set_script(backend, "word " * 1000)
    backend.forward_delay_s = 0.01
    body = {"messages": [{"role": "user", "content": "talk"}], "stream": True, **NO_THINKING}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert all(line.startswith("data: ") or line == "" for line in received)
    assert wait_until(lambda: not server.state.scheduler.busy, timeout=3)
    processed = backend.tokens_processed
    time.sleep(0.2)
    assert backend.tokens_processed == processed  # nothing runs any more
    backend.forward_delay_s = 0.0
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "next"}], extra_body=NO_THINKING
    )
    assert reply.choices[0].message.content.startswith("word word")


def _chat_request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def test_client_disconnect_during_prefill(server, backend, model, client):
    model.prefill_step_size = 2
    backend.forward_delay_s = 0.02
    long_prompt = "many words in a long prompt " * 40
    before = backend.tokens_processed
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            _chat_request(server.port, {"messages": [{"role": "user", "content": long_prompt}], **NO_THINKING})
        )
        assert wait_until(lambda: backend.tokens_processed - before >= 10)
    assert wait_until(lambda: not server.state.scheduler.busy, timeout=3)
    processed = backend.tokens_processed - before
    prompt_tokens = len(Tokenizer.from_dir(model.path).encode(long_prompt))
    assert processed < prompt_tokens / 2  # stopped between prefill chunks, long before the end
    model.prefill_step_size = 512
    backend.forward_delay_s = 0.0
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "after"}], extra_body=NO_THINKING
    )
    assert reply.choices[0].message.content == "You said: after"


def test_queued_request_that_disconnects_frees_its_slot(server, backend, client):
    gate = threading.Event()
    backend.respond = lambda prompt: (gate.wait(10), "done")[1]
    worker = threading.Thread(
        target=lambda: client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "blocker"}], extra_body=NO_THINKING
        )
    )
    worker.start()
    assert wait_until(lambda: server.state.scheduler.busy and server.state.scheduler.waiting == 0)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_chat_request(server.port, {"messages": [{"role": "user", "content": "queued"}]}))
        assert wait_until(lambda: server.state.scheduler.waiting == 1)
    assert wait_until(lambda: server.state.scheduler.waiting == 0, timeout=3)
    gate.set()
    worker.join(10)
    assert not worker.is_alive()


def test_queue_full_is_503(model, backend):
    gate = threading.Event()
    backend.respond = lambda prompt: (gate.wait(10), "ok")[1]
    with ServerThread(LilyEngine(model, model_id="scripted"), max_queue=1) as small:
        client = openai.OpenAI(base_url=small.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        replies = []
        ask = lambda text: replies.append(  # noqa: E731
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": text}], extra_body=NO_THINKING
            )
        )
        threads = [threading.Thread(target=ask, args=("first",))]
        threads[0].start()
        assert wait_until(lambda: small.state.scheduler.busy)
        threads.append(threading.Thread(target=ask, args=("second",)))
        threads[1].start()
        assert wait_until(lambda: small.state.scheduler.waiting == 1)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "third"}])
        assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
        assert int(info.value.response.headers["retry-after"]) >= 1  # clients know when to come back
        gate.set()
        for thread in threads:
            thread.join(10)
        assert [r.choices[0].message.content for r in replies] == ["ok", "ok"]


def test_health_is_503_while_loading(model):
    with ServerThread(None) as loading:
        client = httpx.Client(base_url=loading.base_url, timeout=10)
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            response = client.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
            assert response.status_code == 503, path
            assert response.json()["error"]["type"] == "unavailable_error"
        loading.state.set_engine(LilyEngine(model, model_id="scripted"))
        assert client.get("/health").json() == {"status": "ok"}


def test_raw_http_keeps_serving_after_garbage(server):
    answer = raw_request(server.port, b"GARBAGE / HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 4")
    health = raw_request(server.port, f"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert health.startswith(b"HTTP/1.1 200")


def test_keepalive_comments_while_prefilling(model, backend):
    set_script(backend, "ok")
    model.prefill_step_size = 4
    backend.forward_delay_s = 0.05
    body = {
        "messages": [{"role": "user", "content": "a prompt that takes a while to prefill " * 3}],
        "stream": True,
        **NO_THINKING,
    }
    with ServerThread(LilyEngine(model, model_id="scripted"), keepalive_s=0.02) as server:
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
    assert ": keepalive" in lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in data) == "ok"
    assert lines[-1] == "data: [DONE]"
