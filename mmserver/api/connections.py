"""The HTTP connections: what a client may hold of the server, and aiohttp's own errors in the
server's shape.

:class:`HttpRunner` is aiohttp's application runner with these rules, each an option
(:class:`~mmserver.config.server.ServerConfig`):

- at most ``max_connections`` open connections: one past it is answered ``503`` (JSON, with
  ``Retry-After``) and closed before anything is read from it;
- ``keepalive_timeout``: an idle keep-alive connection is closed;
- ``header_timeout``: a request's headers must arrive within it once its first bytes have, or
  the connection is answered ``408`` and closed (a client trickling headers holds nothing long);
- ``body_timeout`` (in :func:`~mmserver.api.read_body`): the same for its body;
- ``send_timeout``: an answer the client does not read is dropped with its connection once the
  socket's buffer has been full that long, so the answer's memory is freed;
- a request answered before its body was read whole (a ``413``, say, or a compressed body that
  inflates past the limit) closes its connection instead of reading, and inflating, the rest;
- what aiohttp answers itself (a request that is not HTTP, too many or too long headers, a
  smuggling attempt) has the JSON error body every other error has, quotes nothing of the
  request, and is logged at debug level, with one warning line a minute counting them;
- no answer names the server's software version (aiohttp's ``Server`` header is ``mmserver``).

Pipelined requests are answered in order. A connection starts on the lean path
(:mod:`mmserver.api.lean.connection`), which answers plain inference requests itself and hands the
connection to aiohttp's handler at the first request that is anything else: garbage after valid
inference requests is then aiohttp's to refuse, once those are answered. When aiohttp parses the
packet itself, it rejects it whole, so the connection is answered ``400`` and closed and the valid
requests before the garbage are not answered (docs/security.md says so).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import Sequence
from typing import Any, cast

from aiohttp import hdrs, web, web_protocol, web_response
from aiohttp.web_request import BaseRequest

from mmserver.api import accesslog
from mmserver.api.lean.connection import LeanConnection
from mmserver.api.lean.front import LeanFront
from mmserver.api.state import REQUEST_ID, RequestIds
from mmserver.api.web import STATE, AccessLogger
from mmserver.config.server import ServerConfig
from mmserver.errors import (
    InvalidInput,
    MMServerError,
    RequestTimeout,
    ServiceUnavailable,
    djl_type,
)

log = logging.getLogger(__name__)

#: What every answer's ``Server`` header says (aiohttp's default names its version and Python's).
web_response.SERVER_SOFTWARE = "mmserver"  # type: ignore[attr-defined]

#: Descriptors kept for everything but client connections when ``max_connections`` is 0.
RESERVED_DESCRIPTORS = 256
#: An answer up to this size is written whole to the transport's buffer (its high-water mark):
#: only larger ones can wait for the client, and have ``send_timeout``.
_FITS_IN_BUFFER = 64 * 1024
#: Seconds a connection answered before its body was read stays open for the client to read
#: the answer (as a lingering close does).
_LINGER_S = 2.0
#: Seconds between the warning lines that count protocol errors.
_REPORT_EVERY_S = 60.0


def default_max_connections() -> int:
    """The file-descriptor limit (raised to its hard limit first) minus
    :data:`RESERVED_DESCRIPTORS`, at least 64."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(64, soft - RESERVED_DESCRIPTORS)


def partial_head_after(data: bytes, messages: Sequence[tuple[Any, Any]]) -> bool:
    """Whether ``data``, a read that completed the last request of ``messages`` (aiohttp's
    queue of parsed requests), ends with the beginning of another request's head.

    aiohttp's parser keeps such a beginning to itself, so it is found from the bytes: the last
    request's body (``Content-Length`` bytes, whole) follows the last blank line that leaves
    room for it, and whatever follows that body is a head begun. Nothing is found behind a
    chunked body or one still arriving (``body_timeout`` covers it), nor when a blank line
    inside the body is ambiguous: the connection then has ``keepalive_timeout``, as before.
    """
    if not messages:
        return False
    message, payload = messages[-1]
    # (A parse error queued in place of a request has no ``chunked``: its connection closes.)
    if getattr(message, "chunked", True) or not payload.is_eof():
        return False
    try:
        length = int(message.headers.get(hdrs.CONTENT_LENGTH) or 0)
    except ValueError:
        return False
    end = len(data) - length
    blank = data.rfind(b"\r\n\r\n", 0, end)
    if blank < 0:
        return False
    return bool(data[blank + 4 + length :].strip(b"\r\n"))


def _raw_error(error: MMServerError, reason: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer with ``error``'s JSON body, for a connection that is closed right
    after it (written before aiohttp has read a request)."""
    status = error.status_code
    body = json.dumps(error.to_dict()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nServer: mmserver\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Policy:
    """One server's connection rules and its counts of what they refused."""

    def __init__(self, config: ServerConfig, request_ids: RequestIds) -> None:
        #: Whether the server drains (:meth:`_Server.drain`): every answer then closes its
        #: connection.
        self.draining = False
        self.max_connections = config.max_connections or default_max_connections()
        self.header_timeout = config.header_timeout
        self.send_timeout = config.send_timeout
        self.request_ids = request_ids
        self.refused = 0
        self._errors = 0
        self._last: str = ""
        self._report_at = 0.0
        self.busy = _raw_error(
            ServiceUnavailable(
                f"the server has {self.max_connections} connections open, its limit "
                "(max_connections); retry shortly"
            ),
            "Service Unavailable",
            "Retry-After: 1\r\n",
        )
        self.slow_headers = _raw_error(
            RequestTimeout(
                f"the request's headers did not arrive within {self.header_timeout:g} s "
                "(header_timeout); the connection is closed"
            ),
            "Request Timeout",
        )

    def over_limit(self, open_connections: int) -> bool:
        """Whether a connection that makes ``open_connections`` is one too many; each refusal
        is counted, and logged at the first and every thousandth."""
        if open_connections <= self.max_connections:
            return False
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(
                "refused %d connection(s) so far: %d are open, the limit (max_connections)",
                self.refused,
                self.max_connections,
            )
        return True

    def protocol_error(self, what: str) -> None:
        """Count a malformed request; a warning line at most once a minute says how many."""
        self._errors += 1
        self._last = what
        now = time.monotonic()
        if now >= self._report_at:
            log.warning(
                "%d malformed HTTP request(s) answered 4xx and closed in the last %.0f s "
                "(the last: %s); each is logged at debug level",
                self._errors,
                _REPORT_EVERY_S,
                self._last,
            )
            self._errors = 0
            self._report_at = now + _REPORT_EVERY_S


class _Connection(web_protocol.RequestHandler):
    """aiohttp's connection handler with :class:`_Policy`'s rules."""

    def __init__(self, manager: _Server, *, handed_over: bool = False, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._policy: _Policy = manager.policy
        self._handed_over = handed_over  # by the lean path: already counted against the limit
        self._header_timer: asyncio.TimerHandle | None = None
        self._gone: asyncio.Future[None] | None = None  # set while lingering

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        if (
            not self._handed_over
            and isinstance(manager, _Server)
            and manager.refuse_past_limit(cast(asyncio.Transport, transport))
        ):
            self.force_close()

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a request's headers are complete
            self._stop_header_timer()
            if self._policy.header_timeout and partial_head_after(data, self._messages):
                self._start_header_timer()
        elif (
            data
            and self._header_timer is None
            and not self._request_in_progress
            and not self._messages
            and not self._force_close
            and self._policy.header_timeout
        ):
            self._start_header_timer()

    def _start_header_timer(self) -> None:
        self._header_timer = self._loop.call_later(
            self._policy.header_timeout, self._headers_too_slow
        )

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        transport = self.transport
        if transport is None or self._force_close:
            return
        if self._request_in_progress or self._messages:
            # The head began behind requests still being answered: its time runs again from
            # when they are (a pipelined head waits for them, a trickled one does not).
            self._start_header_timer()
            return
        log.debug("closing a connection whose request headers are late")
        cast(asyncio.WriteTransport, transport).write(self._policy.slow_headers)
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        self._stop_header_timer()
        super().connection_lost(exc)

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if request.method == hdrs.METH_CONNECT or hdrs.UPGRADE in request.headers:
            # No protocol is switched to (no WebSocket, no h2c), and aiohttp would parse the
            # bytes behind an upgrade request out of step (a body read as a request): the
            # request is answered, and the connection closed, its unread bytes dropped.
            self._message_tail = b""
            self._close = True
            resp.force_close()
        if self._policy.draining:
            resp.force_close()  # Connection: close, and closed once written
        unread = not request.content.is_eof()
        if unread:
            # Answered before its body was read whole: what more arrives is dropped unparsed
            # (never inflated), and the connection closes once the answer is out.
            self._close = True
        body = getattr(resp, "body", None)
        if not isinstance(body, bytes | bytearray) or len(body) <= _FITS_IN_BUFFER:
            resp, reset = await super().finish_response(request, resp, start_time)
        else:
            # An answer larger than the transport's buffer waits for the client to read it;
            # not for ever (the buffered answer is memory the client holds).
            try:
                async with asyncio.timeout(self._policy.send_timeout or None):
                    resp, reset = await super().finish_response(request, resp, start_time)
            except TimeoutError:
                log.info(
                    "dropped a connection whose client did not take its %d-byte answer within "
                    "%g s (send_timeout)",
                    len(body),
                    self._policy.send_timeout,
                )
                if self.transport is not None:
                    self.transport.abort()
                return resp, True
        if unread and not reset:
            await self._linger()
        return resp, reset

    async def _linger(self) -> None:
        """Give a client still sending its body time to read the answer: closing a socket with
        unread bytes would reset the connection, and the client would see no answer. The
        answer's end is signalled (half-close), and the connection closes when the client
        closes it or after :data:`_LINGER_S`; what it sends meanwhile is dropped unread."""
        transport = self.transport
        if transport is None:
            return
        gone = self._loop.create_future()
        self._gone = gone
        try:
            if transport.can_write_eof():
                transport.write_eof()
            await asyncio.wait_for(gone, _LINGER_S)
        except (TimeoutError, OSError):
            pass
        finally:
            self._gone = None

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own error answers (a request it could not parse, a handler that failed
        outside the error tree) in the server's JSON shape, without quoting the request."""
        if status >= 500:
            self.log_exception("unexpected error answering a request", exc_info=exc)
            text = "the server failed to answer this request; it has logged the cause"
            kind = djl_type(MMServerError)
        else:
            what = type(exc).__name__ if exc is not None else f"HTTP {status}"
            log.debug("malformed HTTP request from %s: %s", request.remote, exc)
            self._policy.protocol_error(what)
            text = (
                f"the request is not valid HTTP/1.1 ({what}); it was not read further and the "
                "connection is closed"
            )
            kind = djl_type(InvalidInput)
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was partly sent already; the connection is dropped")
        rid = self._policy.request_ids.next()
        text = f"{text} (request id {rid})"
        body = (
            {"error": text}
            if request.path.startswith("/v2/")
            else {
                "code": status,
                "type": kind,
                "message": text,
            }
        )
        response = web.Response(
            status=status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers={REQUEST_ID: rid},
        )
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's server, making :class:`_Connection` handlers with ``policy``; with ``lean``,
    every connection starts on the lean path (:mod:`mmserver.api.lean.connection`) and is handed to
    a
    :class:`_Connection` when a request needs aiohttp."""

    policy: _Policy
    lean: LeanFront | None

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self.lean is not None:
            return LeanConnection(self.lean)
        return _Connection(self, loop=self._loop, **self._kwargs)

    def handed_over(self) -> _Connection:
        """The aiohttp handler of a connection the lean path hands over."""
        return _Connection(self, handed_over=True, loop=self._loop, **self._kwargs)

    def refuse_past_limit(self, transport: asyncio.Transport) -> bool:
        """Whether a new connection is one past ``max_connections``: it is then answered 503,
        and its protocol closes it."""
        if not self.policy.over_limit(self.open_connections()):
            return False
        transport.write(self.policy.busy)
        return True

    def open_connections(self) -> int:
        lean = self.lean
        return len(self._connections) + (len(lean.connections) if lean is not None else 0)

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        if self.lean is not None:
            self.lean.close_all()

    def drain(self) -> None:
        """The server drains: every answer from now on closes its connection (``Connection:
        close``), and kept-alive connections left idle are closed
        (:meth:`~mmserver.api.lean.front.LeanFront.drain`)."""
        self.policy.draining = True
        if self.lean is not None:
            self.lean.drain()

    async def shutdown(self, timeout: float | None = None) -> None:
        if self.lean is None:
            await super().shutdown(timeout)
            return
        await asyncio.gather(super().shutdown(timeout), self.lean.shutdown(timeout))


class HttpRunner(web.AppRunner):
    """aiohttp's application runner with the connection rules of the module docstring; the
    options come from the application's :data:`~mmserver.api.STATE`."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        config = app[STATE].config
        kwargs.setdefault("keepalive_timeout", config.keepalive_timeout)
        # An answer sent before the body was read whole closes the connection rather than
        # reading (and inflating) the rest of the body.
        kwargs["lingering_time"] = 0
        # The access log of the requests aiohttp answers, as the lean path writes its own.
        kwargs["access_log"] = logging.getLogger(accesslog.LOGGER) if config.access_log else None
        kwargs["access_log_class"] = AccessLogger
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        state = self._app[STATE]
        server.__class__ = _Server
        assert isinstance(server, _Server)
        config = state.config
        server.policy = _Policy(config, state.request_ids)
        lean = config.lean_http and config.keepalive_timeout > 0
        server.lean = (
            LeanFront(state, server.handed_over, server.refuse_past_limit) if lean else None
        )
        return server

    def drain(self) -> None:
        """The server drains (:meth:`_Server.drain`)."""
        server = self.server
        if isinstance(server, _Server):
            server.drain()

    @property
    def policy(self) -> _Policy:
        server = self.server
        assert isinstance(server, _Server)
        return server.policy
