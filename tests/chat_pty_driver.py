"""Runs `lily chat` (cli.main) for tests/test_cli.py's terminal test, on a model whose prefill can
be made slow, logging the messages of every turn as one JSON line to a file.

Usage: python chat_pty_driver.py MODEL_DIR LOG_FILE. A turn whose last message is "slow message"
waits 30 s in every forward call, so a test can press Ctrl-C during its prefill.
"""

from __future__ import annotations

import json
import sys
import time

import lily
from lily import cli

SLOW = "slow message"


class SlowBackend:
    """The model's backend, with a delay before every forward call."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.delay_s = 0.0

    def new_state(self):
        return self.inner.new_state()

    def forward(self, ids, state, *, last_only=False):
        time.sleep(self.delay_s)
        return self.inner.forward(ids, state, last_only=last_only)


def main() -> int:
    model_dir, log_path = sys.argv[1], sys.argv[2]
    load = lily.Model.load

    def load_logged(*args, **kwargs):
        model = load(*args, **kwargs)
        model.backend = SlowBackend(model.backend)
        chat = model.chat

        def logged_chat(messages, **options):
            with open(log_path, "a") as log:
                log.write(json.dumps(messages) + "\n")
            model.backend.delay_s = 30.0 if messages[-1]["content"] == SLOW else 0.0
            return chat(messages, **options)

        model.chat = logged_chat
        return model

    lily.Model.load = load_logged
    return cli.main(["chat", "--model", model_dir, "--backend", "reference", "--max-tokens", "2", "--temp", "0"])


if __name__ == "__main__":
    sys.exit(main())
