"""Hostile clients over raw sockets: connection limit, slow headers and bodies, idle keep-alive,
clients that never read, compressed bombs, clients leaving mid-upload, bytes that are not HTTP,
and what the answers give away. Each test waits for the server's answer or for the connection to
close (an event), never for a time; the options make the server's timeouts short."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mmserver.api.access import check_security
from mmserver.api.connections import HttpRunner
from mmserver.config.server import ServerConfig, resolves_to_loopback
from mmserver.errors import ConfigError
from tests.integration.harness import Harness, Serve, wait_until, watch_body_reads

#: Long enough for any answer on a loaded machine; reached only when a test fails.
SAFETY_S = 20.0


class Sockets:
    """Raw client connections to one server, all closed when the test ends."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []

    async def connect(
        self, harness: Harness, rcvbuf: int | None = None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = harness.client.host, harness.client.port
        if rcvbuf is None:
            reader, writer = await asyncio.open_connection(host, port)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        self.writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        await asyncio.sleep(0)  # the transports' close callbacks run


@pytest.fixture
async def sockets() -> AsyncIterator[Sockets]:
    opened = Sockets()
    yield opened
    await opened.close()


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), SAFETY_S)


async def received_until_dropped(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed or reset the connection."""
    received = bytearray()
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 20), SAFETY_S):
            received += chunk
    except ConnectionResetError:
        pass
    return bytes(received)


def _split(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def _json_error(answer: bytes, status: int) -> dict[str, Any]:
    got, headers, body = _split(answer)
    assert got == status, answer[:300]
    assert headers["content-type"].startswith("application/json")
    assert headers.get("server", "mmserver") == "mmserver"
    error: dict[str, Any] = json.loads(body[: int(headers["content-length"])])
    assert error["code"] == status and error["type"] and error["message"]
    return error


async def _count(harness: Harness, code: str) -> float:
    """Requests counted under status ``code``, whatever their model label."""
    samples = await harness.samples()
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "mmserver_requests_total" and ("code", code) in labels
    )


def _connections(harness: Harness) -> int:
    runner = harness.client.server.runner
    assert isinstance(runner, HttpRunner) and runner.server is not None
    return runner.server.open_connections()


def _request(path: str, body: bytes = b"[[0.5]]", **headers: str) -> bytes:
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def test_connections_past_the_limit_are_answered_503_and_closed(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(max_connections=3)
    held = [await sockets.connect(harness) for _ in range(3)]
    await wait_until(lambda: _connections(harness) == 3)
    reader, writer = await sockets.connect(harness)
    error = _json_error(await _until_closed(reader), 503)
    assert error["type"] == "ServiceUnavailableException"
    assert "max_connections" in error["message"]
    writer.close()
    # A held connection still serves; once one closes, a new one is served.
    held_reader, held_writer = held[0]
    held_writer.write(_request("/predictions/sklearn-0", Connection="close"))
    status, _, body = _split(await _until_closed(held_reader))
    assert status == 200 and json.loads(body)["predictions"]
    await wait_until(lambda: _connections(harness) == 2)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0", Connection="close"))
    assert _split(await _until_closed(reader))[0] == 200
    for _, w in held[1:]:
        w.close()


async def test_headers_that_do_not_arrive_in_time_are_answered_408(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(header_timeout=0.2)
    reader, writer = await sockets.connect(harness)
    writer.write(b"POST /predictions/sklearn-0 HTTP/1.1\r\nHost: x\r\nContent-Le")
    error = _json_error(await _until_closed(reader), 408)
    assert "header_timeout" in error["message"]
    # Requests that arrive whole are not affected.
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0", Connection="close"))
    assert _split(await _until_closed(reader))[0] == 200


async def test_an_idle_keep_alive_connection_is_closed(serve: Serve, sockets: Sockets) -> None:
    harness = await serve(keepalive_timeout=0.2)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0"))
    answer = await _until_closed(reader)  # the answer, then the close of the idle connection
    assert _split(answer)[0] == 200
    assert answer.count(b"HTTP/1.1") == 1


async def test_a_body_that_does_not_arrive_in_time_is_answered_408(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(body_timeout=0.2)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0", b"[[0.5]]")[:-3])  # the body's end never comes
    error = _json_error(await _until_closed(reader), 408)
    assert "body_timeout" in error["message"]
    assert await _count(harness, "408") == 1


async def test_a_client_that_never_reads_its_answer_is_dropped(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(send_timeout=0.2, max_request_size=8 * 2**20)
    rows = b"[" + b",".join([b"[0.5]"] * 400_000) + b"]"
    reader, writer = await sockets.connect(harness, rcvbuf=4096)
    writer.write(_request("/predictions/sklearn-3", rows))
    await writer.drain()
    # The answer (~8 MB) does not fit the sockets' buffers: the server waits for the client to
    # read it, then drops the connection and the answer with it.
    await wait_until(lambda: _connections(harness) == 0, SAFETY_S)
    status, headers, body = _split(await received_until_dropped(reader))
    assert status == 200
    assert len(body) < int(headers["content-length"])
    writer.close()
    # The server goes on serving.
    assert (await harness.post("/predictions/sklearn-3", "[[0.5]]")).status == 200


async def test_a_compressed_body_over_the_limit_is_refused_and_its_connection_closed(
    serve: Serve,
    sockets: Sockets,
) -> None:
    harness = await serve(max_request_size=64 * 1024)
    bomb = gzip.compress(b"[" + b"[0.5]," * 2_000_000 + b"[0.5]]", 9)  # 12 MB inflated
    assert len(bomb) < 64 * 1024
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0", bomb, Content_Encoding="gzip"))
    # Answered 413, and the connection closed rather than the rest of the body inflated.
    error = _json_error(await _until_closed(reader), 413)
    assert "max_request_size" in error["message"]
    assert (await harness.post("/predictions/sklearn-0", "[[0.5]]")).status == 200


async def test_a_client_leaving_mid_upload_is_counted_499_without_a_traceback(
    serve: Serve,
    sockets: Sockets,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = await serve()
    reading = watch_body_reads(monkeypatch)
    _, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-5", b"[[0.5]]" * 100)[:-300])
    await asyncio.wait_for(reading.wait(), SAFETY_S)
    writer.transport.abort()
    for _ in range(4000):  # until the server has counted it
        if await _count(harness, "499") == 1:
            break
        await asyncio.sleep(0.005)
    assert await _count(harness, "499") == 1
    assert await _count(harness, "500") == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


async def test_an_undecodable_bearer_token_is_refused_401(serve: Serve, sockets: Sockets) -> None:
    harness = await serve(management_token="s3cret")
    reader, writer = await sockets.connect(harness)
    writer.write(
        b"DELETE /models/sklearn-0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\xff\r\n"
        b"Connection: close\r\n\r\n"
    )
    error = _json_error(await _until_closed(reader), 401)
    assert "Authorization: Bearer <management token>" in error["message"]


@pytest.mark.parametrize(
    "garbage",
    [
        b"GARBAGE-NOT-HTTP\r\n\r\n",
        b"GET /ping HTTP/1.1\r\nHost: x\r\nBad Header: v\r\n\r\n",
        b"GET /ping HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + b"\r\n",
        b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
    ],
    ids=["not-http", "bad-header", "too-many-headers", "smuggling"],
)
async def test_malformed_http_is_answered_in_json_and_logged_once(
    serve: Serve, sockets: Sockets, caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    harness = await serve()
    caplog.set_level(logging.INFO)
    for _ in range(5):
        reader, writer = await sockets.connect(harness)
        writer.write(garbage)
        error = _json_error(await _until_closed(reader), 400)
        assert error["type"] == "BadRequestException"
        assert "not valid HTTP/1.1" in error["message"]
        for quoted in (b"GARBAGE", b"Bad Header", b"X-H1", b"chunked"):
            assert quoted.decode() not in error["message"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "malformed HTTP request" in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info]


async def test_no_answer_names_the_server_software(serve: Serve, sockets: Sockets) -> None:
    harness = await serve()
    answers = [
        await harness.client.get("/ping"),
        await harness.post("/predictions/sklearn-0", "[[0.5]]"),
        await harness.post("/predictions/no-such-model", "[[0.5]]"),
        await harness.client.get("/models"),
        await harness.client.get("/metrics"),
        await harness.client.get("/no/such/path"),
    ]
    for response in answers:
        assert response.headers.get("Server", "mmserver") == "mmserver"


async def test_pipelined_requests_are_answered_in_order(serve: Serve, sockets: Sockets) -> None:
    harness = await serve()
    reader, writer = await sockets.connect(harness)
    writer.write(
        _request("/predictions/sklearn-0", b"[[0.0]]")
        + _request("/predictions/sklearn-0", b"[[1.0]]")
        + _request("/predictions/sklearn-0", b"[[2.0]]", Connection="close")
    )
    answers = (await _until_closed(reader)).split(b"HTTP/1.1 ")[1:]
    assert [a.split(b" ", 1)[0] for a in answers] == [b"200"] * 3
    values = [json.loads(a.rpartition(b"\r\n\r\n")[2])["predictions"][0] for a in answers]
    assert values == sorted(values)
    # Garbage in the same packet as valid requests: those are answered, then the garbage 400.
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0") * 3 + b"GARBAGE\r\n\r\n")
    answer = await _until_closed(reader)
    assert re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer) == [b"200"] * 3 + [b"400"]
    _json_error(answer[answer.rindex(b" 400 Bad Request") - 8 :], 400)


async def test_without_the_lean_path_garbage_after_requests_refuses_the_packet(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(lean_http=False)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-0") * 3 + b"GARBAGE\r\n\r\n")
    answer = await _until_closed(reader)
    assert answer.count(b"HTTP/1.1 ") == 1
    _json_error(answer, 400)


def test_loopback_is_decided_on_the_resolved_addresses() -> None:
    assert resolves_to_loopback("127.0.0.1") and resolves_to_loopback("localhost")
    assert resolves_to_loopback("::1")
    assert not resolves_to_loopback("127.0.0.1.invalid")  # looks local, resolves nowhere
    assert not resolves_to_loopback("0.0.0.0")
    config = ServerConfig(host="127.attacker.invalid")
    assert not config.is_loopback
    with pytest.raises(ConfigError, match="non-loopback address needs a management token"):
        check_security(config)


@pytest.mark.parametrize("lean_http", [True, False], ids=["lean", "aiohttp"])
async def test_bytes_behind_an_upgrade_request_are_never_parsed_as_a_request(
    serve: Serve, sockets: Sockets, lean_http: bool
) -> None:
    harness = await serve(lean_http=lean_http)
    reader, writer = await sockets.connect(harness)
    inner = b"DELETE /models/sklearn-0 HTTP/1.1\r\nHost: x\r\n\r\n"
    assert (await harness.post("/predictions/sklearn-0", "[[0.5]]")).status == 200
    writer.write(
        b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
        + _request("/predictions/sklearn-0", inner)[: -len(inner)]
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.readuntil(b"}"), SAFETY_S)  # the ping's answer
    writer.write(inner)  # the second request's body, in a read of its own
    answer += await _until_closed(reader)
    # The upgrade request is answered, with the connection closed; nothing after it is read.
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"200"]
    assert _split(answer)[1]["connection"] == "close"
    assert "sklearn-0" in harness.wlm.room.loaded


@pytest.mark.parametrize("lean_http", [True, False], ids=["lean", "aiohttp"])
async def test_a_head_begun_behind_a_whole_request_has_the_header_timeout(
    serve: Serve, sockets: Sockets, lean_http: bool
) -> None:
    harness = await serve(header_timeout=0.2, keepalive_timeout=SAFETY_S * 2, lean_http=lean_http)
    reader, writer = await sockets.connect(harness)
    writer.write(
        b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /predictions/sklearn-0 HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    )
    answer = await _until_closed(reader)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"200", b"408"]
    assert "header_timeout" in _json_error(answer[answer.index(b"HTTP/1.1 408") :], 408)["message"]
    # Whole pipelined requests with bodies, and an idle connection after them, are not affected.
    reader, writer = await sockets.connect(harness)
    writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n" + _request("/predictions/sklearn-0"))
    answer = await asyncio.wait_for(reader.readuntil(b"]}"), SAFETY_S)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"200", b"200"]
    writer.write(_request("/predictions/sklearn-0", Connection="close"))
    assert _split(await _until_closed(reader))[0] == 200


@pytest.mark.parametrize(
    ("coding", "body"),
    [
        ("br", b"this is not brotli at all, not at all" * 3),
        ("gzip", gzip.compress(b"[[0.5]]") + b"trailing bytes"),
        ("gzip", b"not gzip at all"),
        ("deflate", b"not deflate"),
    ],
    ids=["br-not-brotli", "gzip-trailing-bytes", "gzip-not-gzip", "deflate-not-deflate"],
)
async def test_a_body_its_content_coding_does_not_decode_is_a_400_without_a_traceback(
    serve: Serve, sockets: Sockets, caplog: pytest.LogCaptureFixture, coding: str, body: bytes
) -> None:
    harness = await serve()
    for path in ("/predictions/sklearn-0", "/v2/models/sklearn-0/infer"):
        reader, writer = await sockets.connect(harness)
        writer.write(_request(path, body, Content_Encoding=coding))
        answer = await _until_closed(reader)
        status, headers, raw = _split(answer)
        assert status == 400, answer[:300]
        message = json.loads(raw[: int(headers["content-length"])])
        text = message.get("message") or message["error"]
        assert f"not valid '{coding}' data, as its Content-Encoding says" in text
    assert await _count(harness, "500") == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
