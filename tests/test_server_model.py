"""The server end to end on a real tiny random-weight model (reference backend).

Every answer is compared with the same request made directly through `lily.Model` on a second,
independently loaded copy of the model, so the server must pass prompts, sampling settings and
tokens through unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_helpers import NO_THINKING, ServerThread
from tokenizer_fixture import write_tiny_tokenizer

from lily.chat import parse_assistant
from lily.model import Model
from lily.server.adapter import LilyEngine, load_engine


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny kv64 checkpoint with a tokenizer of its vocabulary size."""
    out = tmp_path_factory.mktemp("server-model") / "tiny-kv64"
    shutil.copytree(tiny_hf_dir, out)
    write_tiny_tokenizer(out, vocab_size=1024)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """The oracle: the same checkpoint loaded on its own, used without the prompt cache."""
    return Model.load(model_dir, backend="reference")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(LilyEngine(Model.load(model_dir, backend="reference"), model_id="tiny")) as running:
        yield running


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def expected(reference: Model, prompt, **sampling):
    return reference.generate(prompt, use_cache=False, **sampling)


def test_chat_matches_the_python_api(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a lily?"}]
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_THINKING,
    )
    want = expected(
        reference,
        reference.encode(messages, enable_thinking=False),
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == [reference.tokenizer.decode([i]) for i in want.token_ids]
    assert [e.logprob for e in entries] == pytest.approx(want.logprobs, abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in entries] == [
        [reference.tokenizer.decode([i]) for i, _ in top] for top in want.top_logprobs
    ]
    assert reply.usage.prompt_tokens == len(reference.encode(messages, enable_thinking=False))
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.choices[0].finish_reason == want.finish_reason


def test_completions_text_and_token_ids(client, reference):
    text = "Once upon a time"
    ids = reference.tokenizer.encode(text)
    want = expected(reference, ids, max_tokens=10, temperature=0)
    for prompt in (text, ids):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
        choice = reply.choices[0]
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(want.token_ids)
        assert choice.logprobs.tokens == [reference.tokenizer.decode([i]) for i in want.token_ids]
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_streaming_with_usage_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    options = dict(model="tiny", messages=messages, max_tokens=16, temperature=0, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (whole.choices[0].message.content or "")
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_and_max_tokens(client, reference):
    ids = reference.tokenizer.encode("The garden")
    full = expected(reference, ids, max_tokens=24, temperature=0).text
    stop = next(
        full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip() and "\ufffd" not in full[i : i + 2]
    )
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0, stop=[stop])
    assert reply.choices[0].text == full[: full.index(stop)] and reply.choices[0].finish_reason == "stop"

    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert reply.choices[0].text == expected(reference, ids, max_tokens=5, temperature=0).text


def test_seed_determinism(client, reference):
    ids = reference.tokenizer.encode("Random words:")
    sample = (
        lambda seed: client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=1.0, seed=seed)
        .choices[0]
        .text
    )  # noqa: E731
    first, again, other = sample(7), sample(7), sample(8)
    assert first == again == expected(reference, ids, max_tokens=16, temperature=1.0, seed=7).text
    assert other != first


def test_second_turn_reuses_the_cache(client, reference):
    system = {"role": "system", "content": "You answer questions about flowers. " * 4}
    turn1 = [system, {"role": "user", "content": "Name a flower."}]
    reply1 = client.chat.completions.create(
        model="tiny", messages=turn1, max_tokens=8, temperature=0, extra_body=NO_THINKING
    )
    assert reply1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [
        {"role": "assistant", "content": reply1.choices[0].message.content or "A lily."},
        {"role": "user", "content": "Another one?"},
    ]
    reply2 = client.chat.completions.create(
        model="tiny", messages=turn2, max_tokens=8, temperature=0, logprobs=True, extra_body=NO_THINKING
    )
    prompt2 = reference.encode(turn2, enable_thinking=False)
    turn1_prompt = reference.encode(turn1, enable_thinking=False)
    cached = reply2.usage.prompt_tokens_details.cached_tokens
    assert reply2.usage.prompt_tokens == len(prompt2)
    answer_header = len(turn1_prompt) - 1 - turn1_prompt[::-1].index(reference.tokenizer.token_to_id("<|im_start|>"))
    assert prompt2[:cached] == turn1_prompt[:cached] and cached >= answer_header
    # Starting from the cache gives exactly the tokens of a prefill from scratch.
    want = expected(reference, prompt2, max_tokens=8, temperature=0, logprobs=True)
    assert [e.token for e in reply2.choices[0].logprobs.content] == [
        reference.tokenizer.decode([i]) for i in want.token_ids
    ]
    assert [e.logprob for e in reply2.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-4)


def test_generation_config_supplies_omitted_sampling_defaults(model_dir, reference, tmp_path):
    greedy_dir = tmp_path / "greedy-by-default"
    shutil.copytree(model_dir, greedy_dir)
    config = json.loads((greedy_dir / "generation_config.json").read_text())
    (greedy_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.8, "top_k": 1}))
    ids = reference.tokenizer.encode("Defaults")
    greedy = expected(reference, ids, max_tokens=10, temperature=0).text
    sampled = expected(reference, ids, max_tokens=10, temperature=1.0, top_k=0, seed=3).text
    assert sampled != greedy
    with ServerThread(LilyEngine(Model.load(greedy_dir, backend="reference"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            ask = lambda **fields: http.post(  # noqa: E731
                "/v1/completions", json={"prompt": ids, "max_tokens": 10, **fields}
            ).json()["choices"][0]["text"]
            # top_k 1 from generation_config: any seed gives the greedy answer...
            assert ask(seed=1) == ask(seed=2) == greedy
            # ...until the request sets its own top_k.
            assert ask(seed=3, top_k=0, temperature=1.0) == sampled


def test_eight_concurrent_sampled_requests(server, reference):
    ids = reference.tokenizer.encode("Concurrency test")
    results: dict[int, str] = {}

    def ask(seed: int) -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            body = {"prompt": ids, "max_tokens": 8, "temperature": 1.0, "seed": seed, "stream": seed % 2 == 0}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200
            if body["stream"]:
                events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                results[seed] = "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])
            else:
                results[seed] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {
        seed: expected(reference, ids, max_tokens=8, temperature=1.0, seed=seed).text for seed in range(8)
    }


def test_demo_model_end_to_end():
    """`lily:demo` (the shipped Shakespeare model) through the server equals the Python API."""
    demo = Model.load("lily:demo", backend="reference")
    messages = [{"role": "user", "content": "Speak of love."}]
    want = demo.generate(demo.encode(messages, enable_thinking=False), use_cache=False, max_tokens=6, temperature=0)
    with ServerThread(load_engine("lily:demo", backend="reference")) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["lily:demo"]
        chunks = list(
            client.chat.completions.create(
                model="lily:demo",
                messages=messages,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_THINKING,
            )
        )
    answer = parse_assistant(want.text, thinking=False).content
    assert answer and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-2].choices[0].finish_reason == want.finish_reason


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_main_serves_a_checkpoint_on_loopback(model_dir):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lily.server",
            str(model_dir),
            "--port",
            str(port),
            "--backend",
            "reference",
            "--api-key",
            "k",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        statuses = set()
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=5, headers={"Authorization": "Bearer k"}
        ) as http:
            while time.monotonic() < deadline:
                try:
                    status = http.get("/health").status_code
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                statuses.add(status)
                if status == 200:
                    break
                time.sleep(0.02)
            assert statuses <= {200, 503} and 200 in statuses
            assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-kv64"
            reply = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            )
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        process.terminate()
        output = process.communicate(timeout=20)[0]
    assert f"http://127.0.0.1:{port}" in output  # the default bind is loopback only


def test_main_reports_a_missing_checkpoint(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "lily.server", str(missing), "--port", str(_free_port()), "--backend", "reference"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 1
    # Checked before the server starts: one line, no traceback.
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("lily serve: error: ") and "no-such-model" in line


def test_the_demo_has_one_name_everywhere():
    """`lily serve lily:demo` and `lily.server.serve(Model.load("lily:demo"))` report the same id."""
    assert load_engine("lily:demo", backend="reference").model_id == "lily:demo"
    assert LilyEngine(Model.load("lily:demo", backend="reference")).model_id == "lily:demo"
