"""The lean HTTP path: plain inference requests answered without aiohttp's request machinery.

aiohttp spends most of the frontend's time on a small request: its request and response objects,
the router, the connection's task and its writer cost several times what the model path costs.
Yet almost every request a model server gets is alike: ``POST`` on an inference path (DJL's,
SageMaker's three, the Open Inference Protocol's ``/v2/models/{model}/infer``), ``HTTP/1.1``, a
``Content-Length`` body that arrives with its headers.
:class:`LeanConnection` is the protocol of every new connection. It parses with httptools (llhttp,
the parser aiohttp itself runs on; one parser per connection), takes such requests itself,
submits them through the data plane (:class:`~mmserver.api.dataplane.Exchange`) and writes each
answer when its future is done: no task, coroutine or object of aiohttp per request. Pipelined
requests are answered in order.

What llhttp refuses (a malformed request line or header, a bad or repeated ``Content-Length``,
``Content-Length`` beside ``Transfer-Encoding``, a bare ``LF``) and everything the lean path does
not answer itself hands the connection to aiohttp (:mod:`mmserver.api.connections`) from that
request's first byte, once the answers before it are written. The lean path's own rules, each
one about what it takes (not about what is valid HTTP):

- ``POST`` over ``HTTP/1.1`` on a path of :func:`~mmserver.api.protocols.match_lean` (an
  inference path, or ``InvokeEndpointAsync``'s: :mod:`mmserver.api.lean.asynchronous`) spelled in
  unreserved characters (no query, percent-encoding or dot segment: aiohttp normalizes those
  first);
- a ``Host`` and a ``Content-Length`` within ``max_request_size``, no header repeated (aiohttp
  refuses some repeats and joins others), every value plain ASCII;
- no ``Transfer-Encoding``, ``Content-Encoding``, ``Expect``, ``Upgrade`` or ``Connection`` other
  than ``keep-alive`` (aiohttp decodes, continues, refuses or closes);
- within aiohttp's limits: a head of at most 8,190 bytes and fewer than 128 fields;
- whole in the read that brought it (behind pipelined requests: in the next read, and within
  about a second).

aiohttp then serves that request and every later one on the connection as it would have from
the start, with all its rules. So the lean path takes only what it can answer exactly as
aiohttp's handler would; what it does not take is never half read: the bytes of a request llhttp
has parsed are kept until the request is taken.

Its answers are the aiohttp handler's (:mod:`mmserver.api.inference`): the same status, body and
headers (``Content-Type``, ``X-Request-Id``, ``x-amzn-ErrorType``, ``Retry-After``, ``Date``,
``Server``) and the same metrics. The connection rules hold too: lean connections count against
``max_connections``; one idle for ``keepalive_timeout`` is closed (looked at every second);
reading stops while the socket's send buffer is full, and an answer the client does not take
within ``send_timeout`` is dropped with the connection (:mod:`mmserver.api.lean.flow`). The
answers are written by :mod:`mmserver.api.lean.answer`, with their access log records when
``access_log`` is on (:mod:`mmserver.api.accesslog`); on a server with traces, a request's
``traceparent`` is read as aiohttp's handler reads it (:mod:`mmserver.ops.otel`). ``lean_http =
false`` leaves every request to aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import time
from typing import cast

import httptools

from mmserver.api.lean.answer import LeanExchange
from mmserver.api.lean.asynchronous import LeanAsyncExchange
from mmserver.api.lean.flow import LeanFlow
from mmserver.api.lean.front import LeanFront
from mmserver.api.protocols import INVOKE_ASYNC, ROUTING_KEY, Route
from mmserver.ops.traces import TRACEPARENT, TRACESTATE, http_door
from mmserver.tenancy.gate import THROTTLE_HOLD_S, Throttled

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
        # Routed by its value among a model's versions (aiohttp's handler reads it).
        ROUTING_KEY.lower().encode(),
    }
)
#: Answers a connection may owe (pipelined requests): past them, reading waits for half of them.
_MAX_OWED = 128
#: What :meth:`LeanConnection._take` returns for a request left to aiohttp, and for one whose
#: head is taken but whose body has not all arrived.
_HAND = -1
_BODY_TO_COME = -2


def _text(value: bytes) -> str:
    """A header's value as aiohttp reads it (without the white space llhttp leaves at its end;
    ASCII: the lean path takes no other)."""
    return value.rstrip(b" \t").decode("ascii")


#: The ``traceparent`` field's name, as the fields hold it.
_TRACEPARENT = TRACEPARENT.encode()


@functools.cache
def _field_name(name: str) -> bytes:
    """A header's name as the fields hold it (lower case), made once per name."""
    return name.lower().encode()


def _may_start_lean(start: bytes) -> bool:
    """Whether ``start``, a head not yet whole, may begin a request the lean path takes."""
    return b"\r\n\r\n" not in start and start[:6] == b"POST /"[: len(start)]


class LeanConnection(asyncio.Protocol):
    """One client connection while the lean path serves it (see the module docstring).

    httptools calls its ``on_*`` methods while :meth:`_take` feeds it one request's head, then
    that request's body: the bytes fed are always whole parts of one request, so where a request
    starts is known, and a request left to aiohttp is handed over from its first byte."""

    def __init__(self, front: LeanFront) -> None:
        self.front = front
        self.state = front.state
        self.transport: asyncio.Transport | None = None
        self.flow: LeanFlow | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._answers: collections.deque[LeanExchange | LeanAsyncExchange] = collections.deque()
        #: Bytes kept for aiohttp while the answers before them are written (None: serving).
        self._held: bytes | None = None
        self._closing = False  # write the answers owed, then close
        #: Whether an answer was written: a kept-alive connection, not one whose first
        #: request may still be on its way.
        self.answered = False
        #: Bytes received and not taken yet: requests that came while :data:`_MAX_OWED`
        #: answers were owed, or the start of a request the next read completes.
        self._unread = b""
        self._unread_since = 0.0
        self._lost: asyncio.Future[None] | None = None
        self.idle_since = time.monotonic()
        # The request being parsed: what httptools reported of it.
        self._url = b""
        self._fields: dict[bytes, bytes] = {}
        self._repeated = False  # a header came more than once
        self._head_done = False
        self._complete = False
        #: Where the body of a request whose head was fed starts, from that request's first
        #: byte (0: no such request).
        self._body_at = 0
        self._length = 0
        #: The lean route of the request whose head was fed, with its placeholders' values.
        self._route: tuple[Route, dict[str, str]] | None = None
        #: While set, a tenant's 429 is held and nothing more is read (:meth:`_hold`).
        self._cooling: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)
        self.flow = LeanFlow(tcp, self.front.send_timeout)
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
        if self._cooling is not None:
            self._cooling.cancel()
            self._cooling = None
        self.front.connections.discard(self)
        if self.flow is not None:
            self.flow.stop()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        assert self.flow is not None
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        assert self.flow is not None
        self.flow.resume_writing()
        if (self._held is not None or self._closing) and not self._answers:
            self._answers_written()
        else:
            self._read_on()

    def _read_on(self) -> None:
        """Read again (and take what was left unread) when nothing holds the connection back:
        a full send buffer, too many answers owed, a hand-over or a close under way."""
        flow = self.flow
        if (
            self.transport is None
            or flow is None
            or not flow.read_paused
            or flow.write_paused
            or self._held is not None
            or self._closing
            or self._cooling is not None
            or len(self._answers) > _MAX_OWED // 2
        ):
            return
        flow.resume_reading()
        if self._unread:
            self._parse(b"", False)

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        fields = self._fields
        if key in fields:
            self._repeated = True
        fields[key] = value

    def on_headers_complete(self) -> None:
        self._head_done = True

    def on_message_complete(self) -> None:
        self._complete = True

    # -- requests ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._held is not None:
            self._held += data
        elif not self._closing:
            self._parse(data, True)  # positional: a call with a keyword is not specialized

    def _parse(self, data: bytes, fresh: bool) -> None:
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
        with memoryview(data) as view:  # httptools is fed slices of it, not copies
            while pos < size:
                if len(self._answers) >= _MAX_OWED or self._cooling is not None:
                    self._unread = data[pos:]
                    assert self.flow is not None
                    self.flow.pause_reading()
                    return
                taken = self._take(data, view, pos)
                if taken <= 0:
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

    def _take(self, data: bytes, view: memoryview, pos: int) -> int:
        """Serve the request that starts at ``pos`` if it is the lean path's: where the next
        request starts; 0 when its head has not all arrived; :data:`_HAND` to leave it (and
        what follows) to aiohttp; :data:`_BODY_TO_COME` when it is the lean path's but its
        body has not all arrived (its head is parsed: :attr:`_body_at` says so)."""
        body_at = self._body_at
        if body_at:
            body_start = pos + body_at
        else:
            end = data.find(b"\r\n\r\n", pos, pos + _MAX_HEAD)
            if end < 0:
                return 0
            body_start = end + 4
            if not self._head(data, view[pos:body_start], pos):
                return _HAND
        body_end = body_start + self._length
        if body_end > len(data):
            self._body_at = body_start - pos
            return _BODY_TO_COME
        self._body_at = 0
        if body_end > body_start:
            try:
                self._parser.feed_data(view[body_start:body_end])
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                return _HAND
        if not self._complete:
            return _HAND
        fields = self._fields
        assert self._route is not None
        route, params = self._route
        if route.operation == INVOKE_ASYNC:
            self._serve_async(params["endpoint"], data[body_start:body_end], fields)
            return body_end
        self._serve(
            route,
            params,
            fields.get(b"x-amzn-sagemaker-target-model"),
            data[body_start:body_end],
            fields.get(b"content-type"),
            fields.get(b"accept"),
            fields.get(route.protocol.lean_field),
            fields.get(b"x-request-id"),
        )
        return body_end

    def _head(self, data: bytes, head: memoryview, pos: int) -> bool:
        """Feed httptools one request's head (``head``, at ``pos`` in ``data``: its request
        line to its blank line): whether the request is the lean path's (see the module
        docstring)."""
        fields: dict[bytes, bytes] = {}
        self._fields = fields
        self._repeated = self._head_done = self._complete = False
        try:
            self._parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False
        url = self._url
        if (
            not self._head_done
            or self._repeated
            or len(fields) >= _MAX_FIELDS
            # The request line llhttp accepted, spelled exactly so (the parser's getters cost
            # more than these two comparisons): POST, then HTTP/1.1 after the target.
            or not data.startswith(b"POST ", pos)
            or not data.startswith(b" HTTP/1.1\r\n", pos + 5 + len(url))
            or not head.tobytes().isascii()
            or b"host" not in fields
            or not _NOT_LEAN.isdisjoint(fields)
        ):
            return False
        connection = fields.get(b"connection")
        if connection is not None and connection.strip(b" \t").lower() != b"keep-alive":
            return False
        length = fields.get(b"content-length")
        if length is None:
            return False
        self._length = size = int(length)
        front = self.front
        limit = front.max_request_size
        if limit and size > limit:
            return False
        route = front.route(url)
        if route is None:
            return False  # not a lean route: aiohttp answers it (or 404)
        self._route = route
        return True

    def _serve(
        self,
        route: Route,
        params: dict[str, str],
        target: bytes | None,
        body: bytes,
        content_type: bytes | None,
        accept: bytes | None,
        header_length: bytes | None,
        rid: bytes | None,
    ) -> None:
        self.front.taken += 1
        exchange = LeanExchange(
            self,
            route.protocol,
            self._url,
            self.state.request_ids.next() if rid is None else _text(rid),
        )
        self._answers.append(exchange)
        tracing = self.state.tracing
        if tracing is not None:
            parent = self._fields.get(_TRACEPARENT)
            exchange.sample(
                tracing,
                http_door(route.method, route.path),
                None if parent is None else _text(parent),
                None if parent is None else self._header(TRACESTATE),
            )
        transport = self.transport
        assert transport is not None
        try:
            name = route.model_name(params, None if target is None else _text(target), None)
            if self.front.tenants:
                exchange.authenticate("POST", self._url, self._header, body)
            answer = exchange.submit(
                name,
                body,
                None if content_type is None else _text(content_type),
                None if accept is None else _text(accept),
                None if header_length is None else _text(header_length),
                transport.is_closing,
            )
        except Exception as exc:
            exchange.fail(exc)
            if isinstance(exc, Throttled):
                self._hold(exchange)
            self.flush()
            return
        answer.add_done_callback(exchange)

    def _hold(self, exchange: LeanExchange) -> None:
        """Hold ``exchange``'s answer, a tenant's 429, for :data:`THROTTLE_HOLD_S`, and read
        nothing more meanwhile (see :mod:`mmserver.tenancy.gate`)."""
        flow = self.flow
        assert flow is not None
        answer, exchange.data = exchange.data, None
        assert answer is not None  # made by fail()
        flow.pause_reading()
        self._cooling = asyncio.get_running_loop().call_later(
            THROTTLE_HOLD_S, self._held_answer, exchange, answer
        )

    def _held_answer(self, exchange: LeanExchange, answer: bytes) -> None:
        self._cooling = None
        exchange.data = answer
        self.flush()
        self._read_on()

    def _header(self, name: str) -> str | None:
        """The value of the request's header ``name`` (lower case)."""
        value = self._fields.get(_field_name(name))
        return None if value is None else _text(value)

    def _serve_async(self, endpoint: str, body: bytes, fields: dict[bytes, bytes]) -> None:
        front = self.front
        front.taken += 1
        rid = fields.get(b"x-request-id")
        exchange = LeanAsyncExchange(
            self, self._url, self.state.request_ids.next() if rid is None else _text(rid)
        )
        self._answers.append(exchange)
        runner = self.state.asynchronous
        assert runner is not None  # the route is taken only then (LeanFront.route)

        def header(name: str) -> str | None:
            value = fields.get(_field_name(name))
            return None if value is None else _text(value)

        try:
            exchange.accept(runner, endpoint, body, header)
        except Exception as exc:
            exchange.fail(exc)
            self.flush()

    # -- answers ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the answers that are ready, in the order of their requests."""
        answers = self._answers
        ready: list[bytes] = []
        while answers and (data := answers[0].data) is not None:
            answers.popleft()
            ready.append(data)
        if not ready:
            return
        if self.front.draining and not self._closing:
            self.close_after_answers()  # the server drains: clients go elsewhere
        if self._closing and not answers:
            # The last answer before the connection closes says so.
            ready[-1] = ready[-1].replace(b"\r\n", b"\r\nConnection: close\r\n", 1)
        transport = self.transport
        if transport is not None:
            transport.write(ready[0] if len(ready) == 1 else b"".join(ready))
            self.answered = True
        if not answers:
            self.idle_since = time.monotonic()
            if self._held is not None or self._closing:
                self._answers_written()
                return
        flow = self.flow
        if flow is not None and flow.read_paused:
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
        flow = self.flow
        assert flow is not None
        flow.pause_reading()
        if not self._answers and not flow.write_paused:
            self._answers_written()

    def _answers_written(self) -> None:
        transport = self.transport
        flow = self.flow
        if transport is None or flow is None or flow.write_paused:
            return
        if self._closing:
            transport.close()
            return
        held = self._held
        if held is None:
            return
        self._held = None
        self.transport = None
        flow.stop()
        self.front.connections.discard(self)
        self.front.handed_over += 1
        handler = self.front.hand_off()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        flow.resume_reading()
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
        self.close_after_answers()
        if not self._answers and self.transport is not None:
            self.transport.close()

    def close_after_answers(self) -> None:
        """Take no more requests: the last answer owed says ``Connection: close``, and the
        connection closes once it is written."""
        self._closing = True
        self._held = None

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
