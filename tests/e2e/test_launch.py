"""The launcher (:mod:`mmserver.commands.launch`) with the real ``mmserver serve``: ready once
``/ping`` answers, an early exit reported at once with the end of the log, SIGTERM drains the
request in flight, and no process is left behind; and, with small stand-in programs, the kill
after the timeout, the descendants killed after the grace, and the end with the parent."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from mmserver.commands.launch import Child, NotStarted, Serve, http_get, stop_all
from mmserver.commands.procfs import free_port
from tests.behaviour_models import make_gated_dir
from tests.e2e.server_process import ROOT, alive, descendants, until, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _program(text: str) -> list[str]:
    return [sys.executable, "-c", text]


async def _ping_status(port: int) -> int:
    return (await asyncio.to_thread(http_get, port, "/ping"))[0]


async def test_ready_then_sigterm_drains_the_request_in_flight(tmp_path: Path) -> None:
    store = tmp_path / "store"
    gate = tmp_path / "gate"
    make_gated_dir(store / "gated", gate, maxWorkers=1, batch_size=1)
    server = Child(
        Serve(
            store,
            free_port(),
            backend_processes=1,
            args=("--drain-timeout", "60", "--trusted-models", "gated", "--no-isolate-trusted"),
        ),
        tmp_path / "server.log",
        cwd=ROOT,
    )
    server.start()
    try:
        await asyncio.to_thread(server.wait_ready, 60)
        assert await _ping_status(server.port) == 200
        family = descendants(server.pid)
        assert family, "the fork server and the backend process"
        async with aiohttp.ClientSession() as session:

            async def predict() -> tuple[int, object]:
                async with session.post(f"{server.url}/predictions/gated", json=[[3.0]]) as r:
                    return r.status, await r.json()

            answer = asyncio.ensure_future(predict())

            async def running() -> bool:
                async with session.get(f"{server.url}/models/gated") as response:
                    described = await response.json()
                workers = described[0]["models"][0]["workerGroups"][0]["workers"]
                return any(w["status"] == "BUSY" for w in workers)

            await until(running, 60, "the request running in the backend")
            stopping = asyncio.ensure_future(asyncio.to_thread(server.stop, 60))

            async def draining() -> bool:
                return await _ping_status(server.port) != 200

            await until(draining, 30, "the server draining after SIGTERM")
            assert not answer.done()
            gate.touch()
            assert await asyncio.wait_for(answer, 30) == (200, {"predictions": [6.0]})
            stopped = await asyncio.wait_for(stopping, 60)
    finally:
        await asyncio.to_thread(server.kill)
    assert stopped.code == 0
    assert stopped.killed == []
    await wait_gone(family | {server.pid})
    log = server.log_path.read_text()
    assert "mmserver stopped" in log
    assert "Traceback" not in log


async def test_an_early_exit_is_reported_at_once_with_the_log_tail(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    server = Child(
        Serve(store, free_port(), args=("--no-such-flag",)),
        tmp_path / "server.log",
        label="the server",
        cwd=ROOT,
    )
    server.start()
    started = time.monotonic()
    with pytest.raises(NotStarted) as raised:
        await asyncio.to_thread(server.wait_ready, 100)
    assert time.monotonic() - started < 60, "reported when it exited, not at the timeout"
    assert raised.value.what == f"the server on port {server.port}"
    assert raised.value.reason == f"exited with code 2; see {server.log_path}"
    assert "unrecognized arguments: --no-such-flag" in raised.value.tail
    assert "unrecognized arguments: --no-such-flag" in str(raised.value)
    assert server.stop().code == 2


async def test_kill_leaves_nothing_behind(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    server = Child(Serve(store, free_port(), backend_processes=1), tmp_path / "s.log", cwd=ROOT)
    server.start()
    try:
        await asyncio.to_thread(server.wait_ready, 60)
        family = descendants(server.pid) | {server.pid}
    finally:
        stopped = await asyncio.to_thread(server.kill)
    assert stopped.code is None  # killed, not exited
    await wait_gone(family)


async def test_sigkill_after_the_timeout_and_the_descendants_after_the_grace(
    tmp_path: Path,
) -> None:
    # A parent that leaves a child behind when SIGTERM ends it, and a program that ignores
    # SIGTERM altogether.
    leaving = Child(
        _program(
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('started', flush=True)\n"
            "time.sleep(120)\n"
        ),
        tmp_path / "leaving.log",
    )
    stubborn = Child(
        _program(
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('started', flush=True)\n"
            "time.sleep(120)\n"
        ),
        tmp_path / "stubborn.log",
    )
    for child in (leaving, stubborn):
        child.start()

    async def started() -> bool:
        return all("started" in c.log_tail() for c in (leaving, stubborn))

    await until(started, 30, "both programs started")
    [orphan] = descendants(leaving.pid)
    gone, kept = await asyncio.to_thread(stop_all, [leaving, stubborn], 1.0, grace_s=0.5)
    assert gone.code == -signal.SIGTERM
    assert gone.killed == [orphan]
    assert kept.code is None  # still running after the timeout: killed
    assert kept.killed == []
    assert not alive(orphan)
    assert leaving.exited() is not None and stubborn.exited() is not None


async def test_a_child_ends_with_the_parent_that_started_it(tmp_path: Path) -> None:
    parent = await asyncio.create_subprocess_exec(
        *_program(
            "import sys, time\n"
            "from pathlib import Path\n"
            "from mmserver.commands.launch import Child\n"
            "child = Child([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
            "              Path(sys.argv[1]), end_with_parent=True)\n"
            "child.start()\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n"
        ),
        str(tmp_path / "child.log"),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None
        child = int(await asyncio.wait_for(parent.stdout.readline(), 30))
        assert alive(child)
        parent.kill()  # SIGKILL: the parent runs nothing more
        await parent.wait()
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
    await wait_gone({child}, 30)
