"""Fuzz a real `lily serve` process over loopback and check it never fails a client.

Starts a server process on a free port (by default on the demo's tokenizer, chat template and
parser with scripted logits from tests/server_helpers.py, so the run measures the server and not
the numpy reference model; `--model lily:demo` serves the real demo model), then, from several threads at once, sends
mutated chat and completion bodies (wrong types, out-of-range numbers, lone UTF-16 surrogates,
deep nesting, unknown fields, streaming and not), a few huge strings just under the 16 MB body
limit, raw malformed HTTP, and connections that send half a request head and stop. A monitor
asks /health every 0.2 s throughout.

Pass: no 5xx, no request left unanswered (hang), every half-sent head answered or closed by the
header timeout, and every /health answered within 1 s. Prints one JSON summary line; exit 1 on
failure.

    python scripts/fuzz_server.py --bodies 1200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import httpx

HUGE_BYTES = 15 * 1024 * 1024  # under the server's 16 MiB body limit
REQUEST_TIMEOUT_S = 60.0  # an answer slower than this counts as a hang
HEALTH_LIMIT_S = 1.0

WEIRD_VALUES = [
    None, True, False, 0, -1, 1, 2, 1.5, -1e308, 1e308, 2**64, -(2**70), "", "x", "\ud800", "a\udfffb",
    "\ud83d", "🙂" * 3, "\x00", "\u202e", [], [1], ["a", "\udc00"], {}, {"a": 1}, {"\ud800": 1}, [[[[[]]]]],
    "NaN", "1e999", " " * 1000,
]
FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "best_of", "seed",
    "stop", "logit_bias", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stream", "stream_options", "user", "parallel_tool_calls", "reasoning_effort",
    "tools", "tool_choice", "response_format", "chat_template_kwargs", "enable_thinking", "model", "messages",
    "prompt", "echo", "suffix", "metadata",
]
TEXTS = ["hello", "ROMEO:", "cut \ud83d", "\ud800", "emoji 🙂 ok", "ünïcödé", "<tool_call>\n<function=f>",
         "</think>", "<|im_end|>", "a" * 600, ""]


SCRIPTED_SERVER = """
import sys
sys.path.insert(0, {tests!r})
from server_helpers import echo, scripted_model
from lily import hub
from lily.server import serve
from lily.server.adapter import LilyEngine

serve(LilyEngine(scripted_model(hub.resolve("lily:demo"), echo), model_id="scripted"), port={port})
"""


def server_command(model: str, backend: str, port: int) -> list[str]:
    if model == "scripted":
        tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
        return [sys.executable, "-c", SCRIPTED_SERVER.format(tests=os.path.normpath(tests), port=port)]
    return [sys.executable, "-m", "lily.server", model, "--port", str(port), "--backend", backend]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def random_messages(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return rng.choice(WEIRD_VALUES)
    messages = []
    for _ in range(rng.randint(1, 4)):
        role = rng.choice(["user", "user", "system", "assistant", "tool", "developer", "wizard", None])
        content: object = rng.choice(TEXTS)
        if rng.random() < 0.2:
            content = [{"type": "text", "text": rng.choice(TEXTS)}]
        if rng.random() < 0.1:
            content = rng.choice(WEIRD_VALUES)
        message = {"role": role, "content": content}
        if role == "assistant" and rng.random() < 0.3:
            message["tool_calls"] = [{"id": "c1", "type": "function",
                                      "function": {"name": "f", "arguments": rng.choice(['{"a": 1}', "{oops", "\ud800"])}}]
        messages.append(message)
    return messages


def random_body(rng: random.Random, chat: bool) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 3)}
    if chat:
        body["messages"] = random_messages(rng)
        if rng.random() < 0.5:
            body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
        if rng.random() < 0.2:
            body["tools"] = [{"type": "function", "function": {
                "name": "get_weather", "description": rng.choice(TEXTS),
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    else:
        body["prompt"] = rng.choice(TEXTS + [[1, 2, 3], [10**9], ["x", "y"]])
    if rng.random() < 0.3:
        body["stream"] = True
    for _ in range(rng.randint(0, 3)):
        name = rng.choice(FIELDS)
        value = rng.choice(WEIRD_VALUES)
        if name == "max_tokens" and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                        and value > 3)):
            value = 3  # a valid but long generation (None: to the end of the context) only measures the model
        if name == "max_completion_tokens" and isinstance(value, int) and not isinstance(value, bool) and value > 3:
            value = 3
        body[name] = value
    return body


def huge_body(rng: random.Random, chat: bool) -> bytes:
    """About 15 MB of JSON (under the body limit), sometimes ending in a lone surrogate."""
    filler = rng.choice(["word ", "🙂", "\u00e9", "x"])
    escaped = len(json.dumps(filler)) - 2  # JSON bytes per filler, non-ASCII escaped
    text = filler * ((HUGE_BYTES - 1000) // escaped)
    if rng.random() < 0.5:
        text += "\ud800"
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    return json.dumps({**body, "max_tokens": 2}).encode()


RAW_REQUESTS = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"GARBAGE / HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{\"mess",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
]


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[str] = Counter()
        self.failures: list[str] = []
        self.bodies = 0

    def record(self, status: str, failure: str | None = None) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.bodies += 1
            if self.bodies % 100 == 0:
                print(f"{self.bodies} requests: {dict(self.statuses)}", file=sys.stderr, flush=True)
            if failure:
                self.failures.append(failure)


def send(client: httpx.Client, path: str, data: bytes, results: Results, label: str) -> None:
    try:
        with client.stream("POST", path, content=data, headers={"content-type": "application/json"},
                           timeout=REQUEST_TIMEOUT_S) as response:
            body = b"".join(response.iter_bytes())
        status = response.status_code
        failure = f"{label}: {status} {body[:200]!r}" if status >= 500 else None
        if status == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
            if not body.rstrip().endswith(b"data: [DONE]"):
                failure = f"{label}: stream without [DONE]: {body[-200:]!r}"
        results.record(str(status), failure)
    except httpx.TimeoutException:
        results.record("hang", f"{label}: no answer within {REQUEST_TIMEOUT_S} s")
    except httpx.TransportError as exc:
        results.record("closed", f"{label}: connection error {exc!r}")


def send_raw(port: int, data: bytes, results: Results) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as sock:
            sock.sendall(data)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "no-answer"
        failure = f"raw {data[:40]!r}: {answer[:200]!r}" if status.startswith("5") else None
        results.record(status, failure)
    except socket.timeout:
        results.record("hang", f"raw {data[:40]!r}: no answer within {REQUEST_TIMEOUT_S} s")
    except OSError:
        results.record("closed")  # the server may reset a connection whose request it refused


def half_sent_heads(port: int, count: int, header_timeout_s: float, results: Results) -> None:
    """Open `count` connections that send half a request head; each must be answered (408) or
    closed within the header timeout plus slack."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=header_timeout_s + 10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"[: 10 + i % 40])
        sockets.append(sock)
    start = time.monotonic()
    for sock in sockets:
        try:
            answer = sock.recv(65536)
            status = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
            results.record(f"half-head {status}", f"half-head answered {status}" if status.startswith("5") else None)
        except socket.timeout:
            results.record("hang", "a half-sent head was kept open past the header timeout")
        except OSError:
            results.record("half-head closed")
        finally:
            sock.close()
    if time.monotonic() - start > header_timeout_s + 10:
        results.failures.append("half-sent heads were not closed in time")


def monitor_health(port: int, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = client.get("/health").status_code == 200
            except httpx.HTTPError as exc:
                ok = False
                failures.append(f"/health failed: {exc!r}")
            latencies.append(time.monotonic() - start)
            if not ok:
                failures.append("/health did not answer 200")
            stop.wait(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="scripted", help="'scripted' (default) or a model to serve")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--bodies", type=int, default=1200, help="mutated JSON bodies (default 1200)")
    parser.add_argument("--huge", type=int, default=6, help="bodies of about 15 MB (default 6)")
    parser.add_argument("--half-heads", type=int, default=60, help="half-sent request heads (default 60)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    port = free_port()
    server_log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would fill and block the server
    server = subprocess.Popen(server_command(args.model, args.backend, port), stdout=subprocess.DEVNULL,
                              stderr=server_log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    results = Results()
    latencies: list[float] = []
    health_failures: list[str] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
        monitor = threading.Thread(target=monitor_health, args=(port, stop, latencies, health_failures))
        monitor.start()
        start = time.monotonic()
        rng = random.Random(args.seed)
        jobs: list[tuple[str, object]] = []
        for i in range(args.bodies):
            chat = rng.random() < 0.6
            body = random_body(rng, chat)
            data = json.dumps(body).encode()  # ASCII escapes: lone surrogates travel as \ud800
            jobs.append(("body", ("/v1/chat/completions" if chat else "/v1/completions", data, f"body {i}")))
        for i in range(args.huge):
            chat = i % 2 == 0
            jobs.append(("body", ("/v1/chat/completions" if chat else "/v1/completions",
                                  huge_body(rng, chat), f"huge {i}")))
        jobs += [("raw", raw) for raw in RAW_REQUESTS * 4]
        rng.shuffle(jobs)
        queue = list(enumerate(jobs))
        lock = threading.Lock()

        def worker() -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
                while True:
                    with lock:
                        if not queue:
                            return
                        _, (kind, job) = queue.pop()
                    if kind == "body":
                        path, data, label = job  # type: ignore[misc]
                        send(client, path, data, results, label)
                    else:
                        send_raw(port, job, results)  # type: ignore[arg-type]

        workers = [threading.Thread(target=worker) for _ in range(args.workers)]
        heads = threading.Thread(target=half_sent_heads, args=(port, args.half_heads, 10.0, results))
        for thread in [*workers, heads]:
            thread.start()
        for thread in [*workers, heads]:
            thread.join()
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.seek(0)
        log = server_log.read()
    slow = [t for t in latencies if t > HEALTH_LIMIT_S]
    failures = results.failures + health_failures + [f"/health took {t:.2f} s" for t in slow]
    if "Traceback" in log:
        failures.append("the server logged a traceback")
    summary = {
        "requests": results.bodies, "statuses": dict(sorted(results.statuses.items())),
        "five_xx": sum(n for s, n in results.statuses.items() if s.split()[-1].startswith("5")),
        "hangs": results.statuses.get("hang", 0), "health_checks": len(latencies),
        "health_max_s": round(max(latencies, default=0.0), 3), "seconds": round(elapsed, 1),
        "failures": failures[:20], "ok": not failures,
    }
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
