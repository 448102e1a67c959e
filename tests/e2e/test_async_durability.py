"""Asynchronous requests survive the real server's death: ``mmserver serve`` killed with SIGKILL
while requests are queued and running, started again on the same ``state_dir``, finishes every
accepted request exactly once (a second server on that ``state_dir`` meanwhile is refused);
SIGTERM lets running requests end within ``drain_timeout`` and leaves the queued ones for the
next start.

The model waits at a gate file before it computes and records each row it computes, so the test
holds requests running for as long as it likes and counts what was computed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mmserver.asynchronous.journal import Journal, State
from mmserver.commands.launch import Child, Serve
from tests.behaviour_models import (
    handler_models,
    make_gated_recording_dir,
    make_recording_dir,
    make_slow_load_dir,
)
from tests.e2e.server_process import (
    ROOT,
    ServerProcess,
    descendants,
    free_port,
    until,
    wait_gone,
)
from tests.models import make_linear_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GATED = 12
FAST = 4
#: Requests of each of two models sent at once (accepted and ended in shared commits).
TOGETHER = 40


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.store = tmp_path / "store"
        self.store.mkdir()
        self.gate = tmp_path / "gate"
        self.log = tmp_path / "computed.log"
        self.state = tmp_path / "state"
        self.outputs = tmp_path / "outputs"
        self.tmp = tmp_path
        make_linear_archive(self.store / "sklearn-0.tar.gz")
        make_gated_recording_dir(
            self.store / "gated", self.gate, self.log, batch_size=1, maxWorkers=1
        )
        self.starts = 0

    def server(self, *args: str) -> ServerProcess:
        self.starts += 1
        return ServerProcess(
            self.store,
            self.tmp / f"server-{self.starts}.log",
            "--backend-processes",
            "1",
            "--heavy-processes",
            "0",
            "--state-dir",
            str(self.state),
            "--async-output-path",
            str(self.outputs),
            *args,
        )

    def computed(self) -> collections.Counter[float]:
        if not self.log.exists():
            return collections.Counter()
        return collections.Counter(float(v) for v in self.log.read_text().split())


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


async def accept(session: aiohttp.ClientSession, url: str, model: str, value: float) -> str:
    """One asynchronous request with an inline body; its inference id, once answered 202."""
    async with session.post(
        f"{url}/endpoints/{model}/async-invocations",
        data=json.dumps([[value]]),
        headers={
            "X-Amzn-SageMaker-Content-Type": "application/json",
            "X-Amzn-SageMaker-Inference-Id": f"{model}-{value:g}",
        },
    ) as response:
        assert response.status == 202, await response.text()
        inference_id: str = (await response.json())["InferenceId"]
        return inference_id


async def status(session: aiohttp.ClientSession, url: str, inference_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/async-invocations/{inference_id}") as response:
        assert response.status == 200, await response.text()
        described: dict[str, Any] = await response.json()
        return described


async def until_status(
    session: aiohttp.ClientSession, url: str, inference_id: str, wanted: str, timeout: float = 60
) -> None:
    """Ask the state call until request ``inference_id`` is ``wanted``."""

    async def reached() -> bool:
        return bool((await status(session, url, inference_id))["Status"] == wanted)

    await until(reached, timeout, f"{inference_id} {wanted}")


async def until_predicting(session: aiohttp.ClientSession, url: str, model: str) -> None:
    """Wait until a worker of ``model`` has sent its batch to the backend (held at the gate)."""

    async def busy() -> bool:
        async with session.get(f"{url}/models/{model}") as response:
            described = await response.json()
        groups = described[0]["models"][0]["workerGroups"] if response.status == 200 else []
        return any(w["status"] == "BUSY" for g in groups for w in g["workers"])

    await until(busy, 60, f"{model} predicting")


def states(setup: Setup) -> dict[str, State]:
    """Every request's state as the journal on disk says (the server is not running)."""
    journal = Journal(setup.state)
    try:
        return journal.states()
    finally:
        journal.close()


async def second_server(setup: Setup) -> tuple[int, str]:
    """``mmserver serve`` on ``setup``'s state_dir, run to its end: its exit code and output."""
    log = setup.tmp / "second-server.log"
    server = Child(
        Serve(
            setup.store,
            free_port(),
            backend_processes=1,
            args=(
                "--state-dir",
                str(setup.state),
                "--trusted-models",
                handler_models(setup.store),
                "--no-isolate-trusted",
            ),
        ),
        log,
        cwd=ROOT,
    )
    server.start()
    try:
        code = await asyncio.to_thread(server.wait_exit, 60)
    finally:
        await asyncio.to_thread(server.kill)
    return code, log.read_text(errors="replace")


async def test_sigkill_then_restart_finishes_every_accepted_request_once(setup: Setup) -> None:
    async with aiohttp.ClientSession() as session:
        async with setup.server() as server:
            fast = [await accept(session, server.url, "sklearn-0", i) for i in range(FAST)]
            for inference_id in fast:
                await until_status(session, server.url, inference_id, "done")
            written = {p.name: p.stat().st_mtime_ns for p in setup.outputs.iterdir()}
            assert sorted(written) == sorted(f"{i}.out" for i in fast)
            gated = [await accept(session, server.url, "gated", i) for i in range(GATED)]
            # One runs (held at the gate in the backend process), the others are queued.
            await until_status(session, server.url, gated[0], "running")
            assert (await status(session, server.url, gated[1]))["Status"] == "queued"
            # A second server on the same state_dir does not start, and names the first.
            code, printed = await second_server(setup)
            assert code == 2, printed
            assert (
                f"option state_dir={setup.state.resolve()}: another mmserver (pid {server.pid}) "
                "is using it; give each server its own state_dir"
            ) in printed
            family = descendants(server.pid) | {server.pid}
            for pid in family:
                os.kill(pid, signal.SIGKILL)
            await server.wait(10)
            await wait_gone(family)
        assert setup.computed() == collections.Counter()  # nothing passed the gate
        journal = states(setup)
        assert journal[gated[0]] is State.RUNNING
        assert [journal[i] for i in gated[1:]] == [State.QUEUED] * (GATED - 1)

        setup.gate.touch()
        async with setup.server() as server:
            for inference_id in gated:
                await until_status(session, server.url, inference_id, "done")
            for inference_id in fast:
                assert (await status(session, server.url, inference_id))["Status"] == "done"
    # Every accepted request has one output, with its answer; each row was computed once, and
    # the outputs written before the kill were not written again.
    outputs = {p.name for p in setup.outputs.iterdir()}
    assert outputs == {f"{i}.out" for i in fast + gated}
    for i in range(GATED):
        answer = json.loads((setup.outputs / f"gated-{i}.out").read_bytes())
        assert answer == {"predictions": [2.0 * i]}
    assert setup.computed() == collections.Counter({float(i): 1 for i in range(GATED)})
    for name, mtime in written.items():
        assert (setup.outputs / name).stat().st_mtime_ns == mtime
    assert not list((setup.state / "inputs").iterdir())


async def test_requests_accepted_together_survive_sigkill_after_their_202s(setup: Setup) -> None:
    make_recording_dir(setup.store / "recording", setup.tmp / "recorded.log", batch_size=1)
    async with aiohttp.ClientSession() as session:
        async with setup.server() as server:
            # Sent at once, model by model: accepted in shared commits. The recording model's
            # first request runs before any gated one is queued, so an answer comes; once the
            # gated model holds the backend process, the others wait there.
            recording = await asyncio.gather(
                *(accept(session, server.url, "recording", i) for i in range(TOGETHER))
            )
            gated = await asyncio.gather(
                *(accept(session, server.url, "gated", i) for i in range(TOGETHER))
            )
            accepted = recording + gated

            async def answered() -> bool:
                found = [await status(session, server.url, i) for i in recording]
                return any(s["Status"] == "done" for s in found)

            # Killed once an answer has come.
            await until(answered, 60, "a recording request done")
            family = descendants(server.pid) | {server.pid}
            for pid in family:
                os.kill(pid, signal.SIGKILL)
            await server.wait(10)
            await wait_gone(family)
        # Every request answered 202 is in the journal.
        journal = states(setup)
        assert sorted(journal) == sorted(accepted)
        assert set(journal.values()) <= {State.QUEUED, State.RUNNING, State.DONE}
        assert setup.computed() == collections.Counter()  # nothing passed the gate
        written = {p.name: p.stat().st_mtime_ns for p in _outputs(setup)}

        setup.gate.touch()
        async with setup.server() as server:
            for inference_id in accepted:
                await until_status(session, server.url, inference_id, "done")
    # One output each, with its answer; those written before the kill not written again.
    assert sorted(p.name for p in _outputs(setup)) == sorted(f"{i}.out" for i in accepted)
    for model in ("recording", "gated"):
        for i in range(TOGETHER):
            answer = json.loads((setup.outputs / f"{model}-{i}.out").read_bytes())
            assert answer == {"predictions": [2.0 * i]}
    for name, mtime in written.items():
        assert (setup.outputs / name).stat().st_mtime_ns == mtime
    assert setup.computed() == collections.Counter({float(i): 1 for i in range(TOGETHER)})
    assert not list((setup.state / "inputs").iterdir())


def _outputs(setup: Setup) -> list[Path]:
    """The answers in the output folder (a write a kill cut short leaves a hidden part)."""
    if not setup.outputs.exists():
        return []
    return [p for p in setup.outputs.iterdir() if p.name.endswith(".out")]


async def test_sigterm_lets_running_requests_end_and_keeps_the_queued_ones(
    setup: Setup,
) -> None:
    async with aiohttp.ClientSession() as session:
        async with setup.server("--drain-timeout", "60") as server:
            gated = [await accept(session, server.url, "gated", i) for i in range(GATED)]
            await until_status(session, server.url, gated[0], "running")
            await until_predicting(session, server.url, "gated")
            server.signal(signal.SIGTERM)

            # Once the server reports not ready it starts nothing new: the gate opens then.
            async def not_ready() -> bool:
                async with session.get(f"{server.url}/ping") as response:
                    return response.status == 503

            await until(not_ready, 10, "the server reporting not ready")
            setup.gate.touch()
            assert await server.wait(60) == 0
        journal = states(setup)
        assert journal[gated[0]] is State.DONE
        assert [journal[i] for i in gated[1:]] == [State.QUEUED] * (GATED - 1)
        assert {p.name for p in setup.outputs.iterdir()} == {f"{gated[0]}.out"}
        assert setup.computed() == collections.Counter({0.0: 1})

        async with setup.server() as server:
            for inference_id in gated:
                await until_status(session, server.url, inference_id, "done")
    assert setup.computed() == collections.Counter({float(i): 1 for i in range(GATED)})


async def test_sigterm_past_drain_timeout_requeues_the_running_request(setup: Setup) -> None:
    async with aiohttp.ClientSession() as session:
        async with setup.server("--drain-timeout", "1") as server:
            gated = [await accept(session, server.url, "gated", i) for i in range(3)]
            # Its batch is in the backend, held at the gate (not its model's load: a stop
            # during a load is another case).
            await until_predicting(session, server.url, "gated")
            server.signal(signal.SIGTERM)

            # Past the drain timeout the running request goes back to the queue (the journal
            # says so while the server still stops); only then may its prediction, held in the
            # backend process, end: its answer comes too late to be written.
            async def queued_again() -> bool:
                return states(setup)[gated[0]] is State.QUEUED

            await until(queued_again, 30, "the running request queued again")
            setup.gate.touch()
            assert await server.wait(60) == 0
        assert states(setup) == dict.fromkeys(gated, State.QUEUED)
        assert not setup.outputs.exists() or not list(setup.outputs.iterdir())

        async with setup.server() as server:
            for inference_id in gated:
                await until_status(session, server.url, inference_id, "done")
    assert {p.name for p in setup.outputs.iterdir()} == {f"{i}.out" for i in gated}


async def test_sigterm_during_its_models_load_keeps_the_request_queued(setup: Setup) -> None:
    started, load_gate = setup.tmp / "load-started", setup.tmp / "load-gate"
    make_slow_load_dir(setup.store / "slow", started, load_gate, batch_size=1, maxWorkers=1)
    async with aiohttp.ClientSession() as session:
        async with setup.server("--drain-timeout", "2") as server:
            waiting = await accept(session, server.url, "slow", 1)
            await until(lambda: asyncio.to_thread(started.exists), 60, "the model's load")
            server.signal(signal.SIGTERM)
            # The load, held in a backend process by user code, does not hold the stop: the
            # server ends within its drain timeout and a margin, the request still queued.
            assert await server.wait(20) == 0
        assert states(setup) == {waiting: State.QUEUED}
        load_gate.touch()
        async with setup.server() as server:
            await until_status(session, server.url, waiting, "done")
    answer = json.loads((setup.outputs / f"{waiting}.out").read_bytes())
    assert answer == {"predictions": [2.0]}
