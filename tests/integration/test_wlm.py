"""The WorkLoadManager with real models, in threads and in real backend processes.

Behaviour is controlled with gate files (a model's batch runs until the test creates its gate),
so the tests wait on conditions, not on guessed durations.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from mmserver import errors
from mmserver.config.server import ServerConfig
from mmserver.lifecycle.record import ModelStatus
from mmserver.manager.wlm import WorkLoadManager
from mmserver.ops.metrics import Metrics
from mmserver.serving.jobs import HIGH, LOW, NORMAL
from mmserver.store.local import ModelStore
from tests.behaviour_models import (
    make_exiting_dir,
    make_gated_dir,
    make_raising_dir,
    make_recording_dir,
    trusting,
)
from tests.integration.harness import wait_until
from tests.models import make_linear_model, make_linked_store, outputs, rows, value

X = rows([[0.5]])


@asynccontextmanager
async def running(store: Path, **options: Any) -> AsyncIterator[WorkLoadManager]:
    room_wait = options.pop("room_wait_seconds", 5.0)
    config = ServerConfig(model_store=str(store), **trusting(store, options))
    wlm = WorkLoadManager(
        config,
        ModelStore(config.store_path, config.cache_path, 2**30),
        Metrics(),
        room_wait_seconds=room_wait,
    )
    try:
        await wlm.start()
        yield wlm
    finally:
        await wlm.stop(5.0)


def sample(wlm: WorkLoadManager, family: str, **labels: str) -> float:
    got = wlm.metrics.registry.get_sample_value(family, labels)
    return got or 0.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return make_linked_store(tmp_path / "store", 100)


async def test_submit_is_the_one_way_in(store: Path, tmp_path: Path) -> None:
    """A request for a model that is not loaded is a task that loads it and learns its series;
    one for a loaded model is queued at once (a plain future, no task) with its series; a full
    queue is the future's error, with the model's series; the status is the record's."""
    gate = tmp_path / "gate"
    make_gated_dir(store / "gated", gate, maxWorkers=1, job_queue_size=1)
    async with running(store, backend_processes=0) as wlm:
        assert wlm.status("gated") is ModelStatus.UNLOADED
        gate.touch()
        cold = wlm.submit("gated", X)
        assert isinstance(cold.answer, asyncio.Task) and cold.requests is None
        await cold.answer
        assert cold.requests is not None and cold.requests.model == "gated"
        assert wlm.status("gated") is ModelStatus.READY
        gate.unlink()
        running_now = wlm.submit("gated", X)
        assert not isinstance(running_now.answer, asyncio.Task)
        assert running_now.requests is cold.requests
        pool = wlm.room.loaded.get("gated")
        await wait_until(lambda: pool is not None and pool.running == 1)
        queued = wlm.submit("gated", X)
        full = wlm.submit("gated", X)  # the queue holds one job
        with pytest.raises(errors.QueueFull):
            await full.answer
        assert full.requests is cold.requests
        gate.touch()
        await running_now.answer
        await queued.answer
        wlm.begin_shutdown()
        with pytest.raises(errors.ShuttingDown):
            wlm.submit("gated", X)


async def test_models_stay_ready_while_the_server_drains(store: Path, tmp_path: Path) -> None:
    """stop() drains loaded models as loaded models: READY, listed and counted, until the end."""
    gate = tmp_path / "gate"
    make_gated_dir(store / "gated", gate, maxWorkers=1)
    async with running(store, backend_processes=0) as wlm:
        gate.touch()
        await wlm.submit("gated", X).answer
        gate.unlink()
        pending = asyncio.ensure_future(wlm.submit("gated", X).answer)
        pool = wlm.room.loaded.get("gated")
        await wait_until(lambda: pool is not None and pool.running == 1)
        stopping = asyncio.ensure_future(wlm.stop(30.0))
        await wait_until(lambda: not wlm.accepting)
        assert wlm.status("gated") is ModelStatus.READY and list(wlm.room.loaded) == ["gated"]
        gate.touch()
        assert value(await pending) == 1.0  # answered by the drain
        await stopping
        assert wlm.status("gated") is ModelStatus.UNLOADED and list(wlm.room.loaded) == []


async def test_lazy_load_answers_and_loads_once(store: Path) -> None:
    async with running(store, backend_processes=0) as wlm:
        results = await asyncio.gather(*(wlm.submit("sklearn-3", X).answer for _ in range(20)))
        assert all(value(r) == pytest.approx(2.0, abs=0.05) for r in results)
        assert sample(wlm, "mmserver_model_loads_total") == 1  # counted over every model
        # The archive name is the same model (SageMaker's TargetModel).
        assert value(await wlm.submit("sklearn-3.tar.gz", X).answer) == pytest.approx(2.0, abs=0.05)
        assert list(wlm.room.loaded) == ["sklearn-3"]


async def test_unknown_and_invalid_names(store: Path) -> None:
    async with running(store, backend_processes=0) as wlm:
        with pytest.raises(errors.ModelNotFound, match="nope"):
            await wlm.submit("nope", X).answer
        with pytest.raises(errors.InvalidModelName):
            await wlm.submit("../etc", X).answer


async def test_wrong_number_of_features_says_expected_and_got(store: Path) -> None:
    async with running(store, backend_processes=0) as wlm:
        await wlm.submit("sklearn-1", X).answer
        with pytest.raises(errors.InvalidInput, match=r"expects 1 feature.* got 3"):
            await wlm.submit("sklearn-1", rows([[1.0, 2.0, 3.0]])).answer


async def test_burst_scales_to_exactly_max_workers_and_back(store: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "slow", gate, minWorkers=1, maxWorkers=3, max_idle_time=1, batch_size=1)
    async with running(store, backend_processes=0) as wlm:
        gate.touch()
        await wlm.submit("slow", X).answer  # loads it
        gate.unlink()
        pool = wlm.room.loaded.get("slow")
        assert pool is not None and len(pool.workers) == 1
        tasks = [
            asyncio.ensure_future(wlm.submit("slow", rows([[float(i)]])).answer) for i in range(12)
        ]
        await asyncio.sleep(0)  # every request is queued in this turn
        assert len(pool.workers) == 3
        await wait_until(lambda: pool.running == 3)
        assert len(pool.workers) == 3  # never more than maxWorkers
        gate.touch()
        results = await asyncio.gather(*tasks)
        assert [value(r) for r in results] == [2.0 * i for i in range(12)]
        assert sample(wlm, "mmserver_worker_scale_total", model="slow", direction="up") == 3
        await wait_until(lambda: len(pool.workers) == 1)  # idle for max_idle_time: back to min
        assert sample(wlm, "mmserver_worker_scale_total", model="slow", direction="down") == 2


async def test_scale_to_zero_answers_its_first_request(store: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls"
    make_recording_dir(store / "zero", log, minWorkers=0, maxWorkers=2, max_idle_time=1)
    async with running(store, backend_processes=0) as wlm:
        assert value(await wlm.submit("zero", X).answer) == 1.0
        pool = wlm.room.loaded.get("zero")
        assert pool is not None
        await wait_until(lambda: len(pool.workers) == 0)
        assert value(await wlm.submit("zero", rows([[2.0]])).answer) == 4.0


async def test_batching_merges_concurrent_requests_into_one_call(
    store: Path, tmp_path: Path
) -> None:
    log = tmp_path / "calls"
    make_recording_dir(store / "batched", log, batch_size=8, max_batch_delay=10000)
    async with running(store, backend_processes=0) as wlm:
        await wlm.load("batched")  # its worker idle, no request waiting for a batch
        inputs = [[[float(i)], [float(i) + 0.5]] for i in range(4)] + [
            [[float(10 + i)]] for i in range(4)
        ]
        results = await asyncio.gather(*(wlm.submit("batched", rows(x)).answer for x in inputs))
        assert log.read_text().split() == ["12"]  # 8 requests, 12 rows, one predict call
        for x, result in zip(inputs, results, strict=True):
            assert outputs(result) == [2.0 * row[0] for row in x]


async def test_a_batch_delay_rearmed_when_it_is_due_keeps_answering(store: Path) -> None:
    """uvloop's ``call_at`` for a time less than half a millisecond away is a plain handle
    (no ``when()``): the pool arms its delayed dispatch that way when a batch's delay is all but
    over, and arming it again (the next request) must still work."""
    make_linear_model(store / "delayed")
    (store / "delayed" / "serving.properties").write_text("batch_size=32\nmax_batch_delay=1\n")
    async with running(store, backend_processes=1) as wlm:
        await wlm.submit("delayed", X).answer
        pool = wlm.room.loaded.get("delayed")
        assert pool is not None
        loop = asyncio.get_running_loop()
        delay = pool._delay
        delay.arm(loop.time())  # due now: uvloop gives a handle without a time
        assert not loop.time() + 0.01 < delay.at  # later than the one armed: nothing to change
        delay.arm(loop.time() + 0.01)  # armed again: the handle without a time is cancelled
        results = await asyncio.gather(*(wlm.submit("delayed", X).answer for _ in range(50)))
        assert [value(r) for r in results] == [pytest.approx(2.0, abs=0.05)] * 50


async def churn(wlm: WorkLoadManager, limit: int, keeps: frozenset[str] = frozenset()) -> None:
    """Each of the 100 models called in turn, twice: every answer right, never more than
    ``limit`` loaded, the models ``keeps`` loaded throughout."""
    for _ in range(2):
        for i in range(100):
            x = rows([[i / 100]])
            assert value(await wlm.submit(f"sklearn-{i}", x).answer) == pytest.approx(
                2 * i / 100 + 1, abs=0.05
            )
            assert len(wlm.room.loaded) <= limit
            assert keeps <= set(wlm.room.loaded)


async def test_max_loaded_models_is_kept_with_100_models_in_turn(store: Path) -> None:
    async with running(store, backend_processes=0, max_loaded_models=20) as wlm:
        await churn(wlm, 20)
        assert len(wlm.room.loaded) == 20
        assert list(wlm.room.loaded) == [
            f"sklearn-{i}" for i in range(80, 100)
        ]  # most recent, in order
        assert sample(wlm, "mmserver_model_evictions_total") == 180  # over every model


async def test_concurrent_loads_past_the_limit_all_answer(store: Path) -> None:
    async with running(store, backend_processes=0, max_loaded_models=5) as wlm:
        results = await asyncio.gather(*(wlm.submit(f"sklearn-{i}", X).answer for i in range(40)))
        assert all(value(r) == pytest.approx(2.0, abs=0.05) for r in results)
        assert len(wlm.room.loaded) <= 5


async def test_a_model_under_load_is_never_evicted(store: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "busy", gate)
    async with running(
        store, backend_processes=0, max_loaded_models=2, room_wait_seconds=0.2
    ) as wlm:
        running_request = asyncio.ensure_future(wlm.submit("busy", X).answer)
        await wait_until(lambda: (p := wlm.room.loaded.get("busy")) is not None and p.running == 1)
        await wlm.submit("sklearn-1", X).answer
        # "busy" is the least recently used, but it has a running job: sklearn-1 goes.
        await wlm.submit("sklearn-2", X).answer
        assert set(list(wlm.room.loaded)) == {"busy", "sklearn-2"}
        queued = asyncio.ensure_future(wlm.submit("busy", rows([[3.0]])).answer)
        await asyncio.sleep(0)
        blocked = asyncio.ensure_future(wlm.submit("sklearn-3", X).answer)
        # sklearn-2 is idle, so it goes; "busy" stays.
        assert value(await blocked) == pytest.approx(2.0, abs=0.05)
        assert "busy" in wlm.room.loaded
        gate.touch()
        assert value(await running_request) == 1.0
        assert value(await queued) == 6.0


async def test_nothing_evictable_answers_503(store: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "busy", gate)
    async with running(
        store, backend_processes=0, max_loaded_models=1, room_wait_seconds=0.1
    ) as wlm:
        held = asyncio.ensure_future(wlm.submit("busy", X).answer)
        await wait_until(lambda: (p := wlm.room.loaded.get("busy")) is not None and p.running == 1)
        with pytest.raises(errors.NoCapacity) as info:
            await wlm.submit("sklearn-1", X).answer
        assert info.value.status_code == 503
        assert "all busy" in info.value.message
        gate.touch()
        assert value(await held) == 1.0
        assert value(await wlm.submit("sklearn-1", X).answer) == pytest.approx(2.0, abs=0.05)


async def test_model_error_is_424_and_the_worker_keeps_serving(store: Path) -> None:
    make_raising_dir(store / "picky")
    async with running(store, backend_processes=0) as wlm:
        with pytest.raises(errors.ModelError, match="ValueError: negative values") as info:
            await wlm.submit("picky", rows([[-1.0]])).answer
        assert info.value.status_code == 424
        assert value(await wlm.submit("picky", rows([[2.0]])).answer) == 4.0


async def test_a_broken_model_fails_with_its_reason_and_is_retried_later(
    store: Path,
) -> None:
    broken = store / "broken"
    broken.mkdir()
    (broken / "serving.properties").write_text("maxWorkers=two\n")
    async with running(store, backend_processes=0) as wlm:
        wlm.loader.retry_seconds = 3600.0
        results = await asyncio.gather(
            *(wlm.submit("broken", X).answer for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, errors.ConfigError) for r in results)
        message = str(results[0])
        assert "serving.properties" in message and "maxWorkers" in message and "two" in message
        # A storm does not retry: the same failure answers at once.
        (broken / "serving.properties").write_text("maxWorkers=2\n")
        with pytest.raises(errors.ConfigError):
            await wlm.submit("broken", X).answer
        # Past the retry interval it loads again (now it lacks model files: another reason).
        wlm.loader.retry_seconds = 0.0
        with pytest.raises(errors.ModelLoadError) as info:
            await wlm.submit("broken", X).answer
        assert not isinstance(info.value, errors.ConfigError)
        # Other models are not affected.
        assert value(await wlm.submit("sklearn-1", X).answer) == pytest.approx(2.0, abs=0.05)


async def test_predict_timeout_answers_504_in_threads(store: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "slow", gate, **{"option.predict_timeout": 0.3, "maxWorkers": 2})
    async with running(store, backend_processes=0) as wlm:
        with pytest.raises(errors.PredictTimeout) as info:
            await wlm.submit("slow", X).answer
        assert info.value.status_code == 504
        gate.touch()
        assert value(await wlm.submit("slow", X).answer) == 1.0


# Real backend processes -------------------------------------------------------------------------


async def test_workers_of_one_model_go_to_different_processes(store: Path) -> None:
    (store / "spread").mkdir()
    make_recording_dir(store / "spread", store / "spread.log", minWorkers=2, maxWorkers=2)
    # One lane: on a busy machine the probe row may measure slow enough to move the model to
    # the heavy lane's processes, which is not what this test is about.
    async with running(store, backend_processes=2, heavy_processes=0) as wlm:
        assert value(await wlm.submit("spread", X).answer) == 1.0
        pool = wlm.room.loaded.get("spread")
        assert pool is not None
        assert sorted(w.slot.index for w in pool.workers.values()) == [0, 1]
        pids = wlm.backend.pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids


async def test_killed_backend_is_replaced_and_bystanders_lose_nothing(
    store: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "victim", gate, maxWorkers=1)
    # One lane: the victim stays with the bystanders whatever its first batch measures.
    async with running(store, backend_processes=2, heavy_processes=0) as wlm:
        gate.touch()
        await wlm.submit("victim", X).answer
        gate.unlink()
        victim = wlm.room.loaded.get("victim")
        assert victim is not None
        slot = next(iter(victim.workers.values())).slot
        # Load bystanders until one shares the victim's process.
        bystanders = []
        for i in range(10):
            await wlm.submit(f"sklearn-{i}", X).answer
            pool = wlm.room.loaded.get(f"sklearn-{i}")
            assert pool is not None
            if any(w.slot is slot for w in pool.workers.values()):
                bystanders.append(f"sklearn-{i}")
        assert bystanders
        doomed = asyncio.ensure_future(wlm.submit("victim", X).answer)
        await wait_until(lambda: victim.running == 1)
        # A bystander's batch now waits for the victim's process: in its pipe when the victim's
        # batch was measured cheap, in its run queue otherwise.
        waiting = [asyncio.ensure_future(wlm.submit(name, X).answer) for name in bystanders]
        others = [asyncio.ensure_future(wlm.submit(f"sklearn-{i}", X).answer) for i in range(10)]
        await wait_until(
            lambda: all(
                wlm.room.loaded.get(n).running + wlm.room.loaded.get(n).readied == 1
                for n in bystanders
            )  # type: ignore[union-attr]
        )
        old_pid = slot.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(errors.BackendDied, match="died while running this request") as info:
            await doomed
        assert info.value.status_code == 500
        for result in await asyncio.gather(*waiting, *others):
            assert value(result) == pytest.approx(2.0, abs=0.05)
        assert slot.pid != old_pid
        assert sample(wlm, "mmserver_backend_restarts_total", model="victim") == 1
        # The replacement has the victim's model again and serves it.
        gate.touch()
        assert value(await wlm.submit("victim", X).answer) == 1.0
        assert len(wlm.backend.pids()) == 2


async def test_a_process_that_exits_fails_only_its_batch(
    store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_exiting_dir(store / "fragile", maxWorkers=1)
    caplog.set_level(logging.WARNING, logger="mmserver.backend.lifetime")
    async with running(store, backend_processes=1) as wlm:
        assert value(await wlm.submit("fragile", rows([[1.0]])).answer) == 2.0
        assert value(await wlm.submit("sklearn-1", X).answer) == pytest.approx(2.0, abs=0.05)
        with pytest.raises(errors.BackendDied, match=r"exit code 3\)") as info:
            await wlm.submit("fragile", rows([[-1.0]])).answer
        assert "died while running this request" in info.value.message
        # The log says which model it was running, and names it as the line's model.
        [died] = [r for r in caplog.records if "died while running model(s)" in r.getMessage()]
        assert "exit code 3) died while running model(s) fragile;" in died.getMessage()
        assert died.model == "fragile"  # type: ignore[attr-defined]
        # Both models were reloaded into the replacement and keep serving.
        assert value(await wlm.submit("fragile", rows([[4.0]])).answer) == 8.0
        assert value(await wlm.submit("sklearn-1", X).answer) == pytest.approx(2.0, abs=0.05)
        # The restart is counted under the model whose batch the process was running.
        assert sample(wlm, "mmserver_backend_restarts_total", model="fragile") == 1
        assert sample(wlm, "mmserver_backend_restarts_total", model="-") == 0


async def test_predict_timeout_replaces_a_stuck_process(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = tmp_path / "gate"
    make_gated_dir(store / "stuck", gate, **{"option.predict_timeout": 0.5, "maxWorkers": 1})
    caplog.set_level(logging.WARNING, logger="mmserver.backend")
    async with running(store, backend_processes=1) as wlm:
        with pytest.raises(errors.PredictTimeout):
            await wlm.submit("stuck", X).answer
        # The line says which model's prediction it was, and names it as the line's model.
        [stuck] = [r for r in caplog.records if "timed out; replacing" in r.getMessage()]
        assert "a prediction of model stuck timed out" in stuck.getMessage()
        assert stuck.model == "stuck"  # type: ignore[attr-defined]
        # The process running it was replaced, so other models do not wait behind it.
        assert value(await wlm.submit("sklearn-1", X).answer) == pytest.approx(2.0, abs=0.05)
        gate.touch()
        assert value(await wlm.submit("stuck", X).answer) == 1.0


async def test_model_error_in_a_process_is_424(store: Path) -> None:
    make_raising_dir(store / "picky")
    async with running(store, backend_processes=1) as wlm:
        with pytest.raises(errors.ModelError, match="ValueError: negative values"):
            await wlm.submit("picky", rows([[-1.0]])).answer
        assert value(await wlm.submit("picky", rows([[3.0]])).answer) == 6.0


async def test_stop_answers_every_accepted_request(store: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls"
    make_recording_dir(store / "steady", log, maxWorkers=2)
    async with running(store, backend_processes=2) as wlm:
        await wlm.submit("steady", X).answer
        accepted = [
            asyncio.ensure_future(wlm.submit("steady", rows([[float(i)]])).answer)
            for i in range(300)
        ]
        await asyncio.sleep(0)
        await wlm.stop(10.0)
        results = await asyncio.gather(*accepted, return_exceptions=True)
        assert [value(r) for r in results] == [2.0 * i for i in range(300)]
        with pytest.raises(errors.ShuttingDown):
            await wlm.submit("steady", X).answer


async def test_runs_on_uvloop() -> None:
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


def _bookkeeping(wlm: WorkLoadManager) -> dict[str, int]:
    """Sizes of every per-model structure of the frontend (the LRU-bounded caches of measured
    sizes and costs are bounded by MAX_REMEMBERED, not by the loaded models)."""
    records = wlm.catalog.records.values()
    sizes = {
        "records": len(wlm.catalog.records),
        "ready": sum(r.pool is not None for r in records),
        "loading": sum(r.load is not None for r in records),
        "unloading": sum(r.unload is not None for r in records),
        "failures": len(wlm.catalog.failed),
        "sources": sum(r.source is not None for r in records),
        "signatures": sum(r.signature is not None for r in records),
        "tasks": len(wlm._tasks),
        "series": wlm.metrics.model_series(),
        "live": wlm.metrics.live_models,
    }
    for slot in wlm.backend.slots:
        sizes[f"slot {slot.index} loaded"] = len(getattr(slot, "_loaded", {}))
    return sizes


async def test_churn_leaves_no_per_model_state_behind(store: Path) -> None:
    """Three passes over 100 models with room for 10, 8 requests at a time, in real backend
    processes: after each pass every per-model structure has the size it had after the first,
    and the memory counted for eviction is the loaded models' own. One lane: the per-slot counts
    compared are those of fixed slots (on a busy machine a linear model's measured batch can pass
    heavy_batch_ms and move it to the heavy lane's slot mid-pass)."""
    async with running(
        store,
        backend_processes=2,
        heavy_processes=0,
        max_loaded_models=10,
        max_workers=2,
        room_wait_seconds=30,
    ) as wlm:
        after_pass = []
        for _ in range(3):
            for start in range(0, 100, 8):
                names = [f"sklearn-{i}" for i in range(start, min(start + 8, 100))]
                results = await asyncio.gather(*(wlm.submit(n, X).answer for n in names))
                assert [value(r) for r in results] == pytest.approx([2.0] * len(names), abs=0.05)
            await wait_until(lambda: not any(r.unload for r in wlm.catalog.records.values()))
            after_pass.append(_bookkeeping(wlm))
            pools = [wlm.room.loaded.get(name) for name in wlm.room.loaded]
            assert wlm.room.used_bytes() == sum(p.accounted_bytes for p in pools if p is not None)
            assert wlm.room.used_bytes() == sum(
                p.memory_bytes or p.copy_bytes for p in pools if p is not None
            )
        assert after_pass[0]["ready"] == 10 and after_pass[0]["sources"] == 10
        assert after_pass[1] == after_pass[0]
        assert after_pass[2] == after_pass[0]
        assert sample(wlm, "mmserver_model_loads_total") == 300


async def test_pinned_models_load_at_start_and_outlive_churn(store: Path) -> None:
    async with running(
        store, backend_processes=0, max_loaded_models=20, pinned_models="sklearn-1, sklearn-2?"
    ) as wlm:
        pinned = {"sklearn-1", *(f"sklearn-2{i}" for i in range(10))}
        assert wlm.room.pinned == pinned  # loaded at start, before any request
        assert set(wlm.room.loaded) == pinned
        await churn(wlm, 20, frozenset(pinned))
        # The nine places left went round the other models, most recently used last.
        assert [n for n in wlm.room.loaded if n not in pinned] == [
            f"sklearn-{i}" for i in range(91, 100)
        ]
        assert (await wlm.catalog.describe("sklearn-25")).pinned
        assert not (await wlm.catalog.describe("sklearn-3")).pinned


async def test_a_pin_set_past_max_loaded_models_stops_the_start(store: Path) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        async with running(
            store, backend_processes=0, max_loaded_models=5, pinned_models="sklearn-1*"
        ):
            pass
    assert refused.value.message == (
        "option pinned_models=sklearn-1*: it pins 11 models (sklearn-1, sklearn-10, sklearn-11, "
        "sklearn-12, sklearn-13 and 6 more), more than max_loaded_models=5"
    )


async def test_a_pin_set_past_the_memory_budget_stops_the_start(store: Path) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        async with running(
            store,
            backend_processes=1,
            max_memory_mb=1,
            pinned_models="*",
            room_wait_seconds=0.1,
        ):
            pass
    message = refused.value.message
    assert message.startswith(
        "option pinned_models=*: the pinned models do not fit the memory budget of 1 MiB "
        "(option max_memory_mb): 1 of them took "
    )
    assert message.endswith(
        " MiB when model sklearn-1 could not load; pin fewer models or raise max_memory_mb"
    )


async def test_a_bad_pattern_is_refused_naming_the_option() -> None:
    with pytest.raises(errors.ConfigError) as refused:
        ServerConfig(pinned_models="good-*, bad name")
    assert refused.value.message == (
        "option pinned_models: 'bad name' is not a model name or a glob pattern of model names "
        "(letters, digits, _ . - / and * ? [ ])"
    )


async def test_under_memory_pressure_low_priority_models_go_first(store: Path) -> None:
    async with running(store, backend_processes=0, max_loaded_models=3) as wlm:
        for name, priority in (("sklearn-1", HIGH), ("sklearn-2", NORMAL), ("sklearn-3", LOW)):
            await wlm.submit(name, X, priority=priority).answer
        assert list(wlm.room.loaded) == ["sklearn-1", "sklearn-2", "sklearn-3"]
        # Least recently used first would take sklearn-1: its last caller's priority was high.
        await wlm.submit("sklearn-4", X).answer
        assert list(wlm.room.loaded) == ["sklearn-1", "sklearn-2", "sklearn-4"]
        await wlm.submit("sklearn-5", X).answer  # then the normal ones, oldest first
        assert list(wlm.room.loaded) == ["sklearn-1", "sklearn-4", "sklearn-5"]
        await wlm.submit("sklearn-1", X).answer  # a normal request: it ranks as any other now
        await wlm.submit("sklearn-6", X).answer
        assert list(wlm.room.loaded) == ["sklearn-5", "sklearn-1", "sklearn-6"]
        assert wlm.room.ranks == {}
