"""Hostile HTTP clients: connection floods, slow headers and bodies, readers that never read,
compressed bombs, clients leaving mid-upload, bytes that are not HTTP, bytes behind an upgrade
request, a head begun behind a whole request, undecodable bodies, V2 shapes beyond any array and
an unbounded batch delay."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import re
import socket
import time
from urllib.parse import urlsplit

from hostilelib import Case, Verdict


def _address(args: argparse.Namespace) -> tuple[str, int]:
    url = urlsplit(args.url)
    return url.hostname or "127.0.0.1", url.port or 80


def _post(path: str, body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def ping(args: argparse.Namespace) -> tuple[int, float]:
    """``GET /ping`` on a new connection: (status, seconds); status 0 when nothing answered."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(*_address(args)), args.seconds
        )
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), args.seconds)
        writer.close()
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    except (OSError, TimeoutError, ValueError, IndexError):
        status = 0
    return status, time.monotonic() - started


async def _status_then_close(reader: asyncio.StreamReader, seconds: float) -> tuple[int, bool]:
    """The status of the answer read, and whether the server then closed the connection."""
    try:
        answer = await asyncio.wait_for(reader.read(), seconds)
    except (TimeoutError, ConnectionError):
        return 0, False
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, True


async def idle_flood(args: argparse.Namespace) -> Verdict:
    """Open many idle connections, then check /ping on one more."""
    opened: list[asyncio.StreamWriter] = []
    refused = 0
    try:
        for _ in range(args.connections):
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(*_address(args)), args.seconds
                )
                opened.append(writer)
            except (OSError, TimeoutError):
                refused += 1
        status, took = await ping(args)
    finally:
        for writer in opened:
            writer.transport.abort()
    return Verdict(
        status == 200,
        f"{len(opened)} idle connections open ({refused} not); /ping answered {status} "
        f"in {took * 1000:.0f} ms",
    )


async def slow_headers(args: argparse.Namespace) -> Verdict:
    """Connections that send half a request's headers and stop (slowloris)."""
    opened = []
    for _ in range(min(args.connections, 200)):
        reader, writer = await asyncio.open_connection(*_address(args))
        writer.write(b"POST /predictions/sklearn-0 HTTP/1.1\r\nHost: x\r\nContent-Le")
        opened.append((reader, writer))
    results = await asyncio.gather(*(_status_then_close(r, args.seconds) for r, _ in opened))
    for _, writer in opened:
        writer.transport.abort()
    closed = sum(1 for _, c in results if c)
    statuses = sorted({s for s, _ in results})
    status, _ = await ping(args)
    return Verdict(
        closed == len(opened) and status == 200,
        f"{closed} of {len(opened)} half-sent requests answered {statuses} and closed within "
        f"{args.seconds:g} s; /ping {status}",
    )


async def slow_body(args: argparse.Namespace) -> Verdict:
    """A request whose body never ends."""
    reader, writer = await asyncio.open_connection(*_address(args))
    writer.write(_post("/predictions/sklearn-0", b"[[0.5]]" * 10)[:-20])
    status, closed = await _status_then_close(reader, args.seconds)
    writer.transport.abort()
    return Verdict(closed and status == 408, f"answered {status}, closed: {closed}")


async def never_read(args: argparse.Namespace) -> Verdict:
    """Requests with a large answer whose clients do not read it."""
    body = b"[" + b",".join([b"[0.5]"] * 400_000) + b"]"
    opened = []
    for _ in range(min(args.connections, 4)):  # answers computed well within --seconds
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no kernel buffering
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, _address(args))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        writer.write(_post("/predictions/sklearn-0", body))
        opened.append((reader, writer))
    await asyncio.sleep(args.seconds)  # not reading meanwhile
    dropped = 0
    for reader, _ in opened:
        received = bytearray()
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 5.0):
                received += chunk
        except (ConnectionError, TimeoutError):
            pass
        head, _, answer = bytes(received).partition(b"\r\n\r\n")
        length = [
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ]
        dropped += not length or len(answer) < length[0]  # (or not even begun)
    for _, writer in opened:
        writer.transport.abort()
    status, _ = await ping(args)
    # A client that does not read never gets its whole answer: the server drops it.
    return Verdict(
        dropped == len(opened) and status == 200,
        f"{dropped} of {len(opened)} connections that did not read their ~8 MB answers for "
        f"{args.seconds:g} s were dropped (send_timeout); /ping {status}",
    )


async def gzip_bomb(args: argparse.Namespace) -> Verdict:
    """A small gzip body that inflates far past max_request_size."""
    bomb = gzip.compress(b"[" + b"[0.5]," * 20_000_000 + b"[0.5]]", 9)
    reader, writer = await asyncio.open_connection(*_address(args))
    started = time.monotonic()
    writer.write(_post("/predictions/sklearn-0", bomb, "Content-Encoding: gzip"))
    status, closed = await _status_then_close(reader, args.seconds)
    took = time.monotonic() - started
    writer.transport.abort()
    return Verdict(
        status == 413 and closed,
        f"a {len(bomb) // 1024} KiB body inflating to 120 MB: answered {status} in "
        f"{took * 1000:.0f} ms, closed: {closed}",
    )


async def mid_upload(args: argparse.Namespace) -> Verdict:
    """Clients that close their connection halfway through the body."""
    for _ in range(min(args.connections, 100)):
        _, writer = await asyncio.open_connection(*_address(args))
        writer.write(_post("/predictions/sklearn-0", b"[[0.5]]" * 1000)[:-3000])
        await writer.drain()
        writer.transport.abort()
    status, _ = await ping(args)
    return Verdict(status == 200, f"/ping {status} (see the server's log: no tracebacks)")


async def garbage(args: argparse.Namespace) -> Verdict:
    """Bytes that are not HTTP, a bad header, too many headers, a smuggling attempt."""
    payloads = [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
        b"GET /ping HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n",
        b"GET /ping HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n",
        b"POST /ping HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    ]
    shapes = set()
    for i in range(min(args.connections, 400)):
        reader, writer = await asyncio.open_connection(*_address(args))
        writer.write(payloads[i % len(payloads)])
        answer = await asyncio.wait_for(reader.read(), args.seconds)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        json_body = b"application/json" in head and body.startswith(b"{")
        shapes.add(
            (
                head.split(b"\r\n", 1)[0].decode("latin-1"),
                json_body,
                b"aiohttp" in head or b"Python" in head,
            )
        )
    status, _ = await ping(args)
    good = all(js and not leaks for _, js, leaks in shapes) and status == 200
    return Verdict(good, f"answers {sorted(shapes)}; /ping {status}")


async def _exchange(
    args: argparse.Namespace, first: bytes, then: bytes = b""
) -> tuple[list[int], bool, float]:
    """Send ``first`` on a new connection, once something is answered ``then``, and read until
    the server closes it: (statuses answered, whether it closed within --seconds, seconds)."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*_address(args))
    received = bytearray()
    closed = False
    try:
        writer.write(first)
        if then:
            received += await asyncio.wait_for(reader.readuntil(b"}"), args.seconds)
            writer.write(then)
        while chunk := await asyncio.wait_for(reader.read(65536), args.seconds):
            received += chunk
        closed = True
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.transport.abort()
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]
    return statuses, closed, time.monotonic() - started


async def upgrade_desync(args: argparse.Namespace) -> Verdict:
    """An h2c upgrade request followed by a request whose body, sent later, is a request."""
    inner = b"DELETE /models/sklearn-0 HTTP/1.1\r\nHost: x\r\n\r\n"
    first = b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    first += _post("/predictions/sklearn-0", inner)[: -len(inner)]
    statuses, closed, _ = await _exchange(args, first, inner)
    return Verdict(
        statuses == [200] and closed,
        f"answered {statuses} (the body that is a request must not be answered), closed: {closed}",
    )


async def head_behind(args: argparse.Namespace) -> Verdict:
    """A whole request and the beginning of another in one packet, then silence."""
    first = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
    first += b"POST /predictions/sklearn-0 HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    statuses, closed, took = await _exchange(args, first)
    return Verdict(
        statuses == [200, 408] and closed,
        f"answered {statuses}, closed after {took:.1f} s (header_timeout, not keepalive_timeout)",
    )


async def bad_coding(args: argparse.Namespace) -> Verdict:
    """Bodies their Content-Encoding does not decode: not brotli, gzip with trailing bytes."""
    bodies = [
        ("br", b"this is not brotli at all, not at all" * 3),
        ("gzip", gzip.compress(b"[[0.5]]") + b"trailing bytes"),
        ("deflate", b"not deflate"),
    ]
    seen = []
    for coding, body in bodies:
        statuses, _, _ = await _exchange(
            args, _post("/predictions/sklearn-0", body, f"Content-Encoding: {coding}")
        )
        seen.append((coding, statuses))
    status, _ = await ping(args)
    return Verdict(
        all(s == [400] for _, s in seen) and status == 200,
        f"answered {seen} (see the server's log: no tracebacks); /ping {status}",
    )


async def v2_shape(args: argparse.Namespace) -> Verdict:
    """A V2 tensor of shape [0, 2**70] with no data."""
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [0, 2**70], "datatype": "FP64", "data": []}]}
    ).encode()
    statuses, _, _ = await _exchange(
        args, _post("/v2/models/sklearn-0/infer", body, "Connection: close")
    )
    return Verdict(statuses == [400], f"answered {statuses}")


async def batch_delay(args: argparse.Namespace) -> Verdict:
    """A batch delay of 10**17 ms set through the management API."""
    put = b"PUT /models/sklearn-0?max_batch_delay=100000000000000000 HTTP/1.1\r\nHost: x\r\n"
    statuses, _, _ = await _exchange(args, put + b"Connection: close\r\n\r\n")
    return Verdict(statuses == [400], f"answered {statuses}")


CASES = {
    "idle-flood": Case("many idle connections; /ping must still answer", idle_flood),
    "slow-headers": Case("half-sent headers (slowloris): 408 and closed", slow_headers),
    "slow-body": Case("a body that never ends: 408 and closed", slow_body),
    "never-read": Case("clients that do not read large answers: dropped", never_read),
    "gzip-bomb": Case("a compressed body inflating past the limit: 413 and closed", gzip_bomb),
    "mid-upload": Case("clients leaving mid-upload: counted 499, no traceback", mid_upload),
    "garbage": Case("bytes that are not HTTP: JSON 400s, no version disclosed", garbage),
    "upgrade-desync": Case("bytes behind an upgrade request: never a request", upgrade_desync),
    "head-behind": Case("a head begun behind a whole request: 408 at header_timeout", head_behind),
    "bad-coding": Case("bodies their Content-Encoding does not decode: 400", bad_coding),
    "v2-shape": Case("a V2 shape beyond any array: 400, not the model's 424", v2_shape),
    "batch-delay": Case("max_batch_delay of 10**17 ms: refused 400", batch_delay),
}
