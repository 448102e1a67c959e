"""SIGTERM under load, against the real server with real backend processes: every accepted
request gets exactly one complete answer, nothing is cut, the processes go away, exit code 0."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.behaviour_models import make_gated_dir, make_sleeping_dir, make_slow_load_dir
from tests.e2e.server_process import ServerProcess, descendants, metric_total, until, wait_gone
from tests.models import make_linear_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SLOW_MODELS = 4
REQUESTS = 400


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    make_linear_archive(root / "sklearn-0.tar.gz")
    for i in range(SLOW_MODELS):
        # 10 ms a batch, one row a batch: 400 requests keep two processes busy for ~2 s.
        make_sleeping_dir(root / f"slow-{i}", 0.01, maxWorkers=2, batch_size=1)
    return root


async def queued(session: aiohttp.ClientSession, url: str) -> float:
    return await metric_total(session, url, "mmserver_queue_length{", "mmserver_queue_length ")


async def test_sigterm_under_load_answers_every_accepted_request(
    store: Path, tmp_path: Path
) -> None:
    async with ServerProcess(
        store, tmp_path / "server.log", "--backend-processes", "2", "--drain-timeout", "300"
    ) as server:
        connector = aiohttp.TCPConnector(limit=REQUESTS)
        async with aiohttp.ClientSession(connector=connector) as session:
            for i in range(SLOW_MODELS):  # load them, so the load is all predictions
                async with session.post(f"{server.url}/predictions/slow-{i}", json=[[1.0]]) as r:
                    assert r.status == 200

            async def one(i: int) -> tuple[int, object]:
                body = [[float(i)]]
                async with session.post(
                    f"{server.url}/predictions/slow-{i % SLOW_MODELS}", json=body
                ) as response:
                    return response.status, json.loads(await response.read())

            tasks = [asyncio.ensure_future(one(i)) for i in range(REQUESTS)]
            # Signal once most requests are queued in the server, i.e. accepted.
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 20
            while await queued(session, server.url) < REQUESTS / 2:
                assert loop.time() < give_up, "the load never queued up"
            family = descendants(server.pid)
            assert len(family) >= 3  # fork server and two backend processes
            server.signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks, return_exceptions=True)

            # Every request was sent before the signal: each one has exactly one complete
            # answer, the right one, or 503 if it had not reached a model before the signal.
            errors = [r for r in results if isinstance(r, BaseException)]
            assert errors == []
            answered = 0
            for i, (status, body) in enumerate(results):  # type: ignore[misc]
                if status == 503:
                    assert body["type"] == "WlmShutdownException"  # type: ignore[index]
                    continue
                assert status == 200, body
                assert body == {"predictions": [2.0 * i]}
                answered += 1
            assert answered >= REQUESTS / 2  # at least all that were queued at the signal

            # A new connection after the signal is refused (or answered 503 while draining).
            try:
                async with (
                    aiohttp.ClientSession() as fresh,
                    fresh.post(f"{server.url}/predictions/sklearn-0", json=[[0.5]]) as response,
                ):
                    assert response.status == 503
                    assert (await response.json())["type"] == "WlmShutdownException"
            except aiohttp.ClientConnectionError:
                pass
        # Once every accepted request is answered the stop goes on: an idle worker left by
        # the drain does not hold it for the whole drain timeout (300 s here).
        assert await server.wait(60) == 0
        await wait_gone(family)  # backend processes, fork server, resource tracker
        log = server.log()
        assert "shutting down" in log and "mmserver stopped" in log
        assert "Traceback" not in log


async def busy(session: aiohttp.ClientSession, url: str, model: str) -> bool:
    """Whether a worker of ``model`` has sent its batch to the backend."""
    async with session.get(f"{url}/models/{model}") as response:
        if response.status != 200:
            return False
        groups = (await response.json())[0]["models"][0]["workerGroups"]
    return any(w["status"] == "BUSY" for g in groups for w in g["workers"])


@pytest.mark.parametrize("held", ["prediction", "load"])
async def test_work_held_in_a_backend_past_the_drain_does_not_hold_the_stop(
    tmp_path: Path, held: str
) -> None:
    """A prediction (or a model's load) that user code holds in a backend process for longer
    than the drain: the request is answered 503, the server stops (it does not wait for the
    backend process to answer an unload), exit code 0, no process left."""
    root = tmp_path / "store"
    gate, started = tmp_path / "gate", tmp_path / "started"
    if held == "prediction":
        make_gated_dir(root / "held", gate, batch_size=1, maxWorkers=1)
    else:
        make_slow_load_dir(root / "held", started, gate, batch_size=1, maxWorkers=1)
    async with ServerProcess(
        root, tmp_path / "server.log", "--backend-processes", "1", "--drain-timeout", "1"
    ) as server:
        family = set(descendants(server.pid))
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(
                session.post(f"{server.url}/predictions/held", json=[[1.0]])
            )
            if held == "prediction":
                await until(lambda: busy(session, server.url, "held"), 60, "the batch sent")
            else:
                await until(lambda: asyncio.to_thread(started.exists), 60, "the load started")
            family |= set(descendants(server.pid))
            server.signal(signal.SIGTERM)
            async with await call as response:
                assert response.status == 503
                assert (await response.json())["type"] == "WlmShutdownException"
            # Held up to 60 s (30 s for the load) by its user code: the stop does not wait.
            assert await server.wait(25) == 0
        await wait_gone(family)
        log = server.log()
        assert "mmserver stopped" in log and "Traceback" not in log
        assert "exception was never retrieved" not in log


async def _send(writer: asyncio.StreamWriter, path: str, body: bytes = b"[[1.0]]") -> None:
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer off a kept-alive connection: status, headers (lower-case), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


async def test_a_drain_tells_kept_alive_clients_to_go_elsewhere(tmp_path: Path) -> None:
    """SIGTERM: an idle kept-alive connection is closed at once (not at the drain's end), the
    answer owed on a busy one says Connection: close and the connection closes after it, and a
    request on a new connection is answered 503 with Retry-After and Connection: close."""
    root = tmp_path / "store"
    root.mkdir()
    make_linear_archive(root / "sklearn-0.tar.gz")
    gate = tmp_path / "gate"
    make_gated_dir(root / "gated", gate, maxWorkers=1)
    async with ServerProcess(
        root, tmp_path / "server.log", "--backend-processes", "1", "--drain-timeout", "120"
    ) as server:
        host, port = "127.0.0.1", server.port
        idle_reader, idle_writer = await asyncio.open_connection(host, port)
        await _send(idle_writer, "/predictions/sklearn-0")
        status, headers, _ = await _answer(idle_reader)
        assert status == 200 and headers.get("connection", "").lower() != "close"
        busy_reader, busy_writer = await asyncio.open_connection(host, port)
        await _send(busy_writer, "/predictions/gated", b"[[3.0]]")
        async with aiohttp.ClientSession() as session:
            await until(lambda: busy(session, server.url, "gated"), 60, "the gated batch sent")
        server.signal(signal.SIGTERM)
        # The idle connection is closed by the server while the drain still waits (the gate).
        assert await asyncio.wait_for(idle_reader.read(), 30) == b""
        # A new connection while the drain lasts: 503, Retry-After, Connection: close.
        fresh_reader, fresh_writer = await asyncio.open_connection(host, port)
        await _send(fresh_writer, "/predictions/sklearn-0")
        status, headers, body = await _answer(fresh_reader)
        assert status == 503 and json.loads(body)["type"] == "WlmShutdownException"
        assert headers["retry-after"] == "1" and headers["connection"].lower() == "close"
        assert await asyncio.wait_for(fresh_reader.read(), 30) == b""
        # So does one aiohttp answers (not an inference request).
        ping_reader, ping_writer = await asyncio.open_connection(host, port)
        ping_writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, _ = await _answer(ping_reader)
        assert status == 503 and headers["connection"].lower() == "close"
        assert await asyncio.wait_for(ping_reader.read(), 30) == b""
        # The busy connection's answer comes once the gate opens, saying it is the last.
        gate.touch()
        status, headers, body = await _answer(busy_reader)
        assert status == 200 and json.loads(body) == {"predictions": [6.0]}
        assert headers["connection"].lower() == "close"
        assert await asyncio.wait_for(busy_reader.read(), 30) == b""
        for writer in (idle_writer, busy_writer, fresh_writer, ping_writer):
            writer.close()
        assert await server.wait(60) == 0
