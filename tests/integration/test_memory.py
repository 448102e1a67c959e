"""The memory budget holds for what the backend processes really hold, with real processes.

Forests cost more loaded than on disk (their converted predict paths), and a process that
unloads one keeps pages the allocator may reuse, so the budget is checked against each backend's
resident memory, not against the models' charges alone. The tests wait on conditions with a
deadline, never on guessed durations.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from mmserver.backend.process_slot import ProcessSlot
from mmserver.config.server import ServerConfig
from mmserver.manager.wlm import WorkLoadManager
from mmserver.ops import capacity
from mmserver.ops.metrics import Metrics
from mmserver.store.local import ModelStore
from tests.behaviour_models import trusting
from tests.integration.harness import wait_until
from tests.models import rows, tree_models, value

BUDGET_MB = 48
#: Resident pages the watch cannot tell from a model's (shared library pages a model's first
#: prediction maps, read at a slightly different moment than the budget's check).
SLACK_MB = 4

LEAKING = """\
_KEPT = []


def load(model_dir, properties):
    return int(properties["leak_mb"])


def predict(mb, batch):
    _KEPT.append(b"x" * (mb << 20))  # written, so resident: a leak the model never frees
    return [2.0 * float(row[0]) for row in batch]
"""


@asynccontextmanager
async def running(store: Path, **options: Any) -> AsyncIterator[WorkLoadManager]:
    config = ServerConfig(
        model_store=str(store),
        backend_processes=1,
        heavy_processes=0,
        max_memory_mb=BUDGET_MB,
        **trusting(store, options),
    )
    wlm = WorkLoadManager(
        config, ModelStore(config.store_path, config.cache_path, 2**30), Metrics()
    )
    await wlm.start()
    try:
        yield wlm
    finally:
        await wlm.stop(5.0)


def only_process(wlm: WorkLoadManager) -> ProcessSlot:
    slot = wlm.backend.slots[0]
    assert isinstance(slot, ProcessSlot)
    return slot


def resident(pid: int) -> int:
    return capacity.rss_bytes([pid])


@pytest.mark.timeout(180)
async def test_forests_churned_through_a_small_budget_stay_in_it(tmp_path: Path) -> None:
    # Forests of ~5 MB on disk that hold ~2-3 times that once loaded: the budget has room for
    # two or three of them, and twelve are requested in turn, so every load follows evictions.
    store = tmp_path / "store"
    tree_models.write_pickle(store / "forest-0", tree_models.forest(30, depth=None))
    for i in range(1, 12):
        (store / f"forest-{i}").mkdir()
        os.link(store / "forest-0" / "model.joblib", store / f"forest-{i}" / "model.joblib")
    x = rows([[0.5] * tree_models.FEATURES])
    async with running(store) as wlm:
        slot = only_process(wlm)
        pid = slot.live_pid
        assert pid is not None
        start = resident(pid)
        bound = (BUDGET_MB + SLACK_MB) * 2**20
        for i in [*range(12), *range(12)]:
            await wlm.submit(f"forest-{i}", x).answer
            assert slot.live_pid == pid  # kept in the budget by evictions, not restarts
            await wait_until(lambda: resident(pid) - start <= bound, seconds=10.0)
        charged = wlm.metrics.registry.get_sample_value("mmserver_model_memory_bytes")
        # A forest's charge is what it holds loaded, several times its ~5 MB file.
        pool = wlm.room.loaded.get("forest-11")
        assert pool is not None and pool.copy_bytes > 8 * 2**20
        assert charged is None or charged <= BUDGET_MB * 2**20


@pytest.mark.timeout(120)
async def test_a_process_that_holds_more_than_its_share_is_replaced_when_idle(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "store" / "leaky"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(LEAKING)
    (folder / "serving.properties").write_text("leak_mb=16\n")
    async with running(tmp_path / "store") as wlm:
        slot = only_process(wlm)
        first = slot.live_pid
        assert first is not None
        # Each request leaks 16 MiB; past the budget (the one process's share) the process is
        # replaced once idle, and every request is still answered.
        for _ in range(12):
            assert value(await wlm.submit("leaky", rows([[1.0]])).answer) == 2.0
            if slot.live_pid not in (None, first):
                break
        await wait_until(lambda: slot.live_pid not in (None, first), seconds=10.0)
        assert (
            wlm.metrics.registry.get_sample_value("mmserver_backend_restarts_total", {"model": "-"})
            == 1
        )
        assert value(await wlm.submit("leaky", rows([[3.0]])).answer) == 6.0
        assert slot.unaccounted_bytes() < BUDGET_MB * 2**20
