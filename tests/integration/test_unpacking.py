"""A load's file work in processes of their own (:mod:`mmserver.store.unpacking`), with the fork
server's context the backend processes come from: what they answer, how they die, and who waits
for them."""

from __future__ import annotations

import asyncio
import errno
import gc
import io
import multiprocessing
import os
import signal
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mmserver.config.server import ModelConfig
from mmserver.errors import Forbidden, ModelLoadError, ShuttingDown, UnsafeArchive
from mmserver.lifecycle import files
from mmserver.store.archive import unpack_archive
from mmserver.store.local import ModelStore
from mmserver.store.unpacking import UnpackProcesses
from tests.e2e.server_process import unpacking_pids
from tests.models import make_linear_archive, make_tuned_dir

LIMIT = 2**20


async def _processes(count: int) -> AsyncIterator[UnpackProcesses]:
    unpacker = UnpackProcesses(count, multiprocessing.get_context("forkserver"))
    unpacker.bind(asyncio.get_running_loop())
    try:
        yield unpacker
    finally:
        await unpacker.close()


@pytest.fixture
async def processes() -> AsyncIterator[UnpackProcesses]:
    async for unpacker in _processes(2):
        yield unpacker


@pytest.fixture
async def one_process() -> AsyncIterator[UnpackProcesses]:
    async for unpacker in _processes(1):
        yield unpacker


def _escaping_archive(path: Path) -> Path:
    data = b"x"
    with tarfile.open(path, "w:gz") as tar:
        member = tarfile.TarInfo("../outside.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return path


def _unpack_pids() -> list[int]:
    """This test process's unpacking processes."""
    return unpacking_pids(os.getpid())


async def _opened_for_writing(fifo: Path) -> int:
    """Wait (bounded) until a process has opened ``fifo`` for reading, that is until the request
    naming it runs; the writing end (closing it ends the reader's archive)."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.005)


async def test_archives_unpack_in_named_processes_and_their_errors_come_back(
    processes: UnpackProcesses, tmp_path: Path
) -> None:
    archive = make_linear_archive(tmp_path / "m.tar.gz")
    # From a thread (an object store's download), as from the event loop.
    root = await asyncio.to_thread(
        processes.unpack, archive, tmp_path / "cache" / "m-1", LIMIT, "m"
    )
    assert (root / "model.joblib").read_bytes()
    assert _unpack_pids()  # not in this process: a child named for the operator
    bad = _escaping_archive(tmp_path / "bad.tar.gz")
    with pytest.raises(UnsafeArchive, match=r"member '\.\./outside\.txt' leaves the archive"):
        await asyncio.to_thread(processes.unpack, bad, tmp_path / "cache" / "bad-1", LIMIT, "bad")
    assert not (tmp_path / "cache" / "bad-1").exists()
    assert not (tmp_path / "outside.txt").exists()
    # The process that refused the archive unpacks the next one.
    again = await processes.run(
        "m", "unpacking m.tar.gz", unpack_archive, archive, tmp_path / "cache" / "m-2", LIMIT, "m"
    )
    assert (again / "model.joblib").read_bytes() == (root / "model.joblib").read_bytes()


async def test_a_models_whole_file_work_runs_in_a_process(
    processes: UnpackProcesses, tmp_path: Path
) -> None:
    """Lookup, unpacking and serving.properties in one request: an error of the lookup is
    raised, an error of the files is answered as a value (the model's failure)."""
    root = tmp_path / "store"
    make_linear_archive(root / "m.tar.gz")
    make_tuned_dir(root / "tuned")
    _escaping_archive(root / "bad.tar.gz")
    elsewhere = make_linear_archive(tmp_path / "elsewhere.tar.gz")
    (root / "linked.tar.gz").symlink_to(elsewhere)
    store = ModelStore(root, tmp_path / "cache", LIMIT).portable()
    defaults = ModelConfig()
    what = "preparing its files"

    entry, prepared = await processes.run("m", what, files.find_and_prepare, store, "m", defaults)
    assert entry is not None and entry.kind == "archive" and entry.path == root / "m.tar.gz"
    assert not isinstance(prepared, Exception) and prepared is not None
    model_dir, config, requirements = prepared
    assert (model_dir / "model.joblib").is_file() and model_dir.is_relative_to(tmp_path / "cache")
    assert config is None  # no serving.properties: the caller's defaults apply as they are
    assert requirements is None  # no requirements.txt: the server's own environment
    entry, prepared = await processes.run(
        "tuned", what, files.find_and_prepare, store, "tuned", defaults
    )
    assert not isinstance(prepared, Exception) and prepared is not None
    assert prepared[0] == root / "tuned"
    tuned = prepared[1]
    assert tuned is not None and (tuned.batch_size, tuned.max_workers) == (8, 2)
    assert await processes.run("gone", what, files.find_and_prepare, store, "gone", defaults) == (
        None,
        None,
    )
    entry, prepared = await processes.run(
        "bad", what, files.find_and_prepare, store, "bad", defaults
    )
    assert entry is not None and isinstance(prepared, UnsafeArchive)
    assert "leaves the archive" in prepared.message and prepared.model == "bad"
    with pytest.raises(Forbidden, match="outside the model store"):
        await processes.run("linked", what, files.find_and_prepare, store, "linked", defaults)
    # The allowed model roots cross the process with the store.
    allowing = ModelStore(root, tmp_path / "cache", LIMIT, [tmp_path]).portable()
    entry, prepared = await processes.run(
        "linked", what, files.find_and_prepare, allowing, "linked", defaults
    )
    assert entry is not None and prepared is not None and not isinstance(prepared, Exception)


async def test_a_killed_unpacking_process_fails_its_request_and_is_replaced(
    processes: UnpackProcesses, tmp_path: Path
) -> None:
    archive = make_linear_archive(tmp_path / "m.tar.gz")
    await asyncio.to_thread(processes.unpack, archive, tmp_path / "cache" / "m-1", LIMIT, "m")
    # The one started process opens a fifo for reading and waits: kill it then.
    fifo = tmp_path / "fifo.tar.gz"
    os.mkfifo(fifo)
    stuck = asyncio.ensure_future(
        asyncio.to_thread(processes.unpack, fifo, tmp_path / "cache" / "f-1", LIMIT, "f")
    )
    writer = await _opened_for_writing(fifo)  # the process runs the fifo's request
    pids = _unpack_pids()
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    os.close(writer)
    with pytest.raises(ModelLoadError) as failure:
        await asyncio.wait_for(stuck, 30)
    assert "model f: the process unpacking fifo.tar.gz died" in failure.value.message
    root = await asyncio.to_thread(
        processes.unpack, archive, tmp_path / "cache" / "m-2", LIMIT, "m"
    )
    assert (root / "model.joblib").is_file()
    assert len(_unpack_pids()) == 1 and _unpack_pids() != pids  # a replacement


async def test_requests_wait_in_order_and_a_left_request_keeps_its_process_until_answered(
    one_process: UnpackProcesses, tmp_path: Path
) -> None:
    """A request whose caller left (a cancelled load) holds its process until the process
    answers it: the next request gets its own answer, not the left one's."""
    archive = make_linear_archive(tmp_path / "m.tar.gz")
    fifo = tmp_path / "fifo.tar.gz"
    os.mkfifo(fifo)
    left = asyncio.ensure_future(
        one_process.run(
            "f", "unpacking", unpack_archive, fifo, tmp_path / "cache" / "f-1", LIMIT, "f"
        )
    )
    writer = await _opened_for_writing(fifo)  # the process runs the fifo's request
    later = [
        asyncio.ensure_future(
            one_process.run(
                "m", "unpacking", unpack_archive, archive, tmp_path / "cache" / f"m-{i}", LIMIT, "m"
            )
        )
        for i in range(3)
    ]
    left.cancel()
    # The fifo's reader gets an empty archive and answers with an error nobody waits for.
    os.close(writer)
    roots = await asyncio.wait_for(asyncio.gather(*later), 30)
    assert roots == [tmp_path / "cache" / f"m-{i}" for i in range(3)]
    assert left.cancelled()


async def test_closing_refuses_the_requests_still_waiting(
    one_process: UnpackProcesses, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo.tar.gz"
    os.mkfifo(fifo)
    running = asyncio.ensure_future(
        one_process.run(
            "f", "unpacking", unpack_archive, fifo, tmp_path / "cache" / "f-1", LIMIT, "f"
        )
    )
    waiting = asyncio.ensure_future(
        one_process.run("g", "unpacking", unpack_archive, fifo, tmp_path / "g", LIMIT, "g")
    )
    writer = await _opened_for_writing(fifo)  # the first request runs; the second waits
    closing = asyncio.ensure_future(one_process.close())
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(waiting, 30)
    os.close(writer)  # the running one ends
    with pytest.raises(ModelLoadError):
        await asyncio.wait_for(running, 30)
    await asyncio.wait_for(closing, 30)
    with pytest.raises(ShuttingDown, match="model h is not loaded: the server is stopping"):
        await one_process.run("h", "unpacking", unpack_archive, fifo, tmp_path / "h", LIMIT, "h")


async def test_an_unpacking_process_freezes_what_it_was_forked_with(
    one_process: UnpackProcesses,
) -> None:
    """The fork server's modules are never garbage: the process freezes them at start, so that
    its collections do not scan them (nor copy the pages it shares with the fork server)."""
    frozen = await one_process.run("m", "counting", gc.get_freeze_count)
    assert frozen > 10_000  # the fork server's preloaded modules' objects
    # Frozen once, at start: not again at each request (what requests make stays collectable).
    assert await one_process.run("m", "counting", gc.get_freeze_count) == frozen
