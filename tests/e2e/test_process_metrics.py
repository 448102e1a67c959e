"""``process_*`` series of the real server's processes: the frontend and each backend, by role,
with what psutil reads of them."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_process import ServerProcess, one_model_store, predict_ok

pytestmark = pytest.mark.e2e


async def test_frontend_and_backends_by_role(tmp_path: Path) -> None:
    store = one_model_store(tmp_path)
    async with (
        ServerProcess(store, tmp_path / "server.log", "--backend-processes", "2") as server,
        aiohttp.ClientSession() as session,
    ):
        await predict_ok(session, server.url)
        async with session.get(f"{server.url}/metrics") as response:
            text = await response.text()
        frontend_rss = psutil.Process(server.pid).memory_info().rss
    samples = {
        (s.name, s.labels["role"], s.labels["process"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("process_")
        for s in family.samples
    }
    processes = {(role, process) for _, role, process in samples}
    assert processes == {
        ("frontend", "frontend"),
        ("backend", "backend light 0"),
        ("backend", "backend light 1"),
    }
    for role, process in processes:
        assert samples[("process_resident_memory_bytes", role, process)] > 10 * 2**20
        assert samples[("process_cpu_seconds_total", role, process)] >= 0
        assert samples[("process_open_fds", role, process)] >= 3
    # The frontend's CPU is read, not a constant (it imported the server: well over a second).
    # A backend forked from the fork server that has run nothing may not have used one clock
    # tick (10 ms) yet, so its figure may be 0.
    assert samples[("process_cpu_seconds_total", "frontend", "frontend")] > 0.1
    # The frontend's figure is its own resident memory, as psutil reads it (within what a
    # scrape allocates in between).
    scraped = samples[("process_resident_memory_bytes", "frontend", "frontend")]
    assert abs(scraped - frontend_rss) < 64 * 2**20
