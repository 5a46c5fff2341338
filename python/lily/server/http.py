"""The HTTP connection layer of `lily.server`: uvicorn's h11 protocol with the limits it lacks.

uvicorn bounds a request's header size (h11) and closes idle keep-alive connections, but a client
that sends half a header is kept forever, any number of connections is accepted, and the errors
it answers itself are plain text. This protocol adds:

* a header timeout: a connection that has not sent a complete request head within
  `header_timeout_s` of connecting (or of its previous response) gets 408 and is closed;
* a connection bound: beyond `max_connections` open connections a new one gets 503 with
  `Retry-After` and is closed at once;
* JSON bodies, in the server's error shape, for those answers and for the 400 uvicorn sends on a
  request h11 cannot parse (malformed request line, bad Content-Length, a head over 16 KB).

What cannot be answered in JSON (the peer closed, TLS garbage before any HTTP) is listed in
docs/server.md.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
RETRY_AFTER_S = 1
# After a refusal, what the client still sends is read and dropped this long before closing: closing
# a socket with unread input sends a reset, which can destroy the answer before the client reads it.
_LINGER_S = 1.0

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def error_bytes(status: int, message: str, code: str, *, kind: str = "invalid_request_error",
                extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A whole HTTP/1.1 error response, JSON body and `Connection: close`, for use outside h11."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status]), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    head += [name + b": " + value for name, value in extra_headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def make_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """An `H11Protocol` subclass with these limits, to pass as uvicorn's `http=`."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")

    class LilyH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(error_bytes(
                    503, f"Server is busy: {max_connections} connections are open", "too_many_connections",
                    kind="unavailable_error", extra_headers=((b"retry-after", b"%d" % RETRY_AFTER_S),)))
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's head must arrive in time too

        def send_400_response(self, msg: str) -> None:
            self._disarm_header_timer()
            self._refuse(error_bytes(
                400, "Invalid HTTP request: malformed request line or header, invalid Content-Length, "
                "or a request head over the size limit", "invalid_http_request"))

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._waiting_for_head():
                return
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                self.transport.close()  # an idle keep-alive connection: nothing to answer
                return
            self._refuse(error_bytes(
                408, f"Request head not received within {header_timeout_s:g} s", "request_timeout"))

        def _refuse(self, response: bytes) -> None:
            # Written past h11, which cannot answer a request it has not (fully) received; then
            # half-closed, and closed once the client hangs up or after _LINGER_S.
            self._refused = True
            self._disarm_header_timer()
            self.transport.write(response)
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(_LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return LilyH11Protocol
