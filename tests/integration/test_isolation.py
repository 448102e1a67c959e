"""Performance isolation over real HTTP with real backend processes: a heavy model runs in the
heavy lane and cannot hold up the light models; the backends are shared by measured cost; the
cost is visible; a model whose cost changes changes lane.

The models compute for as many CPU milliseconds as a request asks (``[[ms]]``) and can wait at a
gate file, so the tests hold batches running on purpose and wait on states and counts, never on
durations.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mmserver.backend.process_slot import ProcessSlot
from mmserver.ops.capacity import affinity_mask
from mmserver.policy.scheduling import PIPELINE_BUDGET_S
from mmserver.serving.worker import WorkerState
from tests.behaviour_models import (
    make_costly_load_dir,
    make_row_spinning_dir,
    make_slow_load_dir,
    make_spinning_dir,
)
from tests.integration.harness import Harness, Serve, describe, wait_until
from tests.models import make_linked_store
from tests.unit.test_cpus import thread_cpus

# How the lanes share the machine's CPUs: alone, not beside other tests.
pytestmark = pytest.mark.alone

LIGHT_PROCESSES = 2


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return make_linked_store(tmp_path / "store", 10)


async def answer(harness: Harness, model: str, x: float) -> Any:
    response = await harness.post(f"/predictions/{model}", json.dumps([[x]]))
    return response.status, json.loads(await response.read())


def lanes_of(harness: Harness, model: str) -> list[str]:
    pool = harness.wlm.room.loaded.get(model)
    assert pool is not None
    return [w.slot.lane.name for w in pool.workers.values()]


async def settled_in(harness: Harness, model: str, lane: str) -> None:
    """Wait until every worker of ``model`` is in ``lane`` and loaded there."""

    def done() -> bool:
        pool = harness.wlm.room.loaded.get(model)
        return (
            pool is not None
            and pool.lane == lane
            and bool(pool.workers)
            and all(
                w.slot.lane.name == lane and w.state is not WorkerState.STARTING
                for w in pool.workers.values()
            )
        )

    await wait_until(done, 20)


async def test_light_models_are_answered_while_a_heavy_one_holds_every_heavy_backend(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    make_spinning_dir(store / "hog", gate=gate, maxWorkers=2, batch_size=1)
    harness = await serve(
        model_store=str(store),
        backend_processes=LIGHT_PROCESSES,
        heavy_processes=2,
        metrics_model_label="all",
    )
    # Its first batch takes 30 ms of CPU: the model moves to the heavy lane.
    assert await answer(harness, "hog", 30.0) == (200, {"predictions": [60.0]})
    await settled_in(harness, "hog", "heavy")

    gate.unlink()
    held = [asyncio.ensure_future(answer(harness, "hog", 30.0)) for _ in range(6)]
    pool = harness.wlm.room.loaded.get("hog")
    assert pool is not None
    # The scaling rule gives it its second worker; both heavy processes are then held.
    await wait_until(lambda: pool.running == 2, 20)
    heavy_slots = {w.slot.index for w in pool.workers.values()}
    assert heavy_slots == {LIGHT_PROCESSES, LIGHT_PROCESSES + 1}

    for i in range(10):
        status, body = await answer(harness, f"sklearn-{i}", 0.5)
        assert status == 200 and body["predictions"][0] == pytest.approx(2.0, abs=0.05)
    light = harness.wlm.room.loaded.get("sklearn-0")
    assert light is not None and lanes_of(harness, "sklearn-0") == ["light"]
    assert not any(task.done() for task in held)

    gate.touch()
    assert [await task for task in held] == [(200, {"predictions": [60.0]})] * 6

    info = await describe(harness, "hog")
    assert info["lane"] == "heavy"
    assert {w["lane"] for w in info["workerGroups"][0]["workers"]} == {"heavy"}
    assert info["costPerBatchMillis"] >= 20.0
    assert info["holdPerBatchMillis"] >= info["costPerBatchMillis"] * 0.9
    assert info["batches"] == 7
    samples = await harness.samples()
    assert samples[("mmserver_model_cpu_seconds_total", (("model", "hog"),))] >= 7 * 0.025
    assert samples[("mmserver_model_lane", (("lane", "heavy"), ("model", "hog")))] == 1.0
    assert ("mmserver_model_lane", (("lane", "light"), ("model", "hog"))) not in samples
    assert samples[("mmserver_model_lane", (("lane", "light"), ("model", "sklearn-0")))] == 1.0


async def serve_heavy(serve: Serve, store: Path, model: str) -> Harness:
    """A server with one process in each lane, and ``model`` moved to the heavy lane by a
    20 ms batch."""
    make_spinning_dir(store / model, maxWorkers=1, batch_size=1)
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=1)
    assert (await answer(harness, model, 20.0))[0] == 200
    await settled_in(harness, model, "heavy")
    return harness


async def test_a_model_whose_cost_falls_moves_back_to_the_light_lane(
    serve: Serve, store: Path
) -> None:
    harness = await serve_heavy(serve, store, "changing")
    # Cheap batches bring its moving average down under half the threshold.
    for _ in range(40):
        assert await answer(harness, "changing", 0.0) == (200, {"predictions": [0.0]})
        pool = harness.wlm.room.loaded.get("changing")
        if pool is not None and pool.lane == "light":
            break
    await settled_in(harness, "changing", "light")
    assert (await describe(harness, "changing"))["lane"] == "light"
    assert await answer(harness, "changing", 1.0) == (200, {"predictions": [2.0]})


async def test_a_model_whose_requests_are_large_runs_in_the_heavy_lane(
    serve: Serve, store: Path
) -> None:
    """A model whose row costs 0.02 ms of CPU, asked only requests of 1,000 rows (20 ms each):
    charged for its requests, not for one row, it moves to the heavy lane once and stays there
    however its requests are batched. The same model asked one row at a time is light."""
    make_row_spinning_dir(store / "large", 0.02, maxWorkers=1, batch_size=4)
    make_row_spinning_dir(store / "small", 0.02, maxWorkers=1, batch_size=4)
    harness = await serve(
        model_store=str(store),
        backend_processes=1,
        heavy_processes=1,
        metrics_model_label="all",
    )
    body = json.dumps([[1.0]] * 1000)

    async def large(count: int) -> None:
        answers = [harness.post("/predictions/large", body) for _ in range(count)]
        for response in await asyncio.gather(*answers):
            assert response.status == 200
            assert (await response.json())["predictions"] == [2.0] * 1000

    await large(1)
    await settled_in(harness, "large", "heavy")
    await large(12)  # three at a time and more, batched as they come
    info = await describe(harness, "large")
    assert info["lane"] == "heavy" and info["rowsPerRequest"] == 1000.0, info
    assert info["costPerRequestMillis"] > 2 * 2.0, info  # clearly over heavy_batch_ms
    moves = ("mmserver_model_lane_moves_total", (("model", "large"),))
    assert (await harness.samples())[moves] == 1.0

    for _ in range(40):
        assert await answer(harness, "small", 1.0) == (200, {"predictions": [2.0]})
        pool = harness.wlm.room.loaded.get("small")
        if pool is not None and pool.lane == "light" and pool.cost.batches >= 20:
            break
    await settled_in(harness, "small", "light")
    info = await describe(harness, "small")
    assert info["lane"] == "light" and info["rowsPerRequest"] == 1.0, info


async def test_a_heavy_model_remembered_after_eviction_starts_in_the_heavy_lane(
    serve: Serve, store: Path
) -> None:
    harness = await serve_heavy(serve, store, "again")
    response = await harness.client.delete("/models/again")
    assert response.status == 200
    assert (await answer(harness, "again", 20.0))[0] == 200
    assert lanes_of(harness, "again") == ["heavy"]


async def test_the_backend_is_shared_by_time_not_by_turns(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    """One backend process and one lane, two models with deep queues: the 40 ms model and the
    cheap one get a share of time each, so the cheap one's 30 batches all run before the
    costly one's third (in arrival order or turn by turn, they would alternate). The costly
    model is costly enough that the cheap one's batches, even slowed by a busy machine, take
    less time together than two of its batches."""
    log = tmp_path / "order"
    gate = tmp_path / "gate"
    gate.touch()
    make_spinning_dir(store / "costly", log=log, gate=gate, maxWorkers=1, batch_size=1)
    make_spinning_dir(store / "cheap", log=log, maxWorkers=1, batch_size=1)
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=0)
    for model in ("costly", "cheap"):  # loaded, their cost measured
        assert (await answer(harness, model, 40.0 if model == "costly" else 0.0))[0] == 200
    log.write_text("")
    gate.unlink()
    costly = [asyncio.ensure_future(answer(harness, "costly", 40.0)) for _ in range(30)]
    pool = harness.wlm.room.loaded.get("costly")
    assert pool is not None
    await wait_until(lambda: pool.running == 1 and len(pool.queue) == 29)
    cheap = [asyncio.ensure_future(answer(harness, "cheap", 0.0)) for _ in range(30)]
    cheap_pool = harness.wlm.room.loaded.get("cheap")
    assert cheap_pool is not None
    await wait_until(lambda: cheap_pool.readied + cheap_pool.running + len(cheap_pool.queue) > 0)
    gate.touch()
    assert [await t for t in costly] == [(200, {"predictions": [80.0]})] * 30
    assert [await t for t in cheap] == [(200, {"predictions": [0.0]})] * 30
    order = log.read_text().split()
    assert sorted(order) == ["cheap"] * 30 + ["costly"] * 30
    last_cheap = len(order) - 1 - order[::-1].index("cheap")
    assert order[:last_cheap].count("costly") <= 2, order
    # Each cheap batch that waited counted the costly batch ahead of it.
    assert (await describe(harness, "cheap"))["batchesWaitedBehind"] >= 1


async def test_loads_asked_after_a_waiting_batch_run_after_it(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    """One backend process: while a load holds it, a loaded model's batch waits for its turn on
    the frontend, and the loads asked after it wait behind it, not ahead of it in the process's
    pipe (a stream of cold loads cannot keep a loaded model waiting)."""
    log = tmp_path / "order"
    started, gate = tmp_path / "started", tmp_path / "gate"
    make_slow_load_dir(store / "slow", started, gate)
    make_spinning_dir(store / "cheap", log=log, maxWorkers=1, batch_size=1)
    for i in range(2):
        make_spinning_dir(store / f"late-{i}", log=log, log_load=True)
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=0)
    assert await answer(harness, "cheap", 0.0) == (200, {"predictions": [0.0]})
    log.write_text("")
    pool = harness.wlm.room.loaded.get("cheap")
    assert pool is not None
    readied = pool.readied
    slow = asyncio.ensure_future(answer(harness, "slow", 1.0))
    await wait_until(started.exists, 20)  # its load holds the process
    cheap = asyncio.ensure_future(answer(harness, "cheap", 0.0))
    await wait_until(lambda: pool.readied > readied, 20)
    late = [asyncio.ensure_future(answer(harness, f"late-{i}", 1.5)) for i in range(2)]
    slot = harness.wlm.backend.slots[0]
    assert isinstance(slot, ProcessSlot)
    await wait_until(lambda: slot.waiting == 3, 20)  # the batch, then the two loads
    assert not log.read_text()

    gate.touch()
    assert await slow == (200, {"predictions": [2.0]})
    assert await cheap == (200, {"predictions": [0.0]})
    assert [await t for t in late] == [(200, {"predictions": [3.0]})] * 2
    order = log.read_text().split()
    assert order[0] == "cheap", order
    assert sorted(order) == ["cheap", "late-0", "late-1", "load:late-0", "load:late-1"]


async def test_a_load_is_not_held_back_by_a_model_with_a_deep_queue(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    """One backend process, a 20 ms model with a batch running, one more waiting its turn and
    more queued: a load asked meanwhile takes its turn among them (the loads' share of the
    process), here ahead of the waiting batch, not after the queue has drained."""
    log = tmp_path / "order"
    gate = tmp_path / "gate"
    gate.touch()
    make_spinning_dir(store / "costly", log=log, gate=gate, maxWorkers=2, batch_size=1)
    make_spinning_dir(store / "late", log=log, log_load=True)
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=0)
    assert await answer(harness, "costly", 20.0) == (200, {"predictions": [40.0]})
    log.write_text("")
    gate.unlink()
    costly = [asyncio.ensure_future(answer(harness, "costly", 20.0)) for _ in range(10)]
    pool = harness.wlm.room.loaded.get("costly")
    assert pool is not None
    slot = harness.wlm.backend.slots[0]
    assert isinstance(slot, ProcessSlot)
    # The first worker's batch runs; the second worker waits its turn with the next one.
    await wait_until(lambda: slot.in_pipe == 1 and slot.waiting == 1 and len(pool.workers) == 2)
    late = asyncio.ensure_future(answer(harness, "late", 0.5))
    await wait_until(lambda: slot.in_pipe == 2, 20)  # the load went ahead of the waiting batch

    gate.touch()
    assert [await t for t in costly] == [(200, {"predictions": [40.0]})] * 10
    assert await late == (200, {"predictions": [1.0]})
    order = log.read_text().split()
    assert sorted(order) == ["costly"] * 10 + ["late", "load:late"]
    assert order.index("load:late") == 1, order


async def test_a_load_in_the_pipe_of_a_process_that_dies_is_loaded_once_by_its_replacement(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    """A load written behind a running batch when the process dies goes to the replacement
    once, with the messages held for it (not reloaded as well), and answers what the load
    measured: the model's memory and signature."""
    gate = tmp_path / "gate"
    gate.touch()
    make_spinning_dir(store / "costly", gate=gate, maxWorkers=1, batch_size=1)
    make_spinning_dir(store / "late")
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=0)
    assert await answer(harness, "costly", 1.0) == (200, {"predictions": [2.0]})
    gate.unlink()
    running = asyncio.ensure_future(answer(harness, "costly", 1.0))
    slot = harness.wlm.backend.slots[0]
    assert isinstance(slot, ProcessSlot)
    await wait_until(lambda: slot.in_pipe == 1, 20)
    late = asyncio.ensure_future(answer(harness, "late", 0.5))
    await wait_until(lambda: slot.in_pipe == 2, 20)  # its load behind the running batch
    died = slot.pid
    slot.kill()
    status, body = await running
    assert status == 500 and "died while running this request" in body["message"], body
    gate.touch()
    assert await late == (200, {"predictions": [1.0]})
    assert slot.pid != died
    pool = harness.wlm.room.loaded.get("late")
    assert pool is not None and pool.copy_bytes > 0
    signature = harness.wlm.signature("late")
    assert signature is not None and signature["platform"] == "python"


async def test_a_process_charges_its_loads_what_they_took(serve: Serve, store: Path) -> None:
    """The loads' share of a process is charged by what its loads took, from the 1 ms it
    starts at: after a load that computed for 30 ms, the moving average (a fifth of the new
    measure) is above 1 + (30 - 1) / 5 ms."""
    make_costly_load_dir(store / "slow-load", 30.0)
    harness = await serve(model_store=str(store), backend_processes=1, heavy_processes=0)
    slot = harness.wlm.backend.slots[0]
    assert isinstance(slot, ProcessSlot)
    assert slot.load_cost.estimate == PIPELINE_BUDGET_S
    assert await answer(harness, "slow-load", 0.5) == (200, {"predictions": [1.0]})
    assert slot.load_cost.estimate >= PIPELINE_BUDGET_S + (0.030 - PIPELINE_BUDGET_S) / 5


async def test_the_lane_gauges_count_a_model_in_the_lane_it_moved_to(
    serve: Serve, store: Path
) -> None:
    """Without the model label on it, ``mmserver_model_lane`` counts the loaded models of each
    lane, kept as a model moves (and as it loads and unloads)."""
    harness = await serve_heavy(serve, store, "moving")
    samples = await harness.samples()
    assert samples[("mmserver_model_lane", (("lane", "heavy"),))] == 1.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 0.0
    assert (await answer(harness, "sklearn-1", 0.5))[0] == 200
    assert (await harness.client.delete("/models/moving")).status == 200
    samples = await harness.samples()
    assert samples[("mmserver_model_lane", (("lane", "heavy"),))] == 0.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 1.0


def heavy_cpus(harness: Harness) -> list[set[frozenset[int]]]:
    """The CPU masks of every thread of each heavy process that runs now (empty while one is
    being replaced)."""
    try:
        return [thread_cpus(pid) for pid in harness.wlm.backend.pids("heavy")]
    except OSError:
        return []


@pytest.mark.skipif(len(affinity_mask()) < 2, reason="needs two CPUs to reserve one")
async def test_the_heavy_lane_keeps_off_a_cpu_while_light_models_have_work(
    serve: Serve, store: Path
) -> None:
    """While light models are answered, the heavy lane's processes (and a replacement started
    meanwhile) run only on the CPUs but the lowest one; a quiet spell gives them every CPU
    back; the heavy model is answered throughout."""
    every = affinity_mask()
    narrow = every - {min(every)}
    gauge = ("mmserver_heavy_lane_cpus", ())
    harness = await serve_heavy(serve, store, "hog")
    reserve = harness.wlm.backend.reserve
    assert reserve is not None and reserve.narrow == narrow
    # The hog's first batch ran in the light lane; nothing light since.
    await wait_until(lambda: heavy_cpus(harness) == [{every}], 30)
    assert (await harness.samples())[gauge] == len(every)

    stop = asyncio.Event()

    async def light_traffic() -> int:
        for i in range(20_000):
            if stop.is_set():
                return i
            status, body = await answer(harness, f"sklearn-{i % 10}", 0.5)
            assert status == 200 and body["predictions"][0] == pytest.approx(2.0, abs=0.05)
        return 20_000

    # Checked below, not by the timer: the reserve lasts until the test's own checks.
    reserve.hold = 3600.0
    traffic = asyncio.ensure_future(light_traffic())
    try:
        await wait_until(lambda: heavy_cpus(harness) == [{narrow}], 30)
        assert (await harness.samples())[gauge] == len(narrow)
        assert await answer(harness, "hog", 5.0) == (200, {"predictions": [10.0]})
        (slot,) = (
            s
            for s in harness.wlm.backend.slots
            if isinstance(s, ProcessSlot) and s.lane.name == "heavy" and s.pid
        )
        old = slot.pid
        slot.kill()
        await wait_until(lambda: slot.pid != old and heavy_cpus(harness) == [{narrow}], 30)
        assert await answer(harness, "hog", 5.0) == (200, {"predictions": [10.0]})
    finally:
        stop.set()
        sent = await traffic
    assert 0 < sent < 20_000
    narrowings = reserve.narrowings
    reserve.check()  # light batches since the last check: kept
    assert reserve.narrowed and heavy_cpus(harness) == [{narrow}]
    reserve.check()  # none since: every CPU back
    assert not reserve.narrowed and heavy_cpus(harness) == [{every}]
    assert (await harness.samples())[gauge] == len(every)
    # The heavy model's own batches keep nothing free.
    assert await answer(harness, "hog", 5.0) == (200, {"predictions": [10.0]})
    assert not reserve.narrowed and reserve.narrowings == narrowings


async def test_no_cpu_is_reserved_with_heavy_reserved_cpus_0(serve: Serve, store: Path) -> None:
    make_spinning_dir(store / "hog", maxWorkers=1, batch_size=1)
    harness = await serve(
        model_store=str(store), backend_processes=1, heavy_processes=1, heavy_reserved_cpus=0
    )
    assert (await answer(harness, "hog", 20.0))[0] == 200
    await settled_in(harness, "hog", "heavy")
    for i in range(5):
        assert (await answer(harness, f"sklearn-{i}", 0.5))[0] == 200
    reserve = harness.wlm.backend.reserve
    assert reserve is not None and not reserve.enabled and reserve.narrowings == 0
    assert heavy_cpus(harness) == [{affinity_mask()}]
    assert (await harness.samples())[("mmserver_heavy_lane_cpus", ())] == len(affinity_mask())


#: Light batches the light lane may answer while the heavy model answers HEAVY_BATCHES: with a
#: weight the heavy lane gets a share of its CPU (on a 2-CPU machine about 230 light batches
#: per heavy one, 700 for the three); under SCHED_IDLE it gets only the gaps the light work
#: leaves (its first batch had not ended after 1,200 light ones on a quiet machine, after 550
#: on a busy one).
LIGHT_LIMIT = 1200
HEAVY_BATCHES = 3


@pytest.mark.skipif(len(affinity_mask()) < 2, reason="needs two CPUs to reserve one")
async def test_a_heavy_model_gets_a_share_of_the_machine_beside_saturating_light_traffic(
    serve: Serve, store: Path
) -> None:
    """More light processes than CPUs, each kept busy by light batches that compute, leave the
    heavy lane no idle CPU time at all. The heavy model's batches still run, interleaved with
    the light ones: the heavy lane runs with a CPU weight (a nice value), not under SCHED_IDLE.
    Counted, not timed: the heavy model answers HEAVY_BATCHES batches while the light traffic
    answers fewer than LIGHT_LIMIT requests, and the light traffic goes on meanwhile."""
    light_models = [f"light-{i}" for i in range(8)]
    for name in light_models:
        make_spinning_dir(store / name, maxWorkers=2, batch_size=1)
    make_spinning_dir(store / "hog", maxWorkers=1, batch_size=1)
    cpus = len(affinity_mask())
    harness = await serve(
        model_store=str(store),
        backend_processes=3 * cpus,
        heavy_processes=1,
        heavy_batch_ms=100.0,
    )
    assert (await answer(harness, "hog", 150.0))[0] == 200
    await settled_in(harness, "hog", "heavy")
    for name in light_models:  # loaded, their cost measured
        assert (await answer(harness, name, 10.0))[0] == 200

    light = 0
    #: The light answers counted when each heavy batch was asked and when it was answered.
    light_at_heavy: list[tuple[int, int]] = []
    done = asyncio.Event()

    async def light_traffic(worker: int) -> None:
        nonlocal light
        for i in range(LIGHT_LIMIT):
            if done.is_set():
                return
            model = light_models[(worker + i) % len(light_models)]
            assert await answer(harness, model, 10.0) == (200, {"predictions": [20.0]})
            light += 1
            if light >= LIGHT_LIMIT:
                done.set()

    async def heavy_traffic() -> None:
        for _ in range(HEAVY_BATCHES):
            if done.is_set():
                return
            asked = light
            assert await answer(harness, "hog", 150.0) == (200, {"predictions": [300.0]})
            light_at_heavy.append((asked, light))
        done.set()

    clients = [asyncio.ensure_future(light_traffic(w)) for w in range(6 * cpus)]
    await wait_until(lambda: light >= 10 * cpus, 30)  # every light process busy
    await asyncio.gather(heavy_traffic(), *clients)
    assert len(light_at_heavy) == HEAVY_BATCHES, (light, light_at_heavy)
    assert light_at_heavy[-1][1] < LIGHT_LIMIT
    # The light traffic went on while each heavy batch ran, and stayed in its lane.
    assert all(answered > asked for asked, answered in light_at_heavy), light_at_heavy
    for name in light_models:
        assert set(lanes_of(harness, name)) == {"light"}
    (pid,) = harness.wlm.backend.pids("heavy")
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, pid) == harness.config.heavy_nice
