"""One process at a time in a folder of state (:mod:`mmserver.ops.folderlock`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmserver.ops.folderlock import LOCK_FILE, FolderInUse, FolderLock

HOLDER = """
import sys, time
from mmserver.ops.folderlock import FolderLock
FolderLock(sys.argv[1]).take()
print("held", flush=True)
sys.stdin.read()  # until the test closes it, or kills this process
"""


def test_a_folder_is_held_by_one_lock_at_a_time(tmp_path: Path) -> None:
    folder = tmp_path / "state" / "made"
    first, second = FolderLock(folder), FolderLock(folder)
    first.take()
    assert first.held and (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    since = first.since
    assert since > 0
    first.take()  # held already: nothing
    assert first.since == since
    with pytest.raises(FolderInUse) as refused:
        second.take()
    assert refused.value.pid == os.getpid()
    assert str(refused.value) == f"{folder} is in use by process {os.getpid()}"
    assert not second.held
    first.release()
    first.release()  # not held: nothing
    assert first.since == 0.0
    second.take()
    assert second.held
    second.release()


def test_a_killed_holder_leaves_the_folder_free(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(FolderInUse) as refused:
                FolderLock(folder).take()
            assert refused.value.pid == holder.pid
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
    lock = FolderLock(folder)
    lock.take()
    assert (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"  # the dead holder's pid gone
    lock.release()


def test_a_folder_that_cannot_be_made_is_an_os_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        FolderLock(blocker / "state").take()
