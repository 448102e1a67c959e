"""Archives unpacked in processes of their own (:mod:`mmserver.store.unpacking`), with the fork
server's context the backend processes come from."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmserver.errors import ModelLoadError, UnsafeArchive
from mmserver.store.unpacking import PROCESS_NAME, UnpackProcesses
from tests.e2e.server_process import descendants
from tests.models import make_linear_archive

LIMIT = 2**20


@pytest.fixture
def processes() -> Iterator[UnpackProcesses]:
    unpacker = UnpackProcesses(2, multiprocessing.get_context("forkserver"))
    try:
        yield unpacker
    finally:
        unpacker.close()


def _escaping_archive(path: Path) -> Path:
    data = b"x"
    with tarfile.open(path, "w:gz") as tar:
        member = tarfile.TarInfo("../outside.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return path


def _unpack_pids() -> list[int]:
    """This test process's descendants named as unpacking processes."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() == PROCESS_NAME:
                    pids.append(pid)
        except OSError:
            continue
    return pids


def test_archives_unpack_in_named_processes_and_their_errors_come_back(
    processes: UnpackProcesses, tmp_path: Path
) -> None:
    archive = make_linear_archive(tmp_path / "m.tar.gz")
    root = processes.unpack(archive, tmp_path / "cache" / "m-1", LIMIT, "m")
    assert (root / "model.joblib").read_bytes()
    assert _unpack_pids()  # not in this process: a child named for the operator
    bad = _escaping_archive(tmp_path / "bad.tar.gz")
    with pytest.raises(UnsafeArchive, match=r"member '\.\./outside\.txt' leaves the archive"):
        processes.unpack(bad, tmp_path / "cache" / "bad-1", LIMIT, "bad")
    assert not (tmp_path / "cache" / "bad-1").exists()
    assert not (tmp_path / "outside.txt").exists()
    # The process that refused the archive unpacks the next one.
    again = processes.unpack(archive, tmp_path / "cache" / "m-2", LIMIT, "m")
    assert (again / "model.joblib").read_bytes() == (root / "model.joblib").read_bytes()


def test_a_killed_unpacking_process_fails_its_archive_and_is_replaced(
    processes: UnpackProcesses, tmp_path: Path
) -> None:
    archive = make_linear_archive(tmp_path / "m.tar.gz")
    processes.unpack(archive, tmp_path / "cache" / "m-1", LIMIT, "m")
    # Hold the pipe of the one started process: a request that no process answers ...
    fifo = tmp_path / "fifo.tar.gz"
    os.mkfifo(fifo)
    failure: list[BaseException] = []

    def stuck() -> None:
        try:
            processes.unpack(fifo, tmp_path / "cache" / "f-1", LIMIT, "f")
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=stuck)
    thread.start()
    # ... the process opens the fifo for reading and waits for a writer: kill it meanwhile.
    pids = _unpack_pids()
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ModelLoadError)
    assert "the process unpacking fifo.tar.gz died" in failure[0].message
    root = processes.unpack(archive, tmp_path / "cache" / "m-2", LIMIT, "m")
    assert (root / "model.joblib").is_file()
