"""The warm set in process: written as models load, loaded again by the next server on the same
``state_dir`` before any request names them (a version too), a request for a model the restore
is loading served by that one load, and a file that is not a warm set ignored."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from mmserver.lifecycle.record import ModelStatus
from mmserver.lifecycle.warmfile import FILE_NAME, WarmFileError, WarmModel, decode, encode
from tests.behaviour_models import make_slow_load_dir
from tests.integration.harness import Harness, Serve, wait_until
from tests.integration.test_versions import make_versioned_store
from tests.models import make_linear_archive

RESTORE_S = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = make_versioned_store(tmp_path / "store")
    for name in ("a", "b", "c"):
        make_linear_archive(root / f"{name}.tar.gz")
    return root


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


async def start(serve: Serve, store: Path, state: Path, **options: object) -> Harness:
    return await serve(model_store=str(store), state_dir=str(state), **options)


async def stop(harness: Harness) -> None:
    """Stop the server as SIGTERM does (the fixture's own stop is then a no-op)."""
    runner = harness.asynchronous
    runner.close()
    await asyncio.gather(runner.stop(2.0), harness.wlm.stop(drain_timeout=2.0))


async def restored(harness: Harness) -> None:
    warm = harness.wlm.warm
    assert warm is not None
    await asyncio.wait_for(warm.restored.wait(), RESTORE_S)


def plant(state: Path, text: str) -> Path:
    """The warm set's file in ``state``, holding ``text``."""
    state.mkdir()
    file = state / FILE_NAME
    file.write_text(text)
    return file


def read(state: Path) -> list[WarmModel]:
    try:
        return decode((state / FILE_NAME).read_text())
    except (FileNotFoundError, WarmFileError):
        return []


async def predict(harness: Harness, path: str) -> None:
    response = await harness.post(path, "[[0.5]]")
    assert response.status == 200, await response.text()


async def test_the_loaded_models_are_written_and_loaded_again_at_the_next_start(
    serve: Serve, store: Path, state: Path
) -> None:
    first = await start(serve, store, state)
    for path in ("/predictions/a", "/predictions/versioned/1", "/predictions/c"):
        await predict(first, path)
    # Written as they loaded, without a stop: most recently used first.
    await wait_until(lambda: [m.key for m in read(state)] == ["c", "versioned/1", "a"])
    await predict(first, "/predictions/a")  # a is the most recently used now
    await stop(first)
    assert [m.key for m in read(state)] == ["a", "c", "versioned/1"]

    second = await start(serve, store, state)
    await restored(second)
    wlm = second.wlm
    assert [wlm.status(key) for key in ("a", "c", "versioned/1", "b")] == [
        ModelStatus.READY,
        ModelStatus.READY,
        ModelStatus.READY,
        ModelStatus.UNLOADED,
    ]
    # No request named them; their order of use is the one before the restart.
    assert await loads(second) == 3
    assert list(wlm.room.loaded) == ["versioned/1", "c", "a"]
    samples = await second.samples()
    assert {v for k, v in samples.items() if k[0] == "mmserver_requests_total"} <= {0.0}


async def test_a_request_for_a_model_being_restored_waits_for_that_load(
    serve: Serve, store: Path, state: Path, tmp_path: Path
) -> None:
    started, gate = tmp_path / "load-started", tmp_path / "load-gate"
    make_slow_load_dir(store / "slow", started, gate)
    plant(state, encode([WarmModel("slow", 1), WarmModel("a", 1)]))
    harness = await start(serve, store, state)
    await wait_until(started.exists, RESTORE_S)  # the restore's load of slow holds
    assert harness.wlm.status("slow") is ModelStatus.LOADING
    request = asyncio.ensure_future(predict(harness, "/predictions/slow"))
    await wait_until(waiting_for_a_load)  # the request is in, waiting for slow's load
    assert harness.wlm.status("slow") is ModelStatus.LOADING
    gate.touch()
    await asyncio.wait_for(request, RESTORE_S)
    await restored(harness)
    assert harness.wlm.status("a") is ModelStatus.READY
    assert await loads(harness) == 2  # slow once, for both


async def health(harness: Harness) -> tuple[int, int]:
    """The statuses of ``/v2/health/ready`` and ``/ping``."""
    ready = await harness.client.get("/v2/health/ready")
    ping = await harness.client.get("/ping")
    assert (await ready.json()) == {"ready": ready.status == 200}
    return ready.status, ping.status


@pytest.mark.parametrize(("timeout", "held"), [(0.0, False), (RESTORE_S, True)])
async def test_with_a_ready_timeout_the_server_is_ready_once_its_warm_set_is_loaded(
    serve: Serve, store: Path, state: Path, tmp_path: Path, timeout: float, held: bool
) -> None:
    started, gate = tmp_path / "load-started", tmp_path / "load-gate"
    make_slow_load_dir(store / "slow", started, gate)
    plant(state, encode([WarmModel("a", 1), WarmModel("slow", 1)]))
    harness = await start(serve, store, state, warm_ready_timeout=timeout)
    await wait_until(started.exists, RESTORE_S)  # the restore's load of slow holds
    # Not ready while the models it had are loaded again (0: ready meanwhile, as without).
    assert await health(harness) == ((503, 503) if held else (200, 200))
    gate.touch()
    await restored(harness)
    assert await health(harness) == (200, 200)
    assert harness.wlm.status("slow") is ModelStatus.READY


async def test_the_ready_timeout_bounds_the_wait_for_the_warm_set(
    serve: Serve, store: Path, state: Path, tmp_path: Path
) -> None:
    started, gate = tmp_path / "load-started", tmp_path / "load-gate"
    make_slow_load_dir(store / "slow", started, gate)
    plant(state, encode([WarmModel("slow", 1)]))
    harness = await start(serve, store, state, warm_ready_timeout=0.2)
    await wait_until(started.exists, RESTORE_S)
    await wait_until(harness.wlm.healthy, RESTORE_S)  # 0.2 s after the start
    # Ready with the restore still held: a model slow to load does not keep the server out.
    assert harness.wlm.status("slow") is ModelStatus.LOADING
    assert await health(harness) == (200, 200)
    gate.touch()
    await restored(harness)


def waiting_for_a_load() -> bool:
    """Whether a request waits for its model's load (its submission's task)."""
    return any(
        task.get_coro().__qualname__ == "Submitter._after_load"  # type: ignore[union-attr]
        for task in asyncio.all_tasks()
    )


async def loads(harness: Harness) -> float:
    return (await harness.samples())[("mmserver_model_loads_total", ())]


async def test_a_stop_during_the_restore_keeps_the_models_it_has_not_reached(
    serve: Serve, store: Path, state: Path, tmp_path: Path
) -> None:
    started, gate = tmp_path / "load-started", tmp_path / "load-gate"
    make_slow_load_dir(store / "slow", started, gate)
    file = plant(state, encode([WarmModel("a", 1), WarmModel("slow", 1), WarmModel("b", 1)]))
    before = file.stat().st_ino
    harness = await start(serve, store, state)
    await wait_until(started.exists, RESTORE_S)  # a is loaded; the restore's load of slow holds
    stopping = asyncio.ensure_future(stop(harness))
    await wait_until(lambda: file.stat().st_ino != before)  # written again (a new file)
    gate.touch()
    await asyncio.wait_for(stopping, RESTORE_S)
    assert [m.key for m in read(state)] == ["a", "slow", "b"]
    assert harness.wlm.status("b") is ModelStatus.UNLOADED


async def test_a_model_gone_from_the_store_is_skipped_and_the_restore_goes_on(
    serve: Serve, store: Path, state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mmserver.lifecycle.warmset")
    warm = [WarmModel("gone", 2), WarmModel("versioned/9", 1), WarmModel("b", 1)]
    file = plant(state, encode(warm))
    harness = await start(serve, store, state)
    await restored(harness)
    assert harness.wlm.status("b") is ModelStatus.READY
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"restoring 3 warm model(s) from {file}, most recently used first"
    skipped = [line for line in said if line.startswith("warm set: model")]
    assert [line.split(":")[1] for line in skipped] == [
        " model gone skipped",
        " model versioned/9 skipped",
    ], said
    assert skipped[1].endswith("model versioned has no version 9; its versions are 1, 2")
    assert said[-1].startswith(f"warm set: 1 of 3 model(s) restored from {file} in ")
    assert said[-1].endswith("(2 skipped, 0 left out for want of room)")


@pytest.mark.parametrize("text", ["{not json", '{"format": 1, "models": [{"model": "../x"}]}'])
async def test_a_file_that_is_not_a_warm_set_is_ignored_and_the_server_starts_cold(
    serve: Serve, store: Path, state: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    caplog.set_level(logging.WARNING, logger="mmserver.lifecycle.warmset")
    plant(state, text)
    harness = await start(serve, store, state)
    await restored(harness)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"the warm set in {state / FILE_NAME} is ignored (the server starts")
    assert not harness.wlm.room.loaded
    await predict(harness, "/predictions/b")
    await stop(harness)
    assert read(state) == [WarmModel("b", 1, *_sizes(read(state)[0]))]


def _sizes(model: WarmModel) -> tuple[int, int]:
    return model.memory_bytes, model.copy_bytes
