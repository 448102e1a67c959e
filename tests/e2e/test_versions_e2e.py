"""Versions in the real server with backend processes: a version's files prepared in an
unpacking process (its archive unpacked there, its model folder's serving.properties inherited),
each version loaded into the backends on its own, and a switch of the default that outlives a
restart."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.server_process import ServerProcess
from tests.integration.test_versions import make_versioned_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


async def answer(session: aiohttp.ClientSession, url: str, path: str) -> float:
    async with session.post(f"{url}{path}", json=[[0.5]]) as response:
        assert response.status == 200, await response.text()
        predictions = json.loads(await response.read())["predictions"]
        return float(predictions[0])


async def test_versions_served_by_backend_processes_and_a_switch_outlives_a_restart(
    tmp_path: Path,
) -> None:
    store = make_versioned_store(tmp_path / "store")
    args = ("--backend-processes", "2", "--cache-dir", str(tmp_path / "cache"))
    async with aiohttp.ClientSession() as session:
        async with ServerProcess(store, tmp_path / "first.log", *args) as server:
            assert await answer(session, server.url, "/predictions/versioned") == 12.0
            assert await answer(session, server.url, "/predictions/versioned/1") == 11.0
            async with session.put(f"{server.url}/models/versioned/1/set-default") as response:
                assert response.status == 200, await response.text()
            assert await answer(session, server.url, "/predictions/versioned") == 11.0
            server.signal()
            assert await server.wait(30) == 0
        async with ServerProcess(store, tmp_path / "second.log", *args) as server:
            assert await answer(session, server.url, "/predictions/versioned") == 11.0
            assert await answer(session, server.url, "/predictions/versioned/2") == 12.0
