"""Closed-loop users on kept-alive HTTP/1.1 connections, from one asyncio loop: the load of
:mod:`~mmserver.commands.loadtest.pyload` (wrk's runs where wrk is not installed) and of the
tools under ``scripts/`` (the routing experiment, the soak and chaos runs, the benchmark's cold
loads, its loading of every model and its asynchronous requests).

Each user holds one connection and sends its next request once the previous answer has been
read; with a :class:`Schedule` (open loop) the users take send slots ``1 / rate`` apart instead.
A request is timed from its write to the end of its answer, as wrk times it. What a run sends
and what it keeps are the caller's: ``next_request`` gives a user its next request (``None``:
that user is done) with a tag of the caller's, and ``answered`` sees each request's tag and
:class:`Outcome` as soon as it is known, on the loop's thread.

Every run is bounded in time (``duration_s``: no request is sent after it; those in flight
then end within ``timeout_s``) and in count (``max_requests`` in all), and :func:`closed_loop`
sends only to this machine's loopback addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

TIMEOUT_S = 5.0
#: What a user waits after a refused connection before it tries again.
RECONNECT_S = 0.01
#: Connection errors, as wrk names them.
CONNECT, READ, TIMEOUT = "connect", "read", "timeout"


@dataclass(frozen=True)
class Outcome:
    """What one request got. Times are ``time.perf_counter()``."""

    sent: float  # when it was written (when its connection failed: then)
    answered: float  # when its answer was read whole (or the request failed)
    status: int  # 0: no answer
    error: str = ""  # "" when answered; else CONNECT, READ or TIMEOUT
    size: int = 0  # bytes of the answer: head, framing and body
    head: bytes = b""
    body: bytes = b""

    @property
    def seconds(self) -> float:
        return self.answered - self.sent

    def header(self, name: str) -> str:
        """The value of the answer's header ``name`` ("" when it has none)."""
        wanted = name.lower()
        for line in self.head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == wanted:
                return value.strip()
        return ""


@dataclass
class Schedule:
    """Send slots ``1 / rate`` apart, handed to whichever user asks next; a send more than 1 ms
    after its slot counts as late (as ``load.lua`` counts it)."""

    rate: float
    sent: int = 0
    late: int = 0
    max_lag_us: float = 0.0
    _next_slot: float | None = field(default=None, repr=False)

    def take(self, now: float) -> float:
        """Seconds to wait for the next slot (0 when it is already late)."""
        if self._next_slot is None:
            self._next_slot = now
        slot = self._next_slot
        self._next_slot = slot + 1.0 / self.rate
        self.sent += 1
        wait = slot - now
        if wait >= 0:
            return wait
        lag_us = -wait * 1e6
        if lag_us > 1000:
            self.late += 1
        self.max_lag_us = max(self.max_lag_us, lag_us)
        return 0.0


def request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    host: str,
    port: int,
) -> bytes:
    """The bytes of one HTTP/1.1 request (kept alive), ``Host`` and ``Content-Length`` set."""
    lines = {"Host": f"{host}:{port}", **(headers or {}), "Content-Length": str(len(body))}
    head = "".join(f"{key}: {value}\r\n" for key, value in lines.items())
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def loopback(url: str) -> tuple[str, int]:
    """``url``'s host and port; ``ValueError`` unless the host is a loopback address or
    ``localhost`` (a tool's load is for a server on this machine, never another host's)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        raise ValueError(f"{url}: the load goes to loopback addresses only")
    return host, parts.port or 80


async def closed_loop(
    url: str,
    users: int,
    next_request: Callable[[random.Random], tuple[bytes, T] | None],
    answered: Callable[[T, Outcome], None],
    *,
    duration_s: float,
    max_requests: int,
    timeout_s: float = TIMEOUT_S,
    seed: int = 1,
    stop: asyncio.Event | None = None,
    schedule: Schedule | None = None,
) -> None:
    """``users`` users against ``url`` (a loopback address) until ``duration_s`` s have passed,
    ``max_requests`` have been sent, ``stop`` is set or every user's ``next_request`` has said
    ``None``. User ``u`` draws from its own ``random.Random(seed * 7919 + u)``, so runs with the
    same seed send the same requests in the same order."""
    host, port = loopback(url)
    await run(
        host,
        port,
        users,
        next_request,
        answered,
        duration_s=duration_s,
        max_requests=max_requests,
        timeout_s=timeout_s,
        seed=seed,
        stop=stop,
        schedule=schedule,
    )


async def run(
    host: str,
    port: int,
    users: int,
    next_request: Callable[[random.Random], tuple[bytes, T] | None],
    answered: Callable[[T, Outcome], None],
    *,
    duration_s: float,
    max_requests: int,
    timeout_s: float = TIMEOUT_S,
    seed: int = 1,
    stop: asyncio.Event | None = None,
    schedule: Schedule | None = None,
) -> None:
    """:func:`closed_loop` to any host: wrk's load from Python goes where ``mmserver recommend
    --url`` says, as wrk would."""
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s
    taken = 0

    def more() -> bool:
        return (
            loop.time() < end and taken < max_requests and not (stop is not None and stop.is_set())
        )

    def take(rng: random.Random) -> tuple[bytes, T] | None:
        nonlocal taken
        picked = next_request(rng)
        if picked is not None:
            taken += 1
        return picked

    async def user(rng: random.Random) -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while more():
                if conn is None:
                    conn = await _connect(host, port, timeout_s)
                    if conn is None:
                        picked = take(rng)
                        if picked is None:
                            return
                        now = time.perf_counter()
                        answered(picked[1], Outcome(now, now, 0, CONNECT))
                        await asyncio.sleep(RECONNECT_S)
                        continue
                reader, writer = conn
                if schedule is not None:
                    wait = schedule.take(loop.time())
                    if wait:
                        await asyncio.sleep(wait)
                        if not more():
                            break
                picked = take(rng)
                if picked is None:
                    return
                data, tag = picked
                sent = time.perf_counter()
                try:
                    writer.write(data)
                    status, size, head, body, keep = await asyncio.wait_for(
                        _answer(reader), timeout_s
                    )
                    outcome = Outcome(sent, time.perf_counter(), status, "", size, head, body)
                except TimeoutError:
                    outcome, keep = Outcome(sent, time.perf_counter(), 0, TIMEOUT), False
                except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    outcome, keep = Outcome(sent, time.perf_counter(), 0, READ), False
                # Outside the try: what the caller's hook raises is its own, not a read error.
                answered(tag, outcome)
                if not keep:
                    writer.close()
                    conn = None
        finally:
            if conn is not None:
                conn[1].close()

    await asyncio.gather(*(user(random.Random(seed * 7919 + u)) for u in range(users)))


async def _connect(
    host: str, port: int, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A new connection, or None when it was refused or did not open in ``timeout_s`` s."""
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return None


async def _answer(reader: asyncio.StreamReader) -> tuple[int, int, bytes, bytes, bool]:
    """Read one answer: (status, bytes in all, head, body, whether the connection stays)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, chunked, keep = 0, False, True
    for line in lines[1:]:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "content-length":
            length = int(value)
        elif key == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
        elif key == "connection" and value.strip().lower() == "close":
            keep = False
    size = len(head)
    if chunked:
        chunks = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            chunk = int(size_line.split(b";")[0], 16)
            chunks.append((await reader.readexactly(chunk + 2))[:chunk])
            size += len(size_line) + chunk + 2
            if chunk == 0:
                break
        body = b"".join(chunks)
    else:
        body = await reader.readexactly(length) if length else b""
        size += length
    return status, size, head, body, keep
