"""One request the lean path (:mod:`mmserver.api.lean.connection`) took, until its answer is
written: the data plane's :class:`~mmserver.api.dataplane.Exchange` with the answer written as
aiohttp's handler writes it, byte for byte (status line, ``Content-Type``, ``X-Request-Id``, the
error
headers, ``Content-Length``, ``Date``, ``Server``)."""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import TYPE_CHECKING
from typing import Protocol as Structural

from aiohttp.helpers import rfc822_formatted_time

from mmserver.api.dataplane import Exchange
from mmserver.api.middleware import render_error
from mmserver.api.protocols import JSON, Protocol
from mmserver.api.state import REQUEST_ID

if TYPE_CHECKING:
    from mmserver.api.accesslog import AccessLog
    from mmserver.api.state import ApiState
    from mmserver.errors import MMServerError

log = logging.getLogger(__name__)


class Front(Structural):
    """What an exchange reads of the lean path's front (:class:`~.front.LeanFront`)."""

    @property
    def access_log(self) -> AccessLog | None: ...


class Link(Structural):
    """What an exchange needs of the connection that took its request
    (:class:`~.connection.LeanConnection`): the server's state, the front, and the calls that
    write the answers ready in order or give the connection up."""

    @property
    def state(self) -> ApiState: ...

    @property
    def front(self) -> Front: ...

    def flush(self) -> None: ...

    def abandon(self) -> None: ...


_CONTENT_TYPE = "Content-Type"
_OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n" + REQUEST_ID.encode() + b": %s\r\n"
    b"Content-Length: %d\r\nDate: %s\r\nServer: mmserver\r\n\r\n%s"
)


def lean_answer(status: int, headers: dict[str, str], body: bytes | memoryview) -> bytes:
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


def error_answer(
    state: ApiState, shown: MMServerError, rid: str, protocol: Protocol
) -> tuple[bytes, int]:
    """The whole answer for ``shown`` to request ``rid``, as aiohttp's handler writes it, and
    the size of its body."""
    body, headers = render_error(state, shown, rid, protocol)
    headers[_CONTENT_TYPE] = JSON  # after the others, as aiohttp writes them
    return lean_answer(shown.status_code, headers, body), len(body)


#: The last ``Date`` value aiohttp made (it makes one a second) and its bytes.
_dated: tuple[str, bytes] = ("", b"")


def _date() -> bytes:
    """The ``Date`` header's value, as aiohttp writes it: encoded once a second, not once an
    answer."""
    global _dated
    text = rfc822_formatted_time()
    if text is not _dated[0]:
        _dated = (text, text.encode())
    return _dated[1]


class LeanExchange(Exchange):
    """One request taken by the lean path, until its answer is written: its answer is ``data``
    once known. Called with the submission's future when that is done."""

    __slots__ = ("conn", "data", "path")

    def __init__(self, conn: Link, protocol: Protocol, path: bytes, rid: str) -> None:
        Exchange.__init__(self, conn.state, protocol, rid)  # 50 ns less than super()'s
        self.conn = conn
        self.path = path
        self.data: bytes | None = None

    def __call__(self, answer: asyncio.Future[bytes]) -> None:
        conn = self.conn
        try:
            try:
                error = answer.exception()
            except asyncio.CancelledError:
                # The server is stopping: no answer and nothing to count, as in aiohttp's
                # handler; the answers after this one could not be written in order.
                conn.abandon()
                return
            # The error is read, not raised: a raised one would keep this frame (and the
            # exchange) in its traceback, a cycle for every refused request of a shed storm.
            if error is None:
                try:
                    self._answered(answer.result())
                except Exception as exc:
                    self.fail(exc)  # an answer that could not be written: 500, as aiohttp's
            else:
                self.fail(error)
            conn.flush()
        except Exception:
            log.exception("unexpected error answering POST %s", self.path.decode())
            conn.abandon()

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
            self.data = lean_answer(200, headers, body)
        if self.conn.front.access_log:
            self._logged(200, len(body))

    def fail(self, error: BaseException) -> None:
        """Make the error answer, log a 500 and count the failure, as the aiohttp handler does."""
        shown = self.failed(error, "POST", self.path.decode())
        self.data, size = error_answer(self.state, shown, self.rid, self.protocol)
        if self.conn.front.access_log:
            self._logged(shown.status_code, size)

    def _logged(self, status: int, size: int) -> None:
        access = self.conn.front.access_log
        assert access is not None
        access.write(
            "POST",
            self.path.decode(),
            status,
            time.perf_counter() - self.start,
            self.name,
            self.rid,
            size,
        )
