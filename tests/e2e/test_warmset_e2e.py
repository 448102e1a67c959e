"""The warm set in the real server: the models a server had loaded, and their workers, come
back after a graceful restart on the same ``state_dir`` before any request names them, the most
recently used first and only as many as fit without evicting (``max_loaded_models`` smaller
than the set), in their order of use; a file that is not a warm set leaves the server cold and
serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mmserver.lifecycle.warmfile import FILE_NAME
from tests.behaviour_models import make_sleeping_dir
from tests.e2e.server_process import ServerProcess, metric_total, predict_ok, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    for name in ("a", "b", "c", "d"):
        # Workers above minWorkers stay through the test (idle for up to 10 minutes).
        make_sleeping_dir(root / name, 0.0, maxWorkers=3, max_idle_time=600)
    return root


async def statuses(session: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with session.get(f"{url}/models") as response:
        assert response.status == 200, await response.text()
        body = await response.json()
    return {row["modelName"]: row["status"] for row in body["models"]}


async def described(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(f"{url}/models/{name}") as response:
        assert response.status == 200, await response.text()
        [workflow] = await response.json()
    [model] = workflow["models"]
    assert isinstance(model, dict)
    return model


async def test_the_warm_set_comes_back_after_a_restart_most_recently_used_first(
    store: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    args = ("--backend-processes", "2", "--state-dir", str(state))
    async with aiohttp.ClientSession() as session:
        async with ServerProcess(store, tmp_path / "first.log", *args) as server:
            async with session.put(f"{server.url}/models/b?min_worker=2") as response:
                assert response.status == 200, await response.text()
            for name in ("a", "b", "c"):  # c the most recently used
                await predict_ok(session, server.url, name)
            server.signal()
            assert await server.wait(30) == 0
        saved = json.loads((state / FILE_NAME).read_text())["models"]
        assert [(m["model"], m["workers"]) for m in saved] == [("c", 1), ("b", 2), ("a", 1)]

        # Room for two: c and b come back, a does not (it would evict one of them).
        second = ServerProcess(store, tmp_path / "second.log", *args, "--max-loaded-models", "2")
        async with second as server:

            async def ended() -> bool:
                return "warm set: 2 of 3 model(s) restored" in server.log()

            await until(ended, 60, "the restore's end")
            assert await statuses(session, server.url) == {
                "a": "UNLOADED",
                "b": "READY",
                "c": "READY",
                "d": "UNLOADED",
            }
            counted = await metric_total(session, server.url, "mmserver_requests_total")
            assert counted == 0  # no request named them
            log = server.log()
            assert f"restoring 3 warm model(s) from {state.resolve() / FILE_NAME}" in log
            assert "warm set: the restore stops at model a (1 model(s) not restored)" in log
            b = await described(session, server.url, "b")
            assert b["workerGroups"][0]["minWorkers"] == 1  # the override did not outlive it
            assert len(b["workerGroups"][0]["workers"]) == 2  # its workers did

            # Their order of use is the one before the restart: d evicts b, not c.
            await predict_ok(session, server.url, "d")
            models = await statuses(session, server.url)
            assert (models["b"], models["c"], models["d"]) == ("UNLOADED", "READY", "READY")


async def test_a_corrupt_warm_set_leaves_the_server_cold_and_serving(
    store: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / FILE_NAME).write_bytes(b'{"format": 1, "models": [{"model": "a", "wor\x00')
    async with aiohttp.ClientSession() as session:
        async with ServerProcess(
            store, tmp_path / "server.log", "--state-dir", str(state)
        ) as server:
            await predict_ok(session, server.url, "a")
            assert "is ignored (the server starts cold): not JSON" in server.log()
            assert (await statuses(session, server.url))["b"] == "UNLOADED"
