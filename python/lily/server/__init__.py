"""The OpenAI-compatible HTTP server: `lily serve` / `python -m lily.server`.

`app` holds the routes and `serve`, `command` the command line, `http` the HTTP-layer limits and errors, `requests` the validation of request bodies,
`responses` the response shapes, `scheduler` the one generation thread and its queue, and `adapter` the boundary to
`lily.Model`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerConfig", "create_app", "uvicorn_config", "serve", "main"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so `lily --help` can read lily.server.scheduler's defaults without importing Starlette.
    if name == "main":
        from lily.server.command import main

        return main
    if name in __all__:
        from lily.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'lily.server' has no attribute {name!r}")
