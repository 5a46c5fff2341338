"""The OpenAI-compatible HTTP server: `lily serve` / `python -m lily.server`.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
One engine thread generates; requests wait in a bounded FIFO queue (`scheduler`). Request
validation lives in `requests`, response shapes in `responses`, and the boundary to
`lily.Model` in `adapter`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar, Union

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..sampling import SamplingParams
from .adapter import Engine, LilyEngine, TokenEvent, load_engine
from .http import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, RETRY_AFTER_S, make_protocol
from .requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from .responses import (
    DONE_EVENT,
    ChatAssembler,
    ChunkWriter,
    completion_logprobs,
    event,
    new_id,
    usage,
)
from .scheduler import DEFAULT_MAX_QUEUE, Done, Job, QueueFull, Scheduler, ShuttingDown

__all__ = ["ServerConfig", "create_app", "uvicorn_config", "serve"]

log = logging.getLogger("lily.server")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEPALIVE_S = 15.0

_Parsed = TypeVar("_Parsed", bound=Union[ChatRequest, CompletionRequest])


@dataclass
class ServerConfig:
    """Settings of one server; the defaults are the safe ones (loopback, no CORS, no key)."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    cors_origin: str | None = None
    max_context: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keepalive_s: float = DEFAULT_KEEPALIVE_S  # SSE comment while a stream waits (long prefill); 0 = off
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request head must arrive within this
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections beyond this get 503


class _Started:
    """First event of a generation job: the prompt is prefilled."""

    def __init__(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens


class ServerState:
    """The engine (None while loading), its scheduler, and the limits derived from the config."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.scheduler = Scheduler(config.max_queue)
        self.created = int(time.time())

    def set_engine(self, engine: Engine) -> None:
        """Make the server ready; checks `max_context` against the model's own limit."""
        limit = self.config.max_context
        if limit is not None and not 1 <= limit <= engine.context_length:
            raise ValueError(f"max_context must be in [1, {engine.context_length}] for this model, got {limit}")
        self.engine = engine

    @property
    def context_length(self) -> int:
        """The context a request may use: `max_context` if set, else the model's own."""
        assert self.engine is not None
        return self.config.max_context or self.engine.context_length

    def ready_engine(self) -> Engine:
        """The engine, or a 503 while it is loading (or failed to load)."""
        if self.engine is None:
            if self.load_error is not None:
                raise ApiError(
                    503, f"Model failed to load: {self.load_error}", type="unavailable_error", code="model_load_failed"
                )
            raise ApiError(503, "Model is loading", type="unavailable_error", code="model_loading")
        return self.engine


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_body(request: Request, config: ServerConfig) -> bytes:
    """The whole body, refusing oversized ones (413) and ones that do not arrive in time (408)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, f"Invalid Content-Length header {declared!r}", code="invalid_header")
        if int(declared) > config.max_body_bytes:
            raise _too_large(config)

    async def receive_all() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise _too_large(config)
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(receive_all(), timeout=config.body_timeout_s)
    except ClientDisconnect:
        raise ApiError(400, "Client disconnected before sending the whole body", code="client_disconnected") from None
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"Request body not received within {config.body_timeout_s:g} s", code="request_timeout", headers=_CLOSE
        ) from None


# The rest of an unread body would be taken for the next request: hang up instead.
_CLOSE = {"Connection": "close"}


def _too_large(config: ServerConfig) -> ApiError:
    return ApiError(
        413, f"Request body is larger than {config.max_body_bytes} bytes", code="request_too_large", headers=_CLOSE
    )


def _check_model(state: ServerState, requested: str | None) -> None:
    served = state.ready_engine().model_id
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model {requested!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _check_text_size(state: ServerState, engine: Engine, texts: Sequence[str], param: str) -> None:
    """Refuse, before tokenizing, a prompt whose text alone surely exceeds the context: a token
    covers at most `engine.max_token_bytes` bytes, so the prompt has at least this many tokens."""
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    at_least = -(-text_bytes // max(engine.max_token_bytes, 1))
    if at_least >= state.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.context_length} tokens, but the prompt's "
            f"{text_bytes} bytes of text make at least {at_least} tokens",
            param=param,
            code="context_length_exceeded",
            extra={"n_prompt_tokens_at_least": at_least, "n_ctx": state.context_length},
        )


def _check_context(state: ServerState, prompt_tokens: int, param: str) -> None:
    limit = state.context_length
    if prompt_tokens == 0:
        raise ApiError(400, f"'{param}' is empty: the prompt has 0 tokens", param=param, code="empty_prompt")
    if prompt_tokens >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_tokens} tokens "
            f"(at least 1 token must be left for the answer)",
            param=param,
            code="context_length_exceeded",
            extra={"n_prompt_tokens": prompt_tokens, "n_ctx": limit},
        )


def _check_max_tokens(state: ServerState, body: dict, sampling: SamplingParams) -> None:
    """Refuse an answer longer than the whole context: it can never come (a shorter one that does not fit after this
    prompt runs to the end of the context, finish_reason "length")."""
    if sampling.max_tokens is not None and sampling.max_tokens > state.context_length:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise ApiError(
            400,
            f"'{name}': {sampling.max_tokens} tokens can never fit: this model's maximum context length is "
            f"{state.context_length} tokens, prompt and answer together",
            param=name,
            code="context_length_exceeded",
        )


def _start_job(state: ServerState, prompt: list[int], chat: ChatRequest | None, sampling: SamplingParams) -> Job:
    """Queue a generation; its events are `_Started`, then `TokenEvent`s, then `Done`."""
    engine = state.ready_engine()
    room = state.context_length - len(prompt)
    asked = sampling.max_tokens
    sampling.max_tokens = room if asked is None else min(asked, room)

    def work(job: Job) -> None:
        generation = engine.generate(prompt, chat, sampling, job.is_cancelled)
        count, reason = 0, None
        try:
            job.emit(_Started(generation.prompt_tokens, generation.cached_tokens))
            for token in generation:
                job.emit(token)
                count, reason = count + 1, token.finish_reason
                if job.is_cancelled():
                    break
        finally:
            generation.close()
        if reason == "length" and count == room and (asked is None or asked > room):
            log.info("a generation stopped at the context limit (finish_reason \"length\"): %d prompt + %d generated "
                     "tokens fill the %d-token context%s", len(prompt), count, state.context_length,
                     "" if asked is None else f" before max_tokens={asked}")

    job = Job(work, asyncio.get_running_loop())
    try:
        state.scheduler.submit(job)
    except QueueFull as exc:
        raise ApiError(
            503, f"Server is busy: {exc}", type="unavailable_error", code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except ShuttingDown:
        raise _shutting_down() from None
    return job


def _shutting_down() -> ApiError:
    return ApiError(503, "Server is shutting down", type="unavailable_error", code="server_shutting_down")


_KEEPALIVE = ": keepalive\n\n"


async def _events(job: Job, keepalive_s: float = 0.0) -> AsyncIterator[Any]:
    """The job's events until `Done`; a failed job raises an ApiError (500). With `keepalive_s`,
    `_KEEPALIVE` comes whenever nothing happened for that long, so clients and proxies wait."""
    while True:
        if keepalive_s > 0:
            try:
                item = await asyncio.wait_for(job.next(), timeout=keepalive_s)
            except asyncio.TimeoutError:
                yield _KEEPALIVE
                continue
        else:
            item = await job.next()
        if isinstance(item, Done):
            if isinstance(item.error, ShuttingDown):
                raise _shutting_down()
            if item.error is not None:
                raise ApiError(
                    500, "Generation failed; see the server log", type="server_error", code="generation_failed"
                )
            return
        yield item


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class _EventStream(Response):
    """An SSE response that cancels its job as soon as the client goes away. When the server exits
    without waiting (a second Ctrl-C, or the grace period over), uvicorn cancels the response: the stream
    still ends with the shutting-down error event and `[DONE]`, and no traceback is logged."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None], scheduler: Scheduler) -> None:
        self.chunks = chunks
        self.on_close = on_close
        self.scheduler = scheduler
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(_watch_disconnect(receive, self.on_close))
        done_sent = False

        async def send_chunk(chunk: str) -> None:
            nonlocal done_sent
            await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            done_sent = chunk == DONE_EVENT

        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send_chunk(chunk)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-write; on_close below stops the job
        except asyncio.CancelledError:
            if not self.scheduler.stopping:
                raise
            log.info("ended an open stream at exit")
            if not done_sent:
                await send_chunk(event(_shutting_down().body()))
                await send_chunk(DONE_EVENT)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.on_close()
            await self.chunks.aclose()  # type: ignore[attr-defined]


async def _collect(
    request: Request, state: ServerState, job: Job, prompt: list[int]
) -> tuple[_Started, list[TokenEvent]]:
    """The job's prefill report and tokens for a non-streaming reply, cancelling the job if the
    client disconnects."""
    started = _Started(len(prompt), 0)
    tokens: list[TokenEvent] = []
    watcher = asyncio.create_task(_watch_disconnect(request.receive, lambda: state.scheduler.cancel(job)))
    try:
        async for item in _events(job):
            if isinstance(item, _Started):
                started = item
            else:
                tokens.append(item)
    finally:
        watcher.cancel()
        state.scheduler.cancel(job)
    return started, tokens


async def _stream(
    state: ServerState,
    job: Job,
    chunks: Callable[[TokenEvent], Iterable[str]],
    closing: Callable[[_Started | None], Iterable[str]],
    opening: Iterable[str] = (),
) -> AsyncIterator[str]:
    """A streamed response: `opening`, `chunks(item)` for each generated item (keepalives pass through), then
    `closing` given the job's start record. The status line is already sent, so errors travel in-stream; [DONE]
    ends the stream either way."""
    started: _Started | None = None
    try:
        for chunk in opening:
            yield chunk
        async for item in _events(job, state.config.keepalive_s):
            if item is _KEEPALIVE:
                yield item
            elif isinstance(item, _Started):
                started = item
            else:
                for chunk in chunks(item):
                    yield chunk
        for chunk in closing(started):
            yield chunk
    except ApiError as exc:
        yield event(exc.body())
    yield DONE_EVENT


def _stream_chat(state: ServerState, job: Job, assembler: ChatAssembler, writer: ChunkWriter) -> AsyncIterator[str]:
    def choice(delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": assembler.take_logprobs(), "finish_reason": finish_reason}

    def chunks(item: TokenEvent) -> Iterable[str]:
        delta = assembler.add(item)
        return () if delta is None else (writer.chunk(choice(delta)),)

    def closing(started: _Started | None) -> Iterable[str]:
        yield writer.chunk(choice({"content": ""}, assembler.final_reason()))
        if writer.include_usage and started is not None:
            yield writer.chunk(None, usage(started.prompt_tokens, assembler.completion_tokens, started.cached_tokens,
                                           assembler.reasoning_tokens))

    return _stream(state, job, chunks, closing, opening=[writer.chunk(choice({"role": "assistant", "content": ""}))])


def _stream_completion(
    state: ServerState, job: Job, engine: Engine, sampling: SamplingParams, writer: ChunkWriter
) -> AsyncIterator[str]:
    completion_tokens, offset, reason = 0, 0, None

    def chunks(item: TokenEvent) -> Iterable[str]:
        nonlocal completion_tokens, offset, reason
        completion_tokens += 1
        reason = item.finish_reason or reason
        logprobs = completion_logprobs(engine, [item], sampling.top_logprobs, offset) if sampling.logprobs else None
        offset += len(item.text)
        return (writer.chunk({"index": 0, "text": item.text, "logprobs": logprobs, "finish_reason": None}),)

    def closing(started: _Started | None) -> Iterable[str]:
        yield writer.chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": reason or "stop"})
        if writer.include_usage and started is not None:
            yield writer.chunk(None, usage(started.prompt_tokens, completion_tokens, started.cached_tokens))

    return _stream(state, job, chunks, closing)


def _state(request: Request) -> ServerState:
    return request.app.state.lily


async def _parse_request(
    request: Request, parse: Callable[[dict[str, Any], int, Mapping[str, float]], _Parsed]
) -> tuple[ServerState, Engine, _Parsed]:
    """Read and validate a generation request with `parse`, and check the model it names."""
    state = _state(request)
    raw = await _read_body(request, state.config)
    body = await run_in_threadpool(parse_json_body, raw)  # a 16 MB body takes a while to parse
    engine = state.ready_engine()
    parsed = parse(body, engine.vocab_size, engine.sampling_defaults)
    _check_model(state, parsed.model)
    _check_max_tokens(state, body, parsed.sampling)
    return state, engine, parsed


async def _chat_completions(request: Request) -> Response:
    state, engine, chat = await _parse_request(request, parse_chat_request)
    _check_text_size(state, engine, _rendered_texts(chat), "messages")
    prompt = await run_in_threadpool(_encode_chat, engine, chat)
    _check_context(state, len(prompt), "messages")
    assembler = ChatAssembler(engine, logprobs=chat.sampling.logprobs, top_logprobs=chat.sampling.top_logprobs)
    job = _start_job(state, prompt, chat, chat.sampling)
    completion_id = new_id("chatcmpl")
    if chat.stream:
        writer = ChunkWriter("chat.completion.chunk", completion_id, engine.model_id, chat.include_usage)
        return _EventStream(
            _stream_chat(state, job, assembler, writer), lambda: state.scheduler.cancel(job), state.scheduler
        )

    started, tokens = await _collect(request, state, job, prompt)
    for token in tokens:
        assembler.add(token)
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": engine.model_id,
            "choices": [
                {
                    "index": 0,
                    "message": assembler.message(),
                    "logprobs": {"content": assembler.logprob_entries} if chat.sampling.logprobs else None,
                    "finish_reason": assembler.final_reason(),
                }
            ],
            "usage": usage(
                started.prompt_tokens, assembler.completion_tokens, started.cached_tokens, assembler.reasoning_tokens
            ),
        }
    )


def _rendered_texts(chat: ChatRequest) -> list[str]:
    """Texts the chat template copies into the prompt whole: every content, but of an assistant's
    only what follows its reasoning (the template drops earlier turns' reasoning)."""
    return [m["content"].split("</think>")[-1].strip() for m in chat.messages]


def _encode_chat(engine: Engine, chat: ChatRequest) -> list[int]:
    try:
        return engine.encode_chat(chat)
    except ValueError as exc:  # malformed messages, or the template's raise_exception
        raise ApiError(
            400, f"The messages cannot be rendered: {exc}", param="messages", code="invalid_messages"
        ) from None


async def _completions(request: Request) -> Response:
    state, engine, completion = await _parse_request(request, parse_completion_request)
    prompt = completion.prompt
    if isinstance(prompt, str):
        _check_text_size(state, engine, [prompt], "prompt")
        prompt = await run_in_threadpool(engine.encode_text, prompt)
    _check_context(state, len(prompt), "prompt")
    sampling = completion.sampling
    job = _start_job(state, prompt, None, sampling)
    completion_id = new_id("cmpl")
    if completion.stream:
        writer = ChunkWriter("text_completion", completion_id, engine.model_id, completion.include_usage)
        return _EventStream(
            _stream_completion(state, job, engine, sampling, writer),
            lambda: state.scheduler.cancel(job),
            state.scheduler,
        )

    started, tokens = await _collect(request, state, job, prompt)
    reason = next((t.finish_reason for t in reversed(tokens) if t.finish_reason), None) or "stop"
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.model_id,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(t.text for t in tokens),
                    "logprobs": (
                        completion_logprobs(engine, tokens, sampling.top_logprobs, 0) if sampling.logprobs else None
                    ),
                    "finish_reason": reason,
                }
            ],
            "usage": usage(started.prompt_tokens, len(tokens), started.cached_tokens),
        }
    )


def _model_card(state: ServerState, engine: Engine) -> dict:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "lily",
        "max_model_len": state.context_length,
    }


async def _list_models(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    return JSONResponse({"object": "list", "data": [_model_card(state, engine)]})


async def _get_model(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    _check_model(state, request.path_params["model"])
    return JSONResponse(_model_card(state, engine))


async def _health(request: Request) -> Response:
    _state(request).ready_engine()
    return JSONResponse({"status": "ok"})


# Open without a key, as in vLLM and llama.cpp, so load balancers can probe it; it tells nothing
# but whether the model is ready.
_OPEN_PATHS = ("/health",)


class _ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` or `X-Api-Key: <key>` on every HTTP request but /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        supplied = headers.get(b"x-api-key", b"")
        authorization = headers.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            supplied = authorization[7:].strip()
        if hmac.compare_digest(supplied, self.api_key):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "Missing or invalid API key", type="authentication_error", code="invalid_api_key")
        await _error_response(error)(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error = ApiError(
            404, f"Unknown route {request.method} {request.url.path}", type="not_found_error", code="not_found"
        )
    elif exc.status_code == 405:
        error = ApiError(
            405, f"Method {request.method} is not allowed on {request.url.path}", code="method_not_allowed"
        )
    else:
        error = ApiError(exc.status_code, str(exc.detail))
    return _error_response(error)


def _internal_error() -> ApiError:
    return ApiError(500, "Internal server error; see the server log", type="server_error", code="internal_error")


def _guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turn a bug in a handler into a logged 500 in the error shape. (Starlette's last-resort
    handler would also answer, but then re-raises, and uvicorn drops the keep-alive connection.) A request
    that uvicorn cancels because the server exits without waiting gets the shutting-down 503."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except (ApiError, HTTPException):
            raise
        except asyncio.CancelledError:
            if not request.app.state.lily.scheduler.stopping:
                raise
            raise _shutting_down() from None
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            raise _internal_error() from None

    return guarded


async def _last_resort(request: Request, exc: Exception) -> Response:
    return _error_response(_internal_error())


def create_app(config: ServerConfig, engine: Engine | None = None) -> Starlette:
    """The ASGI app. Without `engine` it answers 503 until `app.state.lily.set_engine()` is called."""
    state = ServerState(config)
    if engine is not None:
        state.set_engine(engine)
    routes = [
        Route("/v1/chat/completions", _guarded(_chat_completions), methods=["POST"]),
        Route("/chat/completions", _guarded(_chat_completions), methods=["POST"]),
        Route("/v1/completions", _guarded(_completions), methods=["POST"]),
        Route("/completions", _guarded(_completions), methods=["POST"]),
        Route("/v1/models", _guarded(_list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guarded(_get_model), methods=["GET"]),
        Route("/health", _guarded(_health), methods=["GET"]),
    ]
    middleware = []
    if config.cors_origin:
        middleware.append(
            Middleware(
                CORSMiddleware, allow_origins=[config.cors_origin], allow_methods=["GET", "POST"], allow_headers=["*"]
            )
        )
    if config.api_key:
        middleware.append(Middleware(_ApiKeyMiddleware, api_key=config.api_key))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _last_resort},
    )
    app.state.lily = state
    return app


def uvicorn_config(app: Starlette, config: ServerConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for `app`: the connection layer of `http` with the config's limits."""
    # No lifespan task: the app has no startup or shutdown handlers, and a second Ctrl-C (uvicorn's forced exit)
    # would cancel that task and log its traceback.
    options = {"timeout_graceful_shutdown": 5, "lifespan": "off", **options}
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=make_protocol(config.header_timeout_s, config.max_connections),
        **options,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, but the first Ctrl-C / SIGTERM also ends the running generations, so
    their streams close with an error event and `[DONE]` instead of being cut after the grace period."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.lily_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.lily_state.scheduler.shutdown()
        super().handle_exit(sig, frame)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, so a bad or busy address is one clear error before anything starts."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve(
    model: Any,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    cors_origin: str | None = None,
    max_context: int | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    *,
    backend: str | None = None,
    precision: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> None:
    """Serve `model` (a `lily.Model`, an `Engine`, or a path / `lily:demo` to load) until interrupted.

    A path is loaded in the background, so `/health` answers 503 until the model is ready. Raises
    `RuntimeError` (one line) when the address cannot be used or the model fails to load.
    """
    config = ServerConfig(
        host=host,
        port=port,
        api_key=api_key,
        cors_origin=cors_origin,
        max_context=max_context,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        keepalive_s=keepalive_s,
        header_timeout_s=header_timeout_s,
        max_connections=max_connections,
    )
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model", host)
    listener = _listen(host, port)
    app = create_app(config)
    state: ServerState = app.state.lily
    server = _Server(uvicorn_config(app, config, log_level="info"), state)

    def load() -> None:
        try:
            if isinstance(model, (str, os.PathLike)):
                engine = load_engine(os.fspath(model), backend=backend, precision=precision)
            elif hasattr(model, "encode_chat") and hasattr(model, "generate"):
                engine = model
            else:
                engine = LilyEngine(model)
            state.set_engine(engine)
            log.info("model %s ready (context %d tokens)", engine.model_id, state.context_length)
        except Exception as exc:  # noqa: BLE001 - reported through /health and the exit status
            log.debug("loading the model failed", exc_info=True)
            state.load_error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.error("loading the model failed: %s", state.load_error)
            server.should_exit = True

    threading.Thread(target=load, name="lily-load", daemon=True).start()
    bound = listener.getsockname()[1]
    log.info("listening on http://%s:%d (Ctrl-C to quit)", f"[{host}]" if ":" in host else host, bound)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it handled once it has shut down: that is a clean exit.
        if not server.should_exit:
            raise
    finally:
        listener.close()
        try:
            state.scheduler.stop()  # waits for the engine's current step (up to 10 s)
        except KeyboardInterrupt:
            pass  # another Ctrl-C while waiting: exit now (the engine thread is a daemon)
    if state.load_error is not None:
        raise RuntimeError(f"model failed to load: {state.load_error}")
