"""Faults injected into the real server (``mmserver serve`` with real backend processes): a
corrupted archive, a full queue, a backend killed while a model loads into it, and stop signals
that arrive while models load or that reach the whole process group (Ctrl-C, systemd).

The random part (killing backends at arbitrary moments under load) is ``scripts/chaos``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from tests.behaviour_models import make_gated_dir, make_slow_load_dir
from tests.e2e.server_process import (
    ServerProcess,
    alive,
    descendants,
    unpacking,
    unpacking_pids,
    until,
    wait_gone,
)
from tests.models import make_linear_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]


async def predict(
    session: aiohttp.ClientSession, url: str, name: str, x: float, path: str = "predictions"
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    target = f"{url}/predictions/{name}" if path == "predictions" else f"{url}/invocations"
    headers = {} if path == "predictions" else {"X-Amzn-SageMaker-Target-Model": name}
    async with session.post(target, json=[[x]], headers=headers) as response:
        return response.status, json.loads(await response.read()), response.headers


async def describe(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(f"{url}/models/{name}") as response:
        assert response.status == 200
        [workflow] = await response.json()
        model: dict[str, Any] = workflow["models"][0]
        return model


def linear(x: float) -> Any:
    """What the reference linear model predicts, give or take its training noise."""
    return pytest.approx(2.0 * x + 1.0, rel=0.01, abs=0.05)


# ------------------------------------------------------------------------------------------------
# A corrupted archive
# ------------------------------------------------------------------------------------------------


async def test_corrupted_archive_keeps_serving_until_unloaded_then_fails_clearly(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    archive = make_linear_archive(store / "victim.tar.gz")
    make_linear_archive(store / "bystander.tar.gz")
    (store / "unreadable").mkdir()
    (store / "unreadable" / "model.joblib").write_bytes(b"not a joblib file")
    (store / "weightless").mkdir()
    (store / "weightless" / "model.py").write_text(
        "def load(model_dir, properties):\n    raise RuntimeError('no weights here')\n\n"
        "def predict(model, batch):\n    return batch\n"
    )
    good = archive.read_bytes()
    async with (
        ServerProcess(store, tmp_path / "server.log", "--backend-processes", "2") as server,
        aiohttp.ClientSession() as session,
    ):
        for name in ("victim", "bystander"):
            status, body, _ = await predict(session, server.url, name, 0.5)
            assert status == 200 and body["predictions"][0] == pytest.approx(2.0, abs=0.05)

        # Corrupted in the store while served: the loaded copy keeps answering, also from the
        # backend processes that replace killed ones (they reload the unpacked copy).
        archive.write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(len(good)))
        status, body, _ = await predict(session, server.url, "victim", 1.5)
        assert status == 200 and body["predictions"][0] == pytest.approx(4.0, abs=0.05)
        killed = backend_pids(server.pid)
        assert len(killed) == 2
        for pid in killed:
            os.kill(pid, signal.SIGKILL)

        async def replaced() -> bool:
            current = backend_pids(server.pid)
            return len(current) == 2 and not set(current) & set(killed)

        await until(replaced, 10, "both backend processes replaced")
        for x in (0.0, 1.0, 2.0):
            status, body, _ = await predict(session, server.url, "victim", x)
            assert status == 200, body
            assert body["predictions"][0] == linear(x)

        # Unloaded: the next load reads the corrupt archive and fails with a 500 naming the
        # model and the archive, on every path; the other model keeps answering.
        async with session.delete(f"{server.url}/models/victim") as response:
            assert response.status == 200
        for path in ("predictions", "invocations"):
            status, body, headers = await predict(session, server.url, "victim", 0.5, path)
            assert status == 500, body
            assert body["type"] == "EngineException"
            assert "model victim" in body["message"]
            assert "victim.tar.gz cannot be unpacked" in body["message"]
            assert body["message"].startswith(
                "model victim: archive victim.tar.gz cannot be unpacked: "
            )
            if path == "invocations":
                assert headers["x-amzn-ErrorType"] == "InternalFailure"
        status, body, _ = await predict(session, server.url, "bystander", 0.5)
        assert status == 200 and body["predictions"][0] == pytest.approx(2.0, abs=0.05)
        assert (await describe(session, server.url, "victim"))["status"] == "FAILED"
        # A load that fails in a backend process names its model once, as the unpacking does.
        status, body, _ = await predict(session, server.url, "unreadable", 0.5)
        assert status == 500, body
        assert body["message"].startswith(
            "model unreadable failed to load: model.joblib cannot be loaded: "
        )
        assert body["message"].count("unreadable") == 1
        status, body, _ = await predict(session, server.url, "weightless", 0.5)
        assert status == 500, body
        assert body["message"].startswith(
            "model weightless: model.py load() failed: RuntimeError: no weights here"
        )
        assert body["message"].count("weightless") == 1

        # Repaired: a later request loads it again (failed loads are retried after 2 s).
        archive.write_bytes(good)

        async def repaired() -> bool:
            status, _, _ = await predict(session, server.url, "victim", 0.5)
            return status == 200

        await until(repaired, 10, "the repaired archive served")
        assert "Traceback" not in server.log()


def backend_pids(server_pid: int) -> list[int]:
    """The backend processes of the server: the children of its fork server."""
    try:
        children = psutil.Process(server_pid).children()
    except psutil.Error:
        return []
    for child in children:
        try:
            if any("forkserver" in part for part in child.cmdline()):
                return sorted(
                    p.pid for p in child.children() if alive(p.pid) and not unpacking(p.pid)
                )
        except psutil.Error:
            continue
    return []


# ------------------------------------------------------------------------------------------------
# A full queue
# ------------------------------------------------------------------------------------------------


async def test_full_queue_refuses_that_model_only_and_answers_what_it_queued(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    gate = tmp_path / "gate"
    others = ("sklearn-0", "sklearn-1")
    for name in others:
        make_linear_archive(store / f"{name}.tar.gz")
    make_gated_dir(
        store / "gated", gate, minWorkers=1, maxWorkers=1, batch_size=1, job_queue_size=2
    )
    async with (
        ServerProcess(store, tmp_path / "server.log", "--backend-processes", "3") as server,
        aiohttp.ClientSession() as session,
    ):
        gate.touch()
        for name in (*others, "gated"):  # loaded, each on its own backend process
            status, _, _ = await predict(session, server.url, name, 0.5)
            assert status == 200
        gate.unlink()

        # One request runs (held at the gate), then two fill the queue.
        held = [asyncio.ensure_future(predict(session, server.url, "gated", 0.0))]

        async def state(queued: int) -> bool:
            described = await describe(session, server.url, "gated")
            busy = [w for w in described["workerGroups"][0]["workers"] if w["status"] == "BUSY"]
            return described["requestInQueue"] == queued and len(busy) == 1

        await until(lambda: state(0), 10, "gated model running one request")
        held += [
            asyncio.ensure_future(predict(session, server.url, "gated", float(i))) for i in (1, 2)
        ]
        await until(lambda: state(2), 10, "gated model running one request with two queued")

        # Refused at once, on every path, with Retry-After; the other models keep answering.
        for i in range(10):
            path = "predictions" if i % 2 else "invocations"
            status, body, headers = await predict(session, server.url, "gated", 9.0, path)
            assert status == 503, body
            assert body["type"] == "WlmCapacityException"
            assert int(headers["Retry-After"]) >= 1
            if path == "invocations":
                assert headers["x-amzn-ErrorType"] == "ServiceUnavailable"
            for name in others:
                status, body, _ = await predict(session, server.url, name, float(i))
                assert status == 200, body
                assert body["predictions"][0] == linear(i)
        assert not any(task.done() for task in held)

        # The gate opens: everything accepted is answered, in full, and the model accepts again.
        gate.touch()
        results = await asyncio.wait_for(asyncio.gather(*held), 20)
        assert [(status, body) for status, body, _ in results] == [
            (200, {"predictions": [2.0 * i]}) for i in range(3)
        ]
        status, body, _ = await predict(session, server.url, "gated", 4.0)
        assert (status, body) == (200, {"predictions": [8.0]})


# ------------------------------------------------------------------------------------------------
# A backend killed while a model loads into it
# ------------------------------------------------------------------------------------------------


async def test_backend_killed_while_loading_a_model_loads_it_again(tmp_path: Path) -> None:
    """The load is tried again in the replacement process: the requests that waited for it are
    answered, and the model is not marked failed for a crash that was not its own."""
    store = tmp_path / "store"
    store.mkdir()
    started, gate = tmp_path / "started", tmp_path / "gate"
    make_slow_load_dir(store / "slow-load", started, gate)
    make_linear_archive(store / "sklearn-0.tar.gz")
    async with (
        ServerProcess(store, tmp_path / "server.log", "--backend-processes", "2") as server,
        aiohttp.ClientSession() as session,
    ):
        waiting = [
            asyncio.ensure_future(predict(session, server.url, "slow-load", float(i)))
            for i in range(5)
        ]

        async def loading() -> bool:
            return started.is_file() and started.read_text() != ""

        await until(loading, 10, "the model loading in a backend process")
        killed = int(started.read_text())
        started.unlink()
        os.kill(killed, signal.SIGKILL)
        await until(loading, 10, "the model loading again in the replacement process")
        assert int(started.read_text()) != killed
        gate.touch()
        results = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        assert [(status, body) for status, body, _ in results] == [
            (200, {"predictions": [2.0 * i]}) for i in range(5)
        ]
        assert (await describe(session, server.url, "slow-load"))["status"] == "Healthy"
        status, _, _ = await predict(session, server.url, "sklearn-0", 0.5)
        assert status == 200
        assert "loading it again" in server.log()
        # ps names the processes, the replacement too.
        titles = sorted(process_title(pid) for pid in backend_pids(server.pid))
        assert titles == ["mmserver: backend light 0", "mmserver: backend light 1"]
        unpackers = unpacking_pids(server.pid)
        assert unpackers
        assert {process_title(pid) for pid in unpackers} == {"mmserver: unpacking"}


def process_title(pid: int) -> str:
    """What ``ps`` shows for ``pid``: its command line, as the process may have rewritten it."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode().strip()


# ------------------------------------------------------------------------------------------------
# Stop signals
# ------------------------------------------------------------------------------------------------


class GroupServer(ServerProcess):
    """The server as the leader of its own process group, as a shell or systemd starts it, so a
    signal can reach the whole group (frontend, fork server, resource tracker, backends)."""

    new_session = True

    def signal_group(self, signum: int) -> None:
        os.killpg(self.pid, signum)


GATED_MODELS = 2
REQUESTS = 120


async def _stop_under_load(tmp_path: Path, send: Callable[[GroupServer], None]) -> None:
    """Start the server, have it accept ``REQUESTS`` requests that wait at a gate, ``send`` it a
    stop signal, open the gate, and check that every request has exactly one complete answer,
    the right one, that the server exits 0 and leaves no process behind."""
    store = tmp_path / "store"
    store.mkdir()
    gate = tmp_path / "gate"
    for i in range(GATED_MODELS):
        # One request a batch, so that queued plus running jobs count the accepted requests.
        make_gated_dir(store / f"gated-{i}", gate, maxWorkers=2, batch_size=1)
    async with GroupServer(
        store, tmp_path / "server.log", "--backend-processes", "2", "--drain-timeout", "20"
    ) as server:
        connector = aiohttp.TCPConnector(limit=REQUESTS + 10)
        async with aiohttp.ClientSession(connector=connector) as session:
            gate.touch()
            for i in range(GATED_MODELS):
                status, _, _ = await predict(session, server.url, f"gated-{i}", 1.0)
                assert status == 200
            gate.unlink()
            tasks = [
                asyncio.ensure_future(predict(session, server.url, f"gated-{i % GATED_MODELS}", i))
                for i in range(REQUESTS)
            ]

            async def all_accepted() -> bool:
                accepted = 0
                for i in range(GATED_MODELS):
                    described = await describe(session, server.url, f"gated-{i}")
                    workers = described["workerGroups"][0]["workers"]
                    accepted += described["requestInQueue"] + sum(
                        1 for w in workers if w["status"] == "BUSY"
                    )
                return accepted == REQUESTS

            await until(all_accepted, 15, "every request queued or running")
            family = descendants(server.pid)
            assert len(family) >= 4  # fork server, resource tracker, two backend processes
            send(server)
            await asyncio.sleep(0.2)  # the signal has arrived: nothing has been answered yet
            assert not any(task.done() for task in tasks)
            gate.touch()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        failures = [r for r in results if isinstance(r, BaseException)]
        assert failures == [], failures[:3]
        answers = [(status, body) for status, body, _ in results]  # type: ignore[misc]
        assert answers == [(200, {"predictions": [2.0 * i]}) for i in range(REQUESTS)]
        assert await server.wait(25) == 0
        await wait_gone(family)
        log = server.log()
        assert "mmserver stopped" in log
        assert "Traceback" not in log
        assert " died" not in log  # no backend process died on the way


async def test_ctrl_c_drains_like_sigterm(tmp_path: Path) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group."""
    await _stop_under_load(tmp_path, lambda server: server.signal_group(signal.SIGINT))


async def test_sigterm_to_the_process_group_drains(tmp_path: Path) -> None:
    """systemd (KillMode=control-group, its default) and ``kill -TERM -PGID`` signal every
    process of the server at once: the backend processes must still finish the drain."""
    await _stop_under_load(tmp_path, lambda server: server.signal_group(signal.SIGTERM))


async def test_sigterm_while_models_are_loading(tmp_path: Path) -> None:
    """Requests waiting for a model's load when SIGTERM arrives get one complete answer (503),
    not a dropped connection; requests of loaded models are answered; exit code 0."""
    store = tmp_path / "store"
    store.mkdir()
    started, gate, held = tmp_path / "started", tmp_path / "gate", tmp_path / "held"
    make_slow_load_dir(store / "slow-load", started, gate)
    # One request a batch and one worker, so that queued plus running jobs count the accepted.
    make_gated_dir(store / "held", held, maxWorkers=1, batch_size=1)
    async with (
        ServerProcess(
            store, tmp_path / "server.log", "--backend-processes", "2", "--drain-timeout", "10"
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        held.touch()
        status, _, _ = await predict(session, server.url, "held", 1.0)
        assert status == 200
        held.unlink()
        waiting = [
            asyncio.ensure_future(predict(session, server.url, "slow-load", float(i)))
            for i in range(10)
        ]
        running = [
            asyncio.ensure_future(predict(session, server.url, "held", float(i))) for i in range(10)
        ]

        async def loading_and_accepted() -> bool:
            if not started.is_file():
                return False
            described = await describe(session, server.url, "held")
            workers = described["workerGroups"][0]["workers"]
            busy = sum(1 for w in workers if w["status"] == "BUSY")
            return bool(described["requestInQueue"] + busy == len(running))

        await until(loading_and_accepted, 15, "the load begun and every request accepted")
        family = descendants(server.pid)
        server.signal(signal.SIGTERM)
        loading_results = await asyncio.wait_for(
            asyncio.gather(*waiting, return_exceptions=True), 15
        )
        assert not any(task.done() for task in running)
        gate.touch()  # lets the backend process finish the load and see the pipe close
        held.touch()
        running_results = await asyncio.wait_for(
            asyncio.gather(*running, return_exceptions=True), 15
        )
        for result in loading_results:
            assert not isinstance(result, BaseException), result
            status, body, _ = result
            assert status == 503 and body["type"] == "WlmShutdownException", body
        for i, result in enumerate(running_results):
            assert not isinstance(result, BaseException), result
            assert result[:2] == (200, {"predictions": [2.0 * i]})
        assert await server.wait(15) == 0
        await wait_gone(family)
        assert "Traceback" not in server.log()


# ------------------------------------------------------------------------------------------------
# Churn
# ------------------------------------------------------------------------------------------------


async def test_churn_under_concurrent_load_keeps_the_server_responsive(tmp_path: Path) -> None:
    """Many models, a small loaded-model budget, 16 requests in flight: models are loaded and
    unloaded continuously, and a request for a model whose unload has just finished must not
    spin the event loop (it used to: the server stopped answering at 100 % CPU)."""
    store = tmp_path / "store"
    store.mkdir()
    archive = make_linear_archive(store / "sklearn-0.tar.gz")
    models = [f"sklearn-{i}" for i in range(40)]
    for name in models[1:]:
        os.link(archive, store / f"{name}.tar.gz")
    async with (
        ServerProcess(
            store, tmp_path / "server.log", "--backend-processes", "2", "--max-loaded-models", "20"
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        loop = asyncio.get_running_loop()
        until_time = loop.time() + 3.0
        statuses: dict[int, int] = {}

        async def client(k: int) -> None:
            rng = random.Random(k)
            for _ in range(10_000):  # bounded; in practice until_time ends it
                if loop.time() > until_time:
                    return
                status, body, _ = await asyncio.wait_for(
                    predict(session, server.url, rng.choice(models), 0.5), 10
                )
                statuses[status] = statuses.get(status, 0) + 1
                assert status == 200, body

        await asyncio.wait_for(asyncio.gather(*(client(k) for k in range(16))), 20)
        assert sum(statuses.values()) > 100
        async with session.get(f"{server.url}/metrics") as response:
            text = await response.text()
        evictions = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            # one series over every model (with or without labels)
            if line.startswith(
                ("mmserver_model_evictions_total{", "mmserver_model_evictions_total ")
            )
        )
        assert evictions > 20  # the load did churn
        assert "Traceback" not in server.log()
