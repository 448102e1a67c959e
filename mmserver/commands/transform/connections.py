"""HTTP/1.1 exchanges of a job with a server: kept-alive connections of its own for an
``http://`` URL, an aiohttp client session for ``https://``.

For ``http://`` a connection is an :class:`asyncio.Protocol` whose answers are parsed by
httptools (llhttp, the parser the server's lean path and uvicorn use): a request is its head
and its body written at once, the answer's body is its chunks joined once. At most ``limit``
connections are open; one is reused while the server keeps it alive. Neither aiohttp nor its
TLS context is imported for it: the job's start-up and each request's work are CPU taken from
the server on the same machine.

Both raise :class:`Unreachable` when a connection cannot be made or is lost before the whole
answer came, and :class:`TimeoutError` when the answer did not come whole within ``timeout``
seconds of the request; over ``https://``, :class:`Untrusted` when the server's certificate
cannot be verified.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools

#: Seconds a new connection may take.
CONNECT_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """The server could not be connected to, or the connection was lost before the answer."""


class Untrusted(Exception):
    """The server's TLS certificate could not be verified (why: the message). Not tried
    again: the next attempt would meet the same certificate. ``unknown_issuer``: the
    certificate is self-signed, or signed by a CA not trusted here (rather than expired, or
    for another name)."""

    def __init__(self, reason: str, unknown_issuer: bool) -> None:
        super().__init__(reason)
        self.unknown_issuer = unknown_issuer


#: OpenSSL's verify results for a certificate whose issuer is not trusted: unable to get the
#: issuer's certificate (2, 20), self-signed (18, 19), unable to verify the first (21).
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})


@dataclass(frozen=True)
class Answer:
    """An answer: its status, its headers (names in lower case) and its body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Exchanges(Protocol):
    """Requests to one server."""

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """``method path`` with ``body``: the answer (``path`` below the URL's own path)."""
        ...

    async def close(self) -> None: ...


def open_exchanges(url: str, limit: int, timeout: float) -> Exchanges:
    """The exchanges with the server at ``url``, at most ``limit`` at a time."""
    if url.lower().startswith("https://"):
        return _Session(url, limit, timeout)
    return Connections(url, limit, timeout)


class _Connection(asyncio.Protocol):
    """One connection to the server; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[Answer] | None = None
        self._headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._headers_done = False
        self._delimited = False  # the answer's end is its length or its chunks, not the close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer = self._answer
        if answer is None or answer.done():
            return
        if self._headers_done and not self._delimited:  # an answer that ends with the close
            answer.set_result(self._whole())
        else:
            answer.set_exception(Unreachable(f"the connection was lost: {exc or 'closed'}"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable(f"the answer is not HTTP: {exc}"))

    # httptools' callbacks.
    def on_message_begin(self) -> None:
        self._headers, self._chunks = {}, []
        self._headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._delimited = "content-length" in self._headers or (
            "transfer-encoding" in self._headers
        )

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        answer = self._answer
        if answer is None or answer.done():
            self._fail(Unreachable("the server answered what was not asked"))
            return
        if not self._parser.should_keep_alive():
            self.close()
        answer.set_result(self._whole())

    def _whole(self) -> Answer:
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        return Answer(self._parser.get_status_code(), self._headers, body)

    def _fail(self, exc: Exception) -> None:
        self.close()
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, head: bytes, body: bytes) -> Answer:
        assert self.transport is not None and not self.closed
        self._headers_done = False  # nothing of this answer yet (the last one's state aside)
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, body))
        try:
            return await self._answer
        finally:
            self._answer = None


class Connections:
    """Kept-alive connections to an ``http://`` server, at most ``limit`` open."""

    def __init__(self, url: str, limit: int, timeout: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc
        self._timeout = timeout
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Connection] = []

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self._host_header}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        request = "\r\n".join(head).encode("latin-1")
        async with self._slots:
            connection = await self._connection()
            try:
                async with asyncio.timeout(self._timeout):
                    answer = await connection.exchange(request, body)
            except BaseException:
                connection.close()
                raise
            if not connection.closed:
                self._idle.append(connection)
            return answer

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, connection = await loop.create_connection(_Connection, self.host, self.port)
        except TimeoutError:
            raise Unreachable(f"no connection in {CONNECT_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise Unreachable(str(exc)) from None
        return connection

    async def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class _Session:
    """An aiohttp client session, for ``https://`` (imported only then)."""

    def __init__(self, url: str, limit: int, timeout: float) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.base = url.rstrip("/")
        self._session: Any = None
        self._limit = limit
        self._timeout = timeout

    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        aiohttp = self._aiohttp
        if self._session is None:
            import ssl

            # The certificates trusted are the system's, or those SSL_CERT_FILE and
            # SSL_CERT_DIR name as the job starts (aiohttp's own context read them at import).
            context = ssl.create_default_context()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit, ssl=context),
                timeout=aiohttp.ClientTimeout(total=self._timeout, sock_connect=CONNECT_TIMEOUT_S),
            )
        try:
            async with self._session.request(
                method, self.base + path, data=body, headers=headers
            ) as response:
                data = await response.read()
                found = {name.lower(): value for name, value in response.headers.items()}
                return Answer(response.status, found, data)
        except aiohttp.ClientConnectorCertificateError as exc:
            error = exc.certificate_error
            raise Untrusted(
                getattr(error, "verify_message", None) or str(error),
                getattr(error, "verify_code", None) in _UNKNOWN_ISSUER,
            ) from None
        except aiohttp.ClientError as exc:
            raise Unreachable(str(exc) or type(exc).__name__) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
