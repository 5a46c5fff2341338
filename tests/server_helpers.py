"""Helpers for the server tests: a real uvicorn server in a thread, and a scripted model.

``ScriptedBackend`` is a backend (``new_state`` / ``forward``) whose logits force a scripted
answer, so a real ``lily.Model`` on top of it runs the real tokenizer, chat template, sampler,
stop strings, prompt cache and reasoning / tool-call parser; only the network's output is fixed.
``respond(prompt_text) -> str`` chooses the answer for the rendered prompt.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import uvicorn

from lily.model import Model
from lily.server import ServerConfig, create_app, uvicorn_config
from lily.tokenizer import Tokenizer

FORCED_LOGIT = 50.0
# The generation prompts of the Qwen3.5/3.6 template, longest first (thinking off, then on).
GENERATION_PROMPTS = ("assistant\n<think>\n\n</think>\n\n", "assistant\n<think>\n", "assistant\n")


@dataclass
class ScriptConfig:
    """The few config fields `lily.Model` reads."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()


class ScriptState:
    """The tokens seen so far: all a scripted model needs."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = list(tokens or [])

    @property
    def position(self) -> int:
        return len(self.tokens)

    def copy(self) -> "ScriptState":
        return ScriptState(self.tokens)


class ScriptedBackend:
    """Logits that make the model say ``respond(prompt)`` and then ``<|im_end|>``.

    ``forward_delay_s`` slows every forward call (for cancellation tests); ``tokens_processed``
    counts every token run through ``forward``.
    """

    def __init__(self, tokenizer: Tokenizer, respond: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self._scripts: dict[tuple[int, ...], list[int]] = {}
        self.respond = respond
        self.vocab_size = tokenizer.vocab_size
        self.forward_delay_s = 0.0
        self.tokens_processed = 0
        self._lock = threading.Lock()
        self._end = tokenizer.token_to_id("<|im_end|>")
        self._turn_start = tokenizer.token_to_id("<|im_start|>")
        self._prompts = [tokenizer.encode(text) for text in GENERATION_PROMPTS]

    @property
    def respond(self) -> Callable[[str], str]:
        """The script: the answer to a rendered prompt."""
        return self._respond

    @respond.setter
    def respond(self, respond: Callable[[str], str]) -> None:
        self._respond = respond
        self._scripts.clear()

    def new_state(self) -> ScriptState:
        return ScriptState()

    def forward(self, token_ids: np.ndarray, state: ScriptState, *, last_only: bool = False) -> np.ndarray:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)
        ids = [int(t) for t in token_ids]
        with self._lock:
            self.tokens_processed += len(ids)
        state.tokens.extend(ids)
        logits = np.zeros((len(ids), self.vocab_size), dtype=np.float32)
        logits[-1, self._next_token(state.tokens)] = FORCED_LOGIT
        return logits

    def _next_token(self, tokens: list[int]) -> int:
        if self._turn_start not in tokens:
            return self._end
        start = len(tokens) - 1 - tokens[::-1].index(self._turn_start)
        after = tokens[start + 1 :]
        for prompt in self._prompts:
            if after[: len(prompt)] == prompt:
                break
        else:
            return self._end  # still inside the prompt
        prompt_ids = tuple(tokens[: start + 1 + len(prompt)])
        script = self._scripts.get(prompt_ids)
        if script is None:
            script = self.tokenizer.encode(self.respond(self.tokenizer.decode(list(prompt_ids))))
            self._scripts[prompt_ids] = script
        output = after[len(prompt) :]
        if output != script[: len(output)] or len(output) >= len(script):
            return self._end
        return script[len(output)]


REASONING = "Let me think about {}."
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def last_user_text(prompt: str) -> str:
    """The text of the last user message of a rendered prompt."""
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def echo(prompt: str) -> str:
    """Answers 'You said: <last user text>', with reasoning first when thinking is on."""
    user = last_user_text(prompt)
    answer = f"You said: {user}"
    if prompt.endswith("<think>\n"):
        return f"{REASONING.format(user)}\n</think>\n\n{answer}"
    return answer


def scripted_model(tokenizer_dir: Path, respond: Callable[[str], str], *, context: int = 4096) -> Model:
    """A real `lily.Model` on a `ScriptedBackend`, with the tokenizer (and template) of `tokenizer_dir`."""
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    backend = ScriptedBackend(tokenizer, respond)
    config = ScriptConfig(tokenizer.vocab_size, context)
    return Model(backend, config, tokenizer, backend_name="scripted", fingerprint="scripted", path=tokenizer_dir)


class ServerThread:
    """A real uvicorn server on a free loopback port, in a daemon thread."""

    def __init__(self, engine, **config) -> None:
        self.config = ServerConfig(**config)
        self.app = create_app(self.config, engine)
        self.state = self.app.state.lily
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn_config(self.app, self.config, log_level="warning", timeout_graceful_shutdown=2)
        )
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.state.scheduler.stop()
        self._socket.close()


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection and return everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
