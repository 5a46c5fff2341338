"""The OpenAI-compatible HTTP server: `lily serve` / `python -m lily.server`.

`app` holds the routes, `requests` the validation of request bodies, `responses` the response shapes,
`scheduler` the one generation thread and its queue, and `adapter` the boundary to `lily.Model`.
"""

from lily.server.app import ServerConfig, create_app, main, serve

__all__ = ["ServerConfig", "create_app", "serve", "main"]
