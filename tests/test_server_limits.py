"""The server under hostile or careless clients, over real loopback sockets: half-sent headers,
too many connections, requests the HTTP layer cannot parse, huge prompts under the body limit,
and Ctrl-C while a stream is running (a real `lily.server.serve` process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import NO_THINKING, ServerThread, echo, raw_request, scripted_model
from tokenizer_fixture import write_tiny_tokenizer

from lily.server.adapter import LilyEngine
from lily.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("server-limits-tokenizer"))


@pytest.fixture(scope="module")
def model(tokenizer_dir):
    return scripted_model(tokenizer_dir, echo)


def json_error(answer: bytes, status: int) -> dict:
    """The error object of a raw HTTP answer with this status and a JSON body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["message"] and error["code"], error
    return error


def health_seconds(port: int) -> float:
    start = time.monotonic()
    assert raw_request(port, HEALTH, timeout=30).startswith(b"HTTP/1.1 200")
    return time.monotonic() - start


def test_half_sent_header_times_out_with_json_408(model):
    with ServerThread(LilyEngine(model, model_id="scripted"), header_timeout_s=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            answer = sock.recv(65536)
            waited = time.monotonic() - start
            assert sock.recv(65536) == b""  # and closed
        assert json_error(answer, 408)["code"] == "request_timeout" and 0.4 < waited < 5
        # The same bound holds for the next request on a keep-alive connection.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):
                first += sock.recv(65536)
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            second = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and json_error(second, 408)["code"] == "request_timeout"


def test_connections_beyond_the_bound_get_json_503(model):
    with ServerThread(LilyEngine(model, model_id="scripted"), max_connections=4, header_timeout_s=30) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
        try:
            for sock in idle:
                sock.sendall(b"GET /health HTTP/1.1\r\n")  # half a header each
            time.sleep(0.2)
            answer = raw_request(server.port, HEALTH)
            error = json_error(answer, 503)
            assert error["code"] == "too_many_connections" and b"retry-after: 1" in answer.lower()
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert raw_request(server.port, HEALTH).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"GARBAGE\x00 / HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBad Header Name: 1\r\n\r\n",
], ids=["content-length-abc", "garbage-request-line", "200kb-header", "bad-header-name"])
def test_http_layer_errors_are_json(model, request_bytes):
    with ServerThread(LilyEngine(model, model_id="scripted")) as server:
        error = json_error(raw_request(server.port, request_bytes), 400)
        assert error["code"] == "invalid_http_request"
        assert raw_request(server.port, HEALTH).startswith(b"HTTP/1.1 200")


def test_huge_prompts_are_refused_at_once_and_health_stays_fast(model):
    """Two 15 MB chats and a 15 MB completion under the 16 MB body limit: 400 without tokenizing,
    while /health and a short completion are answered within a second."""
    huge = "word " * (3 * 1024 * 1024)  # 15 MiB
    chat = json.dumps({"messages": [{"role": "user", "content": huge}], **NO_THINKING}).encode()
    completion = json.dumps({"prompt": huge, "max_tokens": 4}).encode()
    assert len(chat) < 16 * 1024 * 1024
    answers: dict[int, httpx.Response] = {}
    with ServerThread(LilyEngine(model, model_id="scripted")) as server:

        def send(i: int, path: str, body: bytes) -> None:
            answers[i] = httpx.post(server.base_url + path, content=body, timeout=60)

        start = time.monotonic()
        threads = [threading.Thread(target=send, args=(i, path, body))
                   for i, (path, body) in enumerate([(CHAT, chat), (CHAT, chat), ("/v1/completions", completion)])]
        for thread in threads:
            thread.start()
        latencies = []
        while any(t.is_alive() for t in threads):
            latencies.append(health_seconds(server.port))
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
        short = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
    for response in answers.values():
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert elapsed < 15 and max(latencies) < 1.0, (elapsed, latencies)
    assert short.status_code == 200


def test_the_cheap_bound_never_refuses_a_prompt_that_fits(model, tokenizer_dir):
    """A prompt is refused before tokenizing only when its tokens surely reach the context."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    limit = 64
    with ServerThread(LilyEngine(model, model_id="scripted"), max_context=limit) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            for text in ["a" * n for n in (40, 63, 64, 200, 2000)] + ["héllo wörld " * n for n in (3, 30)]:
                response = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
                fits = len(tokenizer.encode(text)) < limit
                assert (response.status_code == 200) == fits, (len(text), response.text)
                if not fits:
                    assert response.json()["error"]["code"] == "context_length_exceeded"
            # Chats: an earlier turn's reasoning, which the template drops, must not count.
            for reasoning, answer in ((500, 3), (3, 30), (3, 300), (2000, 10)):
                messages = [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": f"<think>\n{'r' * reasoning}\n</think>\n\n{'a' * answer}"},
                            {"role": "user", "content": "next"}]
                response = http.post(CHAT, json={"messages": messages, "max_tokens": 1, **NO_THINKING})
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
                fits = len(tokenizer.encode(rendered)) < limit
                assert (response.status_code == 200) == fits, (reasoning, answer, response.text)


SERVE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from server_helpers import scripted_model
from lily.server import serve
from lily.server.adapter import LilyEngine

model = scripted_model(Path({tokenizer!r}), lambda prompt: "word " * 400)
model.backend.forward_delay_s = {forward_delay_s}
serve(LilyEngine(model, model_id="scripted"), port={port})
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tokenizer_dir: Path, forward_delay_s: float) -> tuple[subprocess.Popen, int]:
    """A real `lily.server.serve` process on a scripted model, once /health answers."""
    port = free_port()
    script = SERVE_SCRIPT.format(tests=str(Path(__file__).parent), tokenizer=str(tokenizer_dir), port=port,
                                 forward_delay_s=forward_delay_s)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while True:
        try:
            if raw_request(port, HEALTH, timeout=2).startswith(b"HTTP/1.1 200"):
                return process, port
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise AssertionError(f"the server did not start: {process.communicate()[0]}")
        time.sleep(0.1)


def interrupt(process: subprocess.Popen, times: int) -> None:
    """Ctrl-C `times` times, 0.1 s apart: the second while the server waits for the engine's step (uvicorn's
    forced exit)."""
    for _ in range(times):
        process.send_signal(signal.SIGINT)
        time.sleep(0.1)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    """The exit status and everything the server printed."""
    try:
        code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    return code, process.communicate()[0]


def assert_clean_exit(code: int, output: str) -> None:
    assert code == 0, output
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output


# One Ctrl-C: the running generation stops at its next token. Two, during a slow forward: uvicorn stops
# waiting and cancels the open responses, which must still end cleanly.
@pytest.mark.parametrize("ctrl_c, forward_delay_s", [(1, 0.02), (2, 3.0)], ids=["once", "twice-mid-forward"])
def test_ctrl_c_ends_active_streams_with_an_error_event_and_done(tokenizer_dir, ctrl_c, forward_delay_s):
    process, port = start_server(tokenizer_dir, forward_delay_s)
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True, **NO_THINKING}
    lines = []
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}{CHAT}", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == (5 if ctrl_c == 1 else 2):
                    if ctrl_c == 2:
                        time.sleep(0.5)  # the engine is inside the next 3 s forward, not between two tokens
                    interrupted = time.monotonic()
                    interrupt(process, ctrl_c)
        ended = time.monotonic()
    finally:
        code, output = finish(process)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutting_down"
    tokens = [json.loads(line[6:]) for line in lines[:-2]]
    assert (4 if ctrl_c == 1 else 1) <= len(tokens) < 400  # cut short, not run to the end
    if ctrl_c == 2:  # the stream ended when the second Ctrl-C came, not when the 3 s forward returned
        assert ended - interrupted < forward_delay_s / 2
    assert_clean_exit(code, output)


def test_a_second_ctrl_c_answers_a_running_request_with_503(tokenizer_dir):
    process, port = start_server(tokenizer_dir, forward_delay_s=3.0)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3, **NO_THINKING}
    answer: list[httpx.Response] = []
    try:
        client = threading.Thread(
            target=lambda: answer.append(httpx.post(f"http://127.0.0.1:{port}{CHAT}", json=body, timeout=30))
        )
        client.start()
        time.sleep(0.5)  # the request is in its first forward
        interrupt(process, 2)
        client.join(timeout=30)
    finally:
        code, output = finish(process)
    assert answer and answer[0].status_code == 503, answer and answer[0].text
    assert answer[0].json()["error"]["code"] == "server_shutting_down"
    assert_clean_exit(code, output)


def test_the_fuzz_script_runs_and_finds_no_failure():
    """scripts/fuzz_server.py, small (its full run is docs/verification.md's): it starts its server and reports."""
    script = Path(__file__).parent.parent / "scripts" / "fuzz_server.py"
    done = subprocess.run([sys.executable, str(script), "--bodies", "40", "--huge", "1", "--half-heads", "0",
                           "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["five_xx"] == 0 and summary["hangs"] == 0 and summary["requests"] >= 41
