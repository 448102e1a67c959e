"""The load generator's closed-loop users (:mod:`mmserver.commands.loadtest.users`) against a
small HTTP/1.1 server in the test's own loop: bounded in count and in time, a list run, the
answer's status, headers and body (chunked too), a connection the server closes, refused
connections, timeouts, the stop event, loopback only; the open loop's schedule as a table; and
``pyload``'s ``BENCH_JSON`` result built on them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from mmserver.commands.loadtest import pyload, users
from mmserver.commands.procfs import free_port


@dataclass
class Server:
    """Answers ``POST /predictions/NAME`` with ``{"predictions": [NAME]}`` and the header
    ``X-Served-By: test``; ``/chunked/NAME`` the same in two chunks; ``/close/NAME`` with
    ``Connection: close``; ``/silent`` never."""

    port: int = 0
    paths: list[str] = field(default_factory=list)
    connections: int = 0
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head
                    if line.lower().startswith("content-length:")
                )
                await reader.readexactly(length)
                path = head[0].split(" ")[1]
                self.paths.append(path)
                name = path.rsplit("/", 1)[1]
                body = b'{"predictions": ["' + name.encode() + b'"]}'
                if path.startswith("/silent"):
                    await self.closing.wait()
                    return
                if path.startswith("/chunked/"):
                    half = len(body) // 2
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
                        % (half, body[:half], len(body) - half, body[half:])
                    )
                    continue
                close = path.startswith("/close/")
                writer.write(
                    b"HTTP/1.1 200 OK\r\nX-Served-By: test\r\nContent-Length: %d\r\n%s\r\n%s"
                    % (len(body), b"Connection: close\r\n" if close else b"", body)
                )
                if close:
                    await writer.drain()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self.handlers.discard(task)
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server()
    listening = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = listening.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        listening.close()
        state.closing.set()
        await asyncio.gather(*state.handlers)
        await listening.wait_closed()


def _post(port: int, path: str) -> bytes:
    return users.request("POST", path, b"[[0.5]]", host="127.0.0.1", port=port)


async def test_a_run_ends_at_its_count_and_each_user_draws_from_its_own_seed(
    server: Server,
) -> None:
    def run_once() -> tuple[list[tuple[str, int, str]], asyncio.Future[None]]:
        seen: list[tuple[str, int, str]] = []

        def pick(rng: random.Random) -> tuple[bytes, str]:
            name = f"m{rng.randrange(1000)}"
            return _post(server.port, f"/predictions/{name}"), name

        def answered(name: str, outcome: users.Outcome) -> None:
            seen.append((name, outcome.status, outcome.header("x-served-by")))
            assert outcome.body == b'{"predictions": ["' + name.encode() + b'"]}'
            assert outcome.seconds >= 0

        run = users.closed_loop(
            f"http://127.0.0.1:{server.port}",
            1,
            pick,
            answered,
            duration_s=30,
            max_requests=25,
            seed=7,
        )
        return seen, asyncio.ensure_future(run)

    first, run = run_once()
    await run
    second, run = run_once()
    await run
    assert len(first) == 25
    assert {(status, header) for _, status, header in first} == {(200, "test")}
    assert first == second  # the same seed: the same requests in the same order
    assert server.connections == 2  # one kept-alive connection a run


async def test_a_list_run_sends_each_request_once_across_its_users(server: Server) -> None:
    todo = iter([f"/chunked/c{i}" for i in range(20)] + [f"/close/k{i}" for i in range(5)])
    answers: dict[str, users.Outcome] = {}

    def pick(rng: random.Random) -> tuple[bytes, str] | None:
        path = next(todo, None)
        return None if path is None else (_post(server.port, path), path)

    await users.closed_loop(
        f"http://127.0.0.1:{server.port}",
        4,
        pick,
        answers.__setitem__,
        duration_s=30,
        max_requests=1000,
    )
    assert sorted(answers) == sorted(server.paths)
    assert len(answers) == 25
    for path, outcome in answers.items():
        name = path.rsplit("/", 1)[1]
        assert (outcome.status, outcome.error) == (200, "")
        assert outcome.body == b'{"predictions": ["' + name.encode() + b'"]}'
    # A connection the server closes is opened again, not counted as an error.
    assert server.connections >= 5


async def test_a_run_ends_at_its_time_or_when_stopped(server: Server) -> None:
    url = f"http://127.0.0.1:{server.port}"
    count = 0

    def pick(rng: random.Random) -> tuple[bytes, None]:
        return _post(server.port, "/predictions/t"), None

    def answered(_: None, outcome: users.Outcome) -> None:
        nonlocal count
        count += 1

    loop = asyncio.get_running_loop()
    started = loop.time()
    await users.closed_loop(url, 2, pick, answered, duration_s=0.2, max_requests=10**9)
    assert 0.19 <= loop.time() - started < 5  # uvloop's clock counts milliseconds
    assert count > 0

    stop = asyncio.Event()
    stopped_at = 0

    def answered_then_stop(_: None, outcome: users.Outcome) -> None:
        nonlocal stopped_at
        stopped_at += 1
        if stopped_at == 10:
            stop.set()

    await users.closed_loop(
        url, 1, pick, answered_then_stop, duration_s=60, max_requests=10**9, stop=stop
    )
    assert stopped_at == 10


async def test_refused_connections_and_timeouts_are_outcomes(server: Server) -> None:
    refused: list[users.Outcome] = []
    await users.closed_loop(
        f"http://127.0.0.1:{free_port()}",  # nothing listens there
        2,
        lambda rng: (b"", None),
        lambda _, outcome: refused.append(outcome),
        duration_s=30,
        max_requests=6,
    )
    assert [(o.status, o.error) for o in refused] == [(0, users.CONNECT)] * 6

    silent: list[users.Outcome] = []
    await users.closed_loop(
        f"http://127.0.0.1:{server.port}",
        2,
        lambda rng: (_post(server.port, "/silent"), None),
        lambda _, outcome: silent.append(outcome),
        duration_s=30,
        max_requests=2,
        timeout_s=0.2,
    )
    assert [(o.status, o.error) for o in silent] == [(0, users.TIMEOUT)] * 2
    assert all(o.seconds >= 0.15 for o in silent)


async def test_only_loopback_addresses_take_the_load() -> None:
    for url in ("http://10.1.2.3:8080", "http://example.com", "http://0.0.0.0:80"):
        with pytest.raises(ValueError, match="loopback addresses only"):
            await users.closed_loop(
                url, 1, lambda rng: (b"", None), lambda _, o: None, duration_s=1, max_requests=1
            )
    assert users.loopback("http://127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert users.loopback("http://[::1]:9000") == ("::1", 9000)
    assert users.loopback("http://localhost") == ("localhost", 80)


@pytest.mark.parametrize(
    ("asks", "waits", "late", "max_lag_us"),
    [
        # Every ask on time: each waits for its own slot, 10 ms apart.
        ([0.0, 0.0, 0.0], [0.0, 0.01, 0.02], 0, 0.0),
        # A send 0.5 ms after its slot is not late; one 5 ms after it is.
        ([0.0, 0.0105, 0.025], [0.0, 0.0, 0.0], 1, 5000.0),
    ],
)
def test_the_open_loop_hands_out_slots_and_counts_the_late_sends(
    asks: list[float], waits: list[float], late: int, max_lag_us: float
) -> None:
    schedule = users.Schedule(rate=100.0)
    assert [pytest.approx(schedule.take(now), abs=1e-9) for now in asks] == waits
    assert (schedule.sent, schedule.late) == (len(asks), late)
    assert schedule.max_lag_us == pytest.approx(max_lag_us, abs=1e-3)


async def test_pyload_prints_wrks_result_from_the_users(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_PATTERN", "single")
    monkeypatch.setenv("BENCH_MODEL", "one")
    monkeypatch.setenv("BENCH_THREAD_RATE", "200")
    result = await pyload.run(f"http://127.0.0.1:{server.port}/", 0.25, 2)
    requests = result["requests"]
    assert isinstance(requests, int) and requests > 0
    assert set(server.paths) == {"/predictions/one"}
    assert result["statuses"] == {}
    assert result["errors"] == dict.fromkeys(("connect", "read", "write", "status", "timeout"), 0)
    opened = result["open"]
    assert isinstance(opened, dict) and opened["thread_rate"] == 200.0
    assert opened["sent"] >= requests
