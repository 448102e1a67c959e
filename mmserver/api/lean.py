"""The lean HTTP path: plain inference requests answered without aiohttp's request machinery.

aiohttp spends most of the frontend's time on a small request: its request and response objects,
the router, the connection's task and its writer cost several times what the model path costs.
Yet almost every request a model server gets is alike: ``POST`` on an inference path (DJL's,
SageMaker's three, the Open Inference Protocol's ``/v2/models/{model}/infer``), ``HTTP/1.1``, a
``Content-Length`` body that arrives with its headers.
:class:`LeanConnection` is the protocol of every new connection. It takes such requests itself
(a strict subset of HTTP/1.1, checked by one regular expression), submits them to the
WorkLoadManager and writes each answer when its future is done: no task, coroutine or object of
aiohttp per request. Pipelined requests are answered in order.

Anything else hands the connection to aiohttp (:mod:`mmserver.api.connections`) from that
request's first byte, once the answers before it are written: another path or method, a query
string or a percent-encoded name, ``HTTP/1.0``, a chunked or compressed body, ``Expect``,
``Upgrade``, ``Connection: close``, no ``Host`` or a repeated header, a header that is not plain
ASCII, a body over ``max_request_size``, a request that is not whole in the read that brought it
(behind pipelined requests: in the next read, and within about a second). aiohttp then serves
that request and every later one on the connection as it would have from the start, with all its
rules. So the lean path takes only what it can answer exactly as aiohttp's handler would; what
it does not take is never half read.

Its answers are the aiohttp handler's (:mod:`mmserver.api.inference`): the same status, body and
headers (``Content-Type``, ``X-Request-Id``, ``x-amzn-ErrorType``, ``Retry-After``, ``Date``,
``Server``) and the same metrics. The connection rules hold too: lean connections count against
``max_connections``; one idle for ``keepalive_timeout`` is closed (looked at every second);
reading stops while the socket's send buffer is full, and an answer the client does not take
within ``send_timeout`` is dropped with the connection. ``lean_http = false`` (or
``access_log``, which aiohttp writes) leaves every request to aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

from aiohttp.helpers import rfc822_formatted_time

from mmserver.api import REQUEST_ID, ApiState
from mmserver.api.dataplane import Exchange
from mmserver.api.middleware import render_error
from mmserver.api.protocols import JSON, Protocol, Route, match_inference

log = logging.getLogger(__name__)

_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
#: A request the lean path may take, from its first byte to the ``CRLF`` ending its last header:
#: ``POST``, a path of unreserved characters only (no query, no percent-encoding), HTTP/1.1, and
#: header lines of a token, a colon and printable ASCII.
_HEAD = re.compile(
    rb"POST (/[A-Za-z0-9._~/-]*) HTTP/1\.1\r\n((?:" + _TOKEN + rb":[\t\x20-\x7e]*\r\n)*)"
)
#: One header field (its value stripped in Python: a lazy match before optional white space
#: would take time quadratic in a value's spaces).
_FIELD = re.compile(rb"(" + _TOKEN + rb"):([\t\x20-\x7e]*)\r\n")
#: aiohttp's longest request line or header field: a head past it is aiohttp's to refuse.
_MAX_HEAD = 8190
#: aiohttp's most header fields: a request with as many is aiohttp's to refuse.
_MAX_FIELDS = 128
#: Headers whose presence leaves the request to aiohttp.
_NOT_LEAN = frozenset(
    {
        b"transfer-encoding",
        b"content-encoding",
        b"expect",
        b"upgrade",
        b"proxy-connection",
        b"sec-websocket-key1",
    }
)
_CONTENT_TYPE = "Content-Type"
_OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n" + REQUEST_ID.encode() + b": %s\r\n"
    b"Content-Length: %d\r\nDate: %s\r\nServer: mmserver\r\n\r\n%s"
)
#: Answers a connection may owe (pipelined requests): past them, reading waits for half of them.
_MAX_OWED = 128
_BODY_TO_COME = -2
#: Seconds between looks at the lean connections' idle time.
_SWEEP_S = 1.0


def _answer(status: int, headers: dict[str, str], body: bytes) -> bytes:
    """A whole answer: status line, headers, ``Content-Length``, ``Date``, ``Server``, body."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""  # 499, say: aiohttp writes none either
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    lines.append(f"Content-Length: {len(body)}\r\n")
    head = "\r\n".join(lines).encode()
    return b"%sDate: %s\r\nServer: mmserver\r\n\r\n%s" % (head, _date(), body)


def _date() -> bytes:
    """The ``Date`` header's value, as aiohttp writes it (made again once a second)."""
    return rfc822_formatted_time().encode()


def _may_start_lean(start: bytes) -> bool:
    """Whether ``start``, a head not yet whole, may begin a request the lean path takes."""
    return b"\r\n\r\n" not in start and start[:6] == b"POST /"[: len(start)]


class _Exchange(Exchange):
    """One request taken by the lean path, until its answer is written: its answer is ``data``
    once known. Called with the submission's future when that is done."""

    __slots__ = ("conn", "data", "path")

    def __init__(self, conn: LeanConnection, protocol: Protocol, path: bytes, rid: str) -> None:
        super().__init__(conn.state, protocol, rid)
        self.conn = conn
        self.path = path
        self.data: bytes | None = None

    def __call__(self, answer: asyncio.Future[bytes]) -> None:
        try:
            self._settle(answer)
        except Exception:
            log.exception("unexpected error answering POST %s", self.path.decode())
            self.conn.abandon()

    def _settle(self, answer: asyncio.Future[bytes]) -> None:
        conn = self.conn
        if answer.cancelled():
            # The server is stopping: no answer and nothing to count, as in aiohttp's handler;
            # the answers after this one could not be written in order.
            conn.abandon()
            return
        error = answer.exception()
        if error is None:
            try:
                self._answered(answer.result())
            except Exception as exc:
                self.fail(exc)  # an answer that could not be written: 500, as aiohttp's
        else:
            self.fail(error)
        conn.flush()

    def _answered(self, answer: bytes) -> None:
        body, content_type, extra = self.answered(answer)
        if extra is None:
            self.data = _OK % (
                content_type.encode("latin-1"),
                self.rid.encode(),
                len(body),
                _date(),
                body,
            )
        else:
            headers = {_CONTENT_TYPE: content_type, **extra, REQUEST_ID: self.rid}
            self.data = _answer(200, headers, body)

    def fail(self, error: BaseException) -> None:
        """Make the error answer, log a 500 and count the failure, as the aiohttp handler does."""
        shown = self.failed(error, "POST", self.path.decode())
        body, headers = render_error(self.state, shown, self.rid, self.protocol)
        headers[_CONTENT_TYPE] = JSON  # after the others, as aiohttp writes them
        self.data = _answer(shown.status_code, headers, body)


class LeanConnection(asyncio.Protocol):
    """One client connection while the lean path serves it (see the module docstring)."""

    def __init__(self, front: LeanFront) -> None:
        self.front = front
        self.state = front.state
        self.transport: asyncio.Transport | None = None
        self._answers: collections.deque[_Exchange] = collections.deque()
        #: Bytes kept for aiohttp while the answers before them are written (None: serving).
        self._held: bytes | None = None
        self._closing = False  # write the answers owed, then close
        self._write_paused = False
        #: Bytes received and not parsed yet: requests that came while :data:`_MAX_OWED`
        #: answers were owed, or the start of a request the next read completes.
        self._unread = b""
        self._unread_since = 0.0
        self._reading_paused = False
        self._send_timer: asyncio.TimerHandle | None = None
        self._lost: asyncio.Future[None] | None = None
        self.idle_since = time.monotonic()

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)
        sock = tcp.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # as aiohttp's
        front = self.front
        front.add(self)
        if front.refuse_past_limit(tcp):
            self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.front.connections.discard(self)
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()
        timeout = self.front.send_timeout
        if timeout and self._send_timer is None:
            self._send_timer = asyncio.get_running_loop().call_later(timeout, self._send_stalled)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if (self._held is not None or self._closing) and not self._answers:
            self._answers_written()
        else:
            self._read_on()

    def _pause_reading(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def _read_on(self) -> None:
        """Read again (and parse what was left unread) when nothing holds the connection back:
        a full send buffer, too many answers owed, a hand-over or a close under way."""
        transport = self.transport
        if (
            transport is None
            or not self._reading_paused
            or self._write_paused
            or self._held is not None
            or self._closing
            or len(self._answers) > _MAX_OWED // 2
        ):
            return
        self._reading_paused = False
        transport.resume_reading()
        if self._unread:
            self._parse(b"", fresh=False)

    def _send_stalled(self) -> None:
        self._send_timer = None
        log.info(
            "dropped a connection whose client did not take its answers within %g s (send_timeout)",
            self.front.send_timeout,
        )
        if self.transport is not None:
            self.transport.abort()

    # -- requests ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._held is not None:
            self._held += data
        elif not self._closing:
            self._parse(data, fresh=True)

    def _parse(self, data: bytes, *, fresh: bool) -> None:
        """Take the whole requests in what is unread and ``data``. What is left is kept for the
        next read if requests were taken before it (a pipelined stream cut by the read), and
        handed to aiohttp if not: a read (``fresh``) that completed nothing is a request that
        spans reads, and aiohttp's header and body timeouts are for it."""
        if self._unread:
            data = self._unread + data
            self._unread = b""
        pos = 0
        size = len(data)
        taken = 0
        while pos < size:
            if len(self._answers) >= _MAX_OWED:
                self._unread = data[pos:]
                self._pause_reading()
                return
            end = data.find(b"\r\n\r\n", pos, pos + _MAX_HEAD)
            if end < 0:
                break
            head = _HEAD.fullmatch(data, pos, end + 2)
            if head is None:
                break
            taken = self._take(data, head, end + 4)
            if taken < 0:
                break
            pos = taken
        if pos == size:
            return
        rest = data[pos:] if pos else data
        if (pos or not fresh) and (
            taken == _BODY_TO_COME or (len(rest) < _MAX_HEAD and _may_start_lean(rest))
        ):
            self._unread = rest
            self._unread_since = time.monotonic()
        else:
            self._hand_off(rest)

    def _take(self, data: bytes, head: re.Match[bytes], body_start: int) -> int:
        """Serve the request ``head`` matched, if it is the lean path's: where the next request
        starts; -1 to leave it (and what follows) to aiohttp; :data:`_BODY_TO_COME` when it is
        the lean path's but its body has not all arrived."""
        length = -1
        content_type = accept = rid = target = header_length = None
        fields = _FIELD.findall(data, head.start(2), head.end(2))
        if len(fields) >= _MAX_FIELDS:
            return -1
        seen: set[bytes] = set()
        for field, raw in fields:
            key = field.lower()
            if key in seen:
                return -1  # aiohttp refuses some repeated fields and joins others
            seen.add(key)
            value = raw.strip(b" \t")
            if key == b"content-length":
                if len(value) > 18 or not value.isdigit():
                    return -1
                length = int(value)
            elif key == b"content-type":
                content_type = value
            elif key == b"accept":
                accept = value
            elif key == b"x-request-id":
                rid = value
            elif key == b"x-amzn-sagemaker-target-model":
                target = value
            elif key == b"inference-header-content-length":
                header_length = value
            elif key == b"connection":
                if value.lower() != b"keep-alive":
                    return -1
            elif key in _NOT_LEAN:
                return -1
        if b"host" not in seen:
            return -1  # aiohttp refuses an HTTP/1.1 request without one
        limit = self.front.max_request_size
        if length < 0 or (limit and length > limit):
            return -1
        body_end = body_start + length
        if body_end > len(data):
            return _BODY_TO_COME
        path = head.group(1)
        if b"/." in path:
            return -1  # dot segments: aiohttp normalizes the path first
        matched = match_inference(path.decode())
        if matched is None:
            return -1  # not a lean route: aiohttp answers it (or 404)
        route, params = matched
        self._serve(
            route,
            params,
            target,
            path,
            data[body_start:body_end],
            None if content_type is None else content_type.decode(),
            None if accept is None else accept.decode(),
            None if header_length is None else header_length.decode(),
            self.state.request_ids.next() if rid is None else rid.decode(),
        )
        return body_end

    def _serve(
        self,
        route: Route,
        params: dict[str, str],
        target: bytes | None,
        path: bytes,
        body: bytes,
        content_type: str | None,
        accept: str | None,
        header_length: str | None,
        rid: str,
    ) -> None:
        self.front.taken += 1
        exchange = _Exchange(self, route.protocol, path, rid)
        self._answers.append(exchange)
        transport = self.transport
        assert transport is not None
        try:
            name = route.model_name(params, None if target is None else target.decode(), None)
            answer = exchange.submit(
                name, body, content_type, accept, header_length, transport.is_closing
            )
        except Exception as exc:
            exchange.fail(exc)
            self.flush()
            return
        answer.add_done_callback(exchange)

    # -- answers ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the answers that are ready, in the order of their requests."""
        answers = self._answers
        if not answers or answers[0].data is None:
            return
        ready = [cast(bytes, answers.popleft().data)]
        while answers and answers[0].data is not None:
            ready.append(cast(bytes, answers.popleft().data))
        transport = self.transport
        if transport is not None:
            transport.write(ready[0] if len(ready) == 1 else b"".join(ready))
        if not answers:
            self.idle_since = time.monotonic()
            if self._held is not None or self._closing:
                self._answers_written()
                return
        if self._reading_paused:
            self._read_on()

    def abandon(self) -> None:
        """Close the connection without the answers still owed (one of them has none)."""
        self._answers.clear()
        self._held = None
        self._unread = b""
        self._closing = True
        if self.transport is not None:
            self.transport.close()

    def _hand_off(self, rest: bytes) -> None:
        """Leave ``rest`` (a request's first bytes on) and the connection to aiohttp, once the
        answers owed are written."""
        self._held = rest
        self._pause_reading()
        if not self._answers and not self._write_paused:
            self._answers_written()

    def _answers_written(self) -> None:
        transport = self.transport
        if transport is None or self._write_paused:
            return
        if self._closing:
            transport.close()
            return
        held = self._held
        if held is None:
            return
        self._held = None
        self.transport = None
        self.front.connections.discard(self)
        self.front.handed_over += 1
        handler = self.front.hand_off()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        self._reading_paused = False
        transport.resume_reading()
        if held:
            handler.data_received(held)

    @property
    def idle(self) -> bool:
        """Whether no request is being answered, received or handed on."""
        return not self._answers and self._held is None and not self._unread

    def hand_off_stalled(self, since: float) -> None:
        """Hand to aiohttp a request begun before ``since`` whose end has not come (aiohttp's
        header and body timeouts then apply to it)."""
        if self._unread and not self._answers and self._unread_since < since:
            rest, self._unread = self._unread, b""
            self._hand_off(rest)

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Take no more requests; close once the answers owed are written."""
        self._closing = True
        self._held = None
        if not self._answers and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None) -> None:
        """:meth:`close`, and wait for the connection to end (aborted after ``timeout``)."""
        self.close()
        transport = self.transport
        if transport is None:
            return
        self._lost = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._lost, timeout)
        except TimeoutError:
            transport.abort()


class LeanFront:
    """The lean connections of one server: made by the listener, counted, swept when idle."""

    def __init__(
        self,
        state: ApiState,
        hand_off: Callable[[], asyncio.Protocol],
        refuse_past_limit: Callable[[asyncio.Transport], bool],
    ) -> None:
        config = state.config
        self.state = state
        self.hand_off = hand_off
        self.refuse_past_limit = refuse_past_limit
        self.max_request_size = config.max_request_size
        self.keepalive_timeout = config.keepalive_timeout
        self.send_timeout = config.send_timeout
        self.connections: set[LeanConnection] = set()
        #: Connections handed to aiohttp so far.
        self.handed_over = 0
        #: Requests the lean path took so far.
        self.taken = 0
        self._sweeper: asyncio.TimerHandle | None = None

    def connection(self) -> LeanConnection:
        """The protocol of a new connection."""
        return LeanConnection(self)

    def add(self, conn: LeanConnection) -> None:
        """Count a connection made, and look at the connections' idle time while there are any."""
        self.connections.add(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_timeout``."""
        self._sweeper = None
        now = time.monotonic()
        oldest = now - self.keepalive_timeout
        stalled = now - _SWEEP_S
        for conn in list(self.connections):
            if conn.idle_since < oldest and conn.idle:
                conn.close()
            else:
                conn.hand_off_stalled(stalled)
        if self.connections:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def close_all(self) -> None:
        for conn in list(self.connections):
            conn.close()

    async def shutdown(self, timeout: float | None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await asyncio.gather(*(conn.shutdown(timeout) for conn in list(self.connections)))
