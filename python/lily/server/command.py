"""`lily serve` / `python -m lily.server`: the command line of the server (arguments, one-line startup errors)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from .app import DEFAULT_KEEPALIVE_S, serve
from .scheduler import DEFAULT_MAX_QUEUE


def _check_local_model(model: str, max_context: int | None) -> None:
    """Fail fast, in one line, on a local model that cannot be served (a repo id downloads later,
    in the background)."""
    from .. import hub
    from ..config import ModelArgs

    if not (model.startswith(("lily:", "/", ".", "~")) or os.path.exists(model)):
        return
    args = ModelArgs.from_file(hub.resolve(model, progress=False))
    if max_context is not None and max_context > args.max_position_embeddings:
        raise ValueError(f"--max-context must be at most the model's context {args.max_position_embeddings}, "
                         f"got {max_context}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: `lily serve MODEL [--host ...]`."""
    parser = argparse.ArgumentParser(
        prog="lily serve",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        epilog="Environment: LILY_API_KEY is the API key when --api-key is not given. /health never needs the key.",
    )
    parser.add_argument("model", help="checkpoint directory, Hugging Face repo id, or lily:demo")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument(
        "--api-key", default=os.environ.get("LILY_API_KEY"), help="require this key (default: $LILY_API_KEY, else none)"
    )
    parser.add_argument("--cors-origin", default=None, help="allow browser requests from this origin")
    parser.add_argument("--max-context", type=int, default=None, help="context limit below the model's own")
    parser.add_argument(
        "--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help=f"requests allowed to wait (default {DEFAULT_MAX_QUEUE})"
    )
    parser.add_argument("--backend", default=None, help="engine backend (default: the best available)")
    parser.add_argument("--precision", default=None, choices=("bfloat16", "float32"),
                        help="metal backend activations (default: the backend's own)")
    parser.add_argument(
        "--keepalive", type=float, default=DEFAULT_KEEPALIVE_S, help="seconds between SSE keep-alive comments (0: off)"
    )
    args = parser.parse_args(argv)
    if args.max_queue < 1:
        parser.error(f"--max-queue must be at least 1, got {args.max_queue}")
    if args.max_context is not None and args.max_context < 1:
        parser.error(f"--max-context must be at least 1, got {args.max_context}")
    if args.keepalive < 0:
        parser.error(f"--keepalive must be >= 0, got {args.keepalive}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        _check_local_model(args.model, args.max_context)
        serve(
            args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            cors_origin=args.cors_origin,
            max_context=args.max_context,
            max_queue=args.max_queue,
            backend=args.backend,
            precision=args.precision,
            keepalive_s=args.keepalive,
        )
    except (RuntimeError, ValueError) as exc:
        print(f"lily serve: error: {exc}", file=sys.stderr)
        return 1
    return 0

