"""The lean path's parse and take (:class:`mmserver.api.lean.connection.LeanConnection`) and its
flow control (:class:`mmserver.api.lean.flow.LeanFlow`) on a mock transport: which requests it
takes,
which it hands to aiohttp and from which byte, and when it reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from mmserver.api.lean.connection import LeanConnection
from mmserver.api.lean.flow import LeanFlow
from mmserver.api.lean.front import LeanFront
from mmserver.api.state import ApiState
from mmserver.config.server import ServerConfig
from mmserver.ops.metrics import Metrics


class Transport:
    """What a lean connection calls of its transport, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.reading = True
        self.pauses = 0
        self.closed = self.aborted = False
        self.protocol: Any = None

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def pause_reading(self) -> None:
        assert self.reading, "paused twice"
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        assert not self.reading, "resumed twice"
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol


class Aiohttp:
    """The handler a connection is handed to: the bytes it got."""

    def __init__(self) -> None:
        self.received = b""

    def connection_made(self, transport: Any) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.received += data


@dataclass
class Submitted:
    name: str
    body: bytes
    content_type: str | None
    answer: asyncio.Future[bytes]
    requests: None = None


@dataclass
class Wlm:
    """Records what is submitted; the answers are set by the test."""

    jobs: list[Submitted] = field(default_factory=list)

    def submit(self, name: str, job: Any, client_gone: Any) -> Submitted:
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        submitted = Submitted(name, job[0], job[1], answer)
        self.jobs.append(submitted)
        return submitted


@dataclass
class Lean:
    conn: LeanConnection
    transport: Transport
    wlm: Wlm
    front: LeanFront
    aiohttp: Aiohttp


def lean(**options: Any) -> Lean:
    wlm = Wlm()
    state = ApiState(ServerConfig(**options), cast(Any, wlm), Metrics(CollectorRegistry()))
    aiohttp = Aiohttp()
    front = LeanFront(state, lambda: cast(asyncio.Protocol, aiohttp), lambda _: False)
    conn = LeanConnection(front)
    transport = Transport()
    conn.connection_made(cast(asyncio.Transport, transport))
    return Lean(conn, transport, wlm, front, aiohttp)


async def answer(submitted: Submitted, body: bytes = b"[1.0]") -> None:
    """Answer a submitted request and wait for its future's callbacks (the connection's first,
    added at submission) to have run."""
    after: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    submitted.answer.add_done_callback(lambda _: after.set_result(None))
    submitted.answer.set_result(body)
    await after


def request(path: str = "/predictions/m", body: bytes = b"[[1.0]]", **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body))}
    fields.update({k.replace("_", "-"): v for k, v in headers.items()})
    lines = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v)
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


async def test_whole_requests_are_taken_in_order_with_their_bodies_and_headers() -> None:
    s = lean()
    s.conn.data_received(
        request(body=b"[[1.0]]")
        + request("/v2/models/n/infer", b"{}", Content_Type="")
        + request("/invocations", b"1", X_Amzn_SageMaker_Target_Model="t.tar.gz  ")
    )
    assert [(j.name, j.body) for j in s.wlm.jobs] == [
        ("m", b"[[1.0]]"),
        ("n", b"{}"),
        ("t.tar.gz", b"1"),
    ]
    assert (s.front.taken, s.front.handed_over, s.transport.written) == (3, 0, [])
    # Answered out of order, written in order.
    await answer(s.wlm.jobs[1], b'{"outputs": []}')
    assert s.transport.written == []
    await answer(s.wlm.jobs[0], b"[2.0]")
    assert len(s.transport.written) == 1
    assert s.transport.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert s.transport.written[0].count(b"HTTP/1.1 200 OK") == 2


async def test_while_the_server_drains_the_last_answer_closes_the_connection() -> None:
    s = lean()
    s.conn.data_received(request(body=b"[[1.0]]") + request(body=b"[[2.0]]"))
    s.front.drain()  # the drain begins with both requests taken
    await answer(s.wlm.jobs[0], b"[2.0]")
    # The first answer is not the last: written as ever, the connection kept.
    assert b"Connection: close" not in b"".join(s.transport.written) and not s.transport.closed
    await answer(s.wlm.jobs[1], b"[4.0]")
    last = s.transport.written[-1]
    assert last.startswith(b"HTTP/1.1 200 OK\r\nConnection: close\r\n")
    assert last.endswith(b"[4.0]") and s.transport.closed


@pytest.mark.parametrize(
    "data",
    [
        request("/ping"),
        request(Connection="close"),
        request(Expect="100-continue"),
        request(Content_Encoding="gzip"),
        request(Host=""),
        request("/predictions/a%2Db"),
        request("/predictions/./m"),
        request("/predictions/m?x=1"),
        request().replace(b"HTTP/1.1", b"HTTP/1.0"),
        request().replace(b"POST", b"PUT", 1),
        request().replace(b"\r\n", b"\n"),
        request(X_Note="caf\xe9"),
        request(Content_Length="+7"),
        b"GARBAGE\r\n\r\n",
    ],
    ids=[
        "other path",
        "connection close",
        "expect",
        "compressed",
        "no host",
        "percent-encoded",
        "dot segment",
        "query",
        "http/1.0",
        "put",
        "bare lf",
        "non-ascii",
        "signed length",
        "not http",
    ],
)
async def test_a_request_is_taken_or_handed_to_aiohttp_from_its_first_byte(data: bytes) -> None:
    s = lean()
    first = request(body=b"[[0.0]]")
    s.conn.data_received(first + data + first)
    await answer(s.wlm.jobs[0])
    # The answer owed is written first, then aiohttp gets the rest, from the request's start.
    assert (s.front.taken, s.front.handed_over) == (1, 1)
    assert s.transport.written[0].startswith(b"HTTP/1.1 200 OK")
    assert s.transport.protocol is s.aiohttp
    assert s.aiohttp.received == data + first
    assert s.transport.reading


async def test_a_request_split_across_reads_is_kept_whole_for_aiohttp() -> None:
    s = lean()
    first, second = request(body=b"[[0.0]]"), request(body=b"[[1.0]]")
    # Behind a taken request, the next one's head and part of its body wait for the next read.
    s.conn.data_received(first + second[:-3])
    assert s.front.taken == 1
    s.conn.data_received(second[-3:])
    assert s.front.taken == 2 and s.wlm.jobs[1].body == b"[[1.0]]"
    # A fresh read that completes nothing is handed over whole, even with its head parsed.
    s.conn.data_received(second[:-3])
    await answer(s.wlm.jobs[0])
    await answer(s.wlm.jobs[1])
    assert s.front.handed_over == 1
    assert s.aiohttp.received == second[:-3]


async def test_a_head_parsed_before_a_stall_is_handed_over_whole() -> None:
    s = lean()
    first, second = request(body=b"[[0.0]]"), request(body=b"[[1.0]]")
    s.conn.data_received(first + second[:-3])
    await answer(s.wlm.jobs[0])
    s.conn.hand_off_stalled(float("inf"))
    assert s.aiohttp.received == second[:-3]


async def test_reading_pauses_while_answers_are_owed_and_resumes_at_half() -> None:
    s = lean()
    s.conn.data_received(request() * 200)
    assert s.front.taken == 128 and not s.transport.reading
    for job in s.wlm.jobs[:63]:
        await answer(job)
    assert not s.transport.reading  # 65 owed
    await answer(s.wlm.jobs[63])
    # Resumed at 64 owed: what was unread is taken, up to 128 owed again.
    assert (s.front.taken, s.transport.reading, s.transport.pauses) == (192, False, 2)
    for job in list(s.wlm.jobs[64:]):
        await answer(job)
    assert s.transport.reading and s.front.taken == 200


async def test_a_full_send_buffer_pauses_reading_until_it_drains() -> None:
    s = lean()
    s.conn.pause_writing()
    assert not s.transport.reading
    s.conn.resume_writing()
    assert s.transport.reading


async def test_lean_flow_calls_the_transport_only_on_a_change() -> None:
    transport = Transport()
    flow = LeanFlow(cast(asyncio.Transport, transport), send_timeout=0)
    flow.pause_reading()
    flow.pause_writing()
    assert (flow.read_paused, flow.write_paused, transport.pauses) == (True, True, 1)
    flow.resume_writing()
    assert flow.read_paused and not flow.write_paused  # reading resumes when the owner says
    flow.resume_reading()
    flow.resume_reading()
    assert transport.reading and not transport.aborted


async def test_lean_flow_aborts_a_connection_whose_client_does_not_read() -> None:
    transport = Transport()
    flow = LeanFlow(cast(asyncio.Transport, transport), send_timeout=1e-3)
    dropped = asyncio.Event()
    transport.abort = dropped.set  # type: ignore[method-assign]
    flow.pause_writing()
    await asyncio.wait_for(dropped.wait(), 5)
    flow = LeanFlow(cast(asyncio.Transport, Transport()), send_timeout=1e-3)
    flow.pause_writing()
    flow.resume_writing()  # drained in time: the clock stops
    assert flow._stall is None
