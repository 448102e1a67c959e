"""The server under test: started on a free loopback port, its process tree, its memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
from proctools import HOST, children_map, descendants, free_port, kill_left, tree_memory

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
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.store = store
        self.log_path = log_path
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._family: set[int] = set()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout: float = 60.0) -> None:
        self._log = open(self.log_path, "wb")  # closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("MMSERVER_PORT", None)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mmserver",
                "serve",
                "--model-store",
                str(self.store),
                "--host",
                HOST,
                "--port",
                str(self.port),
                *self.args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        give_up = time.monotonic() + ready_timeout
        while time.monotonic() < give_up:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/ping", timeout=2) as response:
                    if response.status == 200:
                        self.remember_family()
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"the server was not ready in {ready_timeout:.0f} s; see {self.log_path}"
        )

    def remember_family(self) -> None:
        """Note the current descendants, so that they are cleaned up even if orphaned later."""
        if self.process is not None and self.process.poll() is None:  # its pid is still its own
            self._family.update(descendants(self.process.pid))

    def stop(self, timeout: float = 60.0) -> tuple[int | None, list[int]]:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; kill any descendant still alive 10 s
        later, by pid. Returns the server's exit code (None if it had to be killed) and the
        descendants that had to be killed."""
        process = self.process
        code: int | None = None
        left: list[int] = []
        if process is not None:
            self.remember_family()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    code = process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
            else:
                code = process.returncode
            left = kill_left(self._family, 10.0)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code, left

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
