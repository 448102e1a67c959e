"""The lean HTTP path (:mod:`mmserver.api.lean.connection`) over raw sockets: it answers plain
inference requests byte for byte as aiohttp's handler does, hands a connection to aiohttp at the
first request it does not take (with the answers before it written first, in order), and keeps the
connection rules. Each test waits for answers or for the connection to close, never for a time."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from mmserver.api.connections import HttpRunner
from mmserver.api.lean.front import LeanFront
from tests.integration.gate import Gate
from tests.integration.harness import Harness, Serve, wait_until
from tests.integration.test_hostile_http import SAFETY_S, Sockets, received_until_dropped
from tests.integration.test_hostile_http import sockets as sockets  # the fixture

_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


def _server(harness: Harness) -> Any:
    """The server's aiohttp ``Server`` (:class:`mmserver.api.connections._Server`)."""
    runner = harness.client.server.runner
    assert isinstance(runner, HttpRunner) and runner.server is not None
    return runner.server


def _front(harness: Harness) -> LeanFront:
    lean = _server(harness).lean
    assert isinstance(lean, LeanFront)
    return lean


def _request(path: str, body: bytes = b"[[0.5]]", **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/json", "X-Request-Id": "fixed"}
    fields.update({k.replace("_", "-"): v for k, v in headers.items()})
    lines = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v)
    head = f"POST {path} HTTP/1.1\r\n{lines}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def _exchange(harness: Harness, sockets: Sockets, data: bytes, answers: int) -> bytes:
    """Send ``data`` on a new connection and read until ``answers`` answers came."""
    reader, writer = await sockets.connect(harness)
    writer.write(data)
    received = b""
    while len(_STATUS.findall(received)) < answers or not _complete(received):
        chunk = await asyncio.wait_for(reader.read(65536), SAFETY_S)
        assert chunk, f"closed after {received!r}"
        received += chunk
    writer.close()
    return received


def _complete(received: bytes) -> bool:
    head, sep, body = received.rpartition(b"\r\n\r\n")
    if not sep:
        return False
    length = re.search(rb"Content-Length: (\d+)\r\n", head[head.rfind(b"HTTP/1.") :])
    return length is not None and len(body) >= int(length.group(1))


def _without_date(answer: bytes) -> bytes:
    return re.sub(rb"Date: [^\r]*", b"Date: -", answer)


V2_BODY = b'{"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]}'

#: Requests the lean path takes, with the answers they get (success and errors alike).
TAKEN: dict[str, bytes] = {
    "json": _request("/predictions/sklearn-1"),
    "csv": _request("/models/sklearn-2/invoke", b"0.5", Content_Type="text/csv", Accept="text/csv"),
    "sagemaker": _request(
        "/endpoints/e/invocations", X_Amzn_SageMaker_Target_Model="sklearn-3.tar.gz"
    ),
    "no target": _request("/invocations"),
    "unknown model": _request("/invocations", X_Amzn_SageMaker_Target_Model="nope.tar.gz"),
    "unsupported type": _request("/predictions/sklearn-1", Content_Type="application/xml"),
    "bad body": _request("/predictions/sklearn-1", b"[[0.5]"),
    "raising model": _request("/models/raising-handler/invoke"),
    "v2": _request("/v2/models/sklearn-4/infer", V2_BODY),
    "v2 unknown model": _request("/v2/models/nope/infer", V2_BODY),
    "v2 bad body": _request("/v2/models/sklearn-4/infer", b'{"inputs": 1}'),
    "v2 bad header length": _request(
        "/v2/models/sklearn-4/infer", V2_BODY, Inference_Header_Content_Length="x"
    ),
    "version 1": _request("/predictions/sklearn-5/1"),
    "version 2": _request("/predictions/sklearn-5/2"),
    "sagemaker version": _request(
        "/invocations", X_Amzn_SageMaker_Target_Model="sklearn-6/1.tar.gz"
    ),
}


@pytest.mark.parametrize("case", sorted(TAKEN))
async def test_lean_answers_are_aiohttps_byte_for_byte(
    serve: Serve, sockets: Sockets, case: str
) -> None:
    lean = await serve()
    plain = await serve(lean_http=False)
    got = await _exchange(lean, sockets, TAKEN[case], 1)
    expected = await _exchange(plain, sockets, TAKEN[case], 1)
    assert _without_date(got) == _without_date(expected)
    front = _front(lean)
    assert (front.taken, front.handed_over) == (1, 0)
    assert _STATUS.findall(got) == _STATUS.findall(expected)


async def test_lean_answers_are_counted_as_aiohttps(serve: Serve, sockets: Sockets) -> None:
    async def counts(harness: Harness) -> dict[Any, float]:
        for case in sorted(TAKEN):
            await _exchange(harness, sockets, TAKEN[case], 1)
        samples = await harness.samples()
        return {k: v for k, v in samples.items() if k[0] == "mmserver_requests_total"}

    lean = await serve()
    plain = await serve(lean_http=False)
    assert await counts(lean) == await counts(plain)
    assert _front(lean).taken == len(TAKEN)


HANDED: dict[str, bytes] = {
    "query string": _request("/invocations?model_name=sklearn-4", X_Request_Id=""),
    "percent-encoded name": _request("/predictions/sklearn%2D4"),
    "chunked body": (
        b"POST /predictions/sklearn-4 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n7\r\n[[0.5]]\r\n0\r\n\r\n"
    ),
    "expect": _request("/predictions/sklearn-4", Expect="100-continue"),
    "http/1.0": _request("/predictions/sklearn-4").replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "connection close": _request("/predictions/sklearn-4", Connection="close"),
    "non-ascii header": _request("/predictions/sklearn-4", X_Note="caf\xe9"),
    "v2 version path": _request("/v2/models/sklearn-4/versions/1/infer", V2_BODY),
    "routing key": _request("/predictions/sklearn-4", X_Mmserver_Routing_Key="caller-1"),
}


@pytest.mark.parametrize("case", sorted(HANDED))
async def test_other_requests_are_handed_to_aiohttp(
    serve: Serve, sockets: Sockets, case: str
) -> None:
    harness = await serve()
    data = HANDED[case]
    if case == "non-ascii header":
        data = data.decode().encode("latin-1")
    answer = await _exchange(harness, sockets, data, 1)
    assert _STATUS.findall(answer) in ([b"100", b"200"], [b"200"]), answer[:400]
    assert answer.rstrip().endswith((b"]}", b"]}]}"))
    front = _front(harness)
    assert (front.taken, front.handed_over) == (0, 1)


_BASE = b"POST /predictions/sklearn-4 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

#: Requests aiohttp refuses: the lean path must leave them to it.
REFUSED: dict[str, bytes] = {
    "129 headers": _BASE
    + b"".join(b"X-H%d: v\r\n" % i for i in range(129))
    + b"Content-Length: 7\r\n\r\n[[0.5]]",
    "length and chunked": _BASE
    + b"Content-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n[[0.5]]\r\n0\r\n\r\n",
    "two lengths": _BASE + b"Content-Length: 7\r\nContent-Length: 8\r\n\r\n[[0.5]] ",
    "signed length": _BASE + b"Content-Length: +7\r\n\r\n[[0.5]]",
    "length of 5000 digits": _BASE + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n[[0.5]]",
    "no host": _BASE.replace(b"Host: x\r\n", b"") + b"Content-Length: 7\r\n\r\n[[0.5]]",
    "two content types": _BASE + b"Content-Type: text/csv\r\nContent-Length: 7\r\n\r\n[[0.5]]",
    "websocket key1": _BASE + b"Sec-WebSocket-Key1: a\r\nContent-Length: 7\r\n\r\n[[0.5]]",
    "field over 8190 bytes": _BASE
    + b"X-Big: "
    + b"v" * 9000
    + b"\r\nContent-Length: 7\r\n\r\n[[0.5]]",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_what_aiohttp_refuses_is_left_to_it(
    serve: Serve, sockets: Sockets, case: str
) -> None:
    harness = await serve()
    reader, writer = await sockets.connect(harness)
    writer.write(REFUSED[case])
    answer = await asyncio.wait_for(reader.read(), SAFETY_S)  # answered, then closed
    assert _STATUS.findall(answer) in ([b"400"], [b"431"]), answer[:300]
    front = _front(harness)
    assert (front.taken, front.handed_over) == (0, 1)


async def test_a_request_arriving_in_pieces_is_handed_over_whole(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve()
    front = _front(harness)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/sklearn-5"))  # taken: answered on the lean path
    first = await asyncio.wait_for(reader.readuntil(b"]}"), SAFETY_S)
    data = _request("/predictions/sklearn-5", b"[[1.5]]")
    writer.write(data[:20])
    await wait_until(lambda: front.handed_over == 1)
    writer.write(data[20:])
    second = await asyncio.wait_for(reader.readuntil(b"]}"), SAFETY_S)
    assert _STATUS.findall(first) == _STATUS.findall(second) == [b"200"]
    assert front.taken == 1


async def test_a_pipelined_stream_cut_between_reads_stays_lean(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve()
    front = _front(harness)
    reader, writer = await sockets.connect(harness)
    stream = b"".join(_request("/predictions/sklearn-5", f"[[{i}.0]]".encode()) for i in range(4))
    size = len(stream) // 4
    # Each write completes the request the one before began (in its head, then in its body).
    for piece, answered in ((stream[: size + 30], 1), (stream[size + 30 : 3 * size - 3], 2)):
        writer.write(piece)
        await wait_until(lambda answered=answered: front.taken == answered)  # type: ignore[misc]
    writer.write(stream[3 * size - 3 :])
    received = b""
    while len(_STATUS.findall(received)) < 4 or not received.endswith(b"]}"):
        received += await asyncio.wait_for(reader.read(65536), SAFETY_S)
    assert _STATUS.findall(received) == [b"200"] * 4
    assert (front.taken, front.handed_over) == (4, 0)


async def test_pipelined_requests_across_the_hand_over_are_answered_in_order(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve()
    data = (
        _request("/predictions/sklearn-6", b"[[0.0]]")
        + _request("/predictions/sklearn-6", b"[[1.0]]")
        + b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
        + _request("/predictions/sklearn-6", b"[[2.0]]")
    )
    answer = await _exchange(harness, sockets, data, 4)
    assert _STATUS.findall(answer) == [b"200"] * 4
    bodies = re.findall(rb"\r\n\r\n(\{[^}]*\})", answer)
    assert b"Healthy" in bodies[2]
    values = [float(re.findall(rb"[-\d.]+", b)[0]) for i, b in enumerate(bodies) if i != 2]
    assert values == sorted(values) and len(set(values)) == 3
    front = _front(harness)
    assert (front.taken, front.handed_over) == (2, 1)


async def test_a_client_that_does_not_read_pipelined_answers_is_dropped(
    serve: Serve, sockets: Sockets
) -> None:
    harness = await serve(send_timeout=0.2)
    reader, writer = await sockets.connect(harness, rcvbuf=4096)
    request = _request("/predictions/sklearn-7")
    # Far more answers than the sockets' buffers hold: reading stops while the send buffer is
    # full or 128 answers are owed, and the connection is dropped once the client has not read
    # for send_timeout.
    sent = 20_000
    writer.write(request * sent)
    front = _front(harness)
    await wait_until(lambda: front.taken > 0)
    server = _server(harness)
    await wait_until(lambda: server.open_connections() == 0, SAFETY_S)
    assert front.taken < sent
    assert 0 < len(_STATUS.findall(await received_until_dropped(reader))) < sent
    # The server goes on serving.
    assert (await harness.post("/predictions/sklearn-7", "[[0.5]]")).status == 200


async def test_at_shutdown_a_lean_connection_closes_once_its_answers_are_written(
    serve: Serve, sockets: Sockets, gate: Gate
) -> None:
    harness = await serve()
    idle_reader, idle_writer = await sockets.connect(harness)
    idle_writer.write(_request("/predictions/sklearn-8"))
    await asyncio.wait_for(idle_reader.readuntil(b"]}"), SAFETY_S)
    reader, writer = await sockets.connect(harness)
    writer.write(_request("/predictions/gated-handler"))
    assert await asyncio.to_thread(gate.wait_entered)
    server = _server(harness)
    server.pre_shutdown()  # what the server's shutdown does once the listener is closed
    assert await asyncio.wait_for(idle_reader.read(), SAFETY_S) == b""
    gate.open()
    answer = await asyncio.wait_for(reader.read(), SAFETY_S)  # the answer, then the close
    assert _STATUS.findall(answer) == [b"200"] and answer.endswith(b"]}")
    await asyncio.wait_for(server.shutdown(SAFETY_S), SAFETY_S)
    assert server.open_connections() == 0
