"""The server under test: started on a free loopback port, its process tree, its memory."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
from proctools import children_map, free_port, tree_memory

from mmserver.commands.launch import Child, Serve
from mmserver.store.unpacking import PROCESS_NAME as UNPACK_PROCESS_NAME

REPO = Path(__file__).resolve().parents[2]


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


@dataclass(frozen=True)
class Tree:
    """The server's processes, by role."""

    frontend: int
    fork_server: int | None
    resource_tracker: int | None
    backends: tuple[int, ...]
    others: tuple[int, ...]

    @property
    def count(self) -> int:
        return (
            1
            + len(self.backends)
            + len(self.others)
            + sum(1 for p in (self.fork_server, self.resource_tracker) if p is not None)
        )

    @property
    def pids(self) -> list[int]:
        extra = [p for p in (self.fork_server, self.resource_tracker) if p is not None]
        return [self.frontend, *extra, *self.backends, *self.others]


def tree(frontend: int) -> Tree:
    """The process tree of the server whose frontend is ``frontend``. Backend processes are the
    children of the fork server but for those unpacking archives (in ``others``)."""
    children = children_map()
    fork_server = tracker = None
    others: list[int] = []
    for child in children.get(frontend, []):
        text = cmdline(child)
        if "forkserver" in text:
            fork_server = child
        elif "resource_tracker" in text:
            tracker = child
        else:
            others.append(child)
    backends: tuple[int, ...] = ()
    if fork_server is not None:
        for child in children.get(fork_server, []):
            # The processes unpacking archives are the fork server's children too.
            if comm(child) == UNPACK_PROCESS_NAME:
                others.append(child)
            else:
                backends += (child,)
    return Tree(frontend, fork_server, tracker, backends, tuple(others))


def comm(pid: int) -> str:
    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return ""


@dataclass(frozen=True)
class Memory:
    rss_mb: float
    pss_mb: float
    processes: int
    frontend_rss_mb: float
    backends_rss_mb: float  # the fork server's children


def memory(frontend: int) -> Memory:
    """RSS (``VmRSS``) and PSS (``smaps_rollup``) summed over the server's process tree. RSS
    counts pages shared by the fork server's children once per process; PSS splits them."""
    processes = tree_memory(frontend)
    backends = set(tree(frontend).backends)
    return Memory(
        sum(p.rss_kb for p in processes) / 1024,
        sum(p.pss_kb for p in processes) / 1024,
        len(processes),
        sum(p.rss_kb for p in processes if p.pid == frontend) / 1024,
        sum(p.rss_kb for p in processes if p.pid in backends) / 1024,
    )


class Server:
    """``python -m mmserver serve`` on a free loopback port, in its own session (a Ctrl-C of the
    caller does not reach it); stopped with SIGTERM, and anything left is killed by pid."""

    def __init__(self, store: Path, log_path: Path, *args: str) -> None:
        self.store = store
        self.log_path = log_path
        self.args = args
        self._child = Child(
            Serve(store, free_port(), args=args),
            log_path,
            label="the server",
            cwd=REPO,
            new_session=True,
            append=False,
        )
        self.port = self._child.port
        self.url = self._child.url

    @property
    def pid(self) -> int:
        return self._child.pid

    def start(self, ready_timeout: float = 60.0) -> None:
        """Start it and wait until it answers ``/ping`` (stopping it if it does not)."""
        self._child.start()
        try:
            self._child.wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def remember_family(self) -> None:
        """Note the current descendants, so that they are cleaned up even if orphaned later."""
        self._child.remember_family()

    def stop(self, timeout: float = 60.0) -> tuple[int | None, list[int]]:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; kill any descendant still alive 10 s
        later, by pid. Returns the server's exit code (None if it had to be killed) and the
        descendants that had to be killed."""
        stopped = self._child.stop(timeout, grace_s=10.0)
        return stopped.code, stopped.killed

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def interrupt_on_sigterm() -> None:
    """Make SIGTERM behave like Ctrl-C (KeyboardInterrupt), so that the ``finally`` blocks that
    stop the server run: the server lives in its own session and would outlive us otherwise."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def generate_store(out: Path, count: int) -> None:
    """The reference store (``count`` archives and the examples); nothing to do if current."""
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "generate_store.py"),
            "--out",
            str(out),
            "--count",
            str(count),
        ],
        check=True,
    )
