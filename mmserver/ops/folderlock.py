"""One process at a time in a folder of state: the server's ``state_dir`` (its asynchronous
journal, inline inputs and staged answers) and a batch transform's journal. Two processes that
took up the same journal would both run what it holds, and answer requests twice.

The lock is ``flock`` on ``mmserver.lock`` in the folder, taken without waiting. The kernel
drops it when the process ends, however it ends (SIGKILL included), so a restart after a crash
finds the folder free; a process still holding it is named by the pid written in the file. The
file is never removed: removing it would let one process lock the old file while another locks
a new one. The descriptor is not inherited by child processes (``O_CLOEXEC``; the backend and
side processes are spawned or forked from a fork server, never forked from the holder).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

#: The lock file's name in the folder it guards.
LOCK_FILE = "mmserver.lock"


class FolderInUse(Exception):
    """Another process holds the folder (``pid``: its id as it wrote it, or None if unknown)."""

    def __init__(self, folder: Path, pid: int | None) -> None:
        holder = f"process {pid}" if pid else "another process"
        super().__init__(f"{folder} is in use by {holder}")
        self.folder = folder
        self.pid = pid


class FolderLock:
    """The lock on ``folder`` (made if missing), held from :meth:`take` to :meth:`release` or
    the end of the process."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        #: When the lock was taken (a :func:`time.time`; 0.0 while not held): what is older
        #: in the folder was left by an earlier holder.
        self.since = 0.0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> None:
        """Hold the folder, or raise :class:`FolderInUse` at once if another process (or
        another lock in this one) holds it; ``OSError`` when the folder cannot be used."""
        if self._fd is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise FolderInUse(self.folder, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self.since = time.time()

    def release(self) -> None:
        """Let the folder go (nothing if not held)."""
        fd, self._fd = self._fd, None
        self.since = 0.0
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file drops the lock


def _holder(fd: int) -> int | None:
    """The pid the holder wrote in the lock file (None before it has, or if unreadable)."""
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
