"""Process trees (with :mod:`psutil`), and free loopback ports: what the benchmark
(``benchlib``), the stress tools (``stresslib``) and the routing experiment (``clusterlib``)
share.

Each of them runs with ``scripts/`` on ``PYTHONPATH`` and imports this module as ``proctools``.
What the cluster command needs too lives in the package, :mod:`mmserver.commands.cluster.procfs`,
and is imported from there; this module adds what only the tools use. Linux only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import psutil

from mmserver.commands.cluster.procfs import (
    HOST,
    ProcessMemory,
    descendants,
    free_port,
    live,
    tree_memory,
)

__all__ = [
    "HOST",
    "ProcessMemory",
    "alive",
    "children_map",
    "descendants",
    "free_port",
    "kill_left",
    "proc_kb",
    "stat_fields",
    "tree_memory",
]


def alive(pid: int) -> bool:
    """Running (gone and zombie processes are not)."""
    try:
        return live(psutil.Process(pid))
    except psutil.Error:
        return False


def children_map() -> dict[int, list[int]]:
    """Live processes by parent pid."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE:
            children.setdefault(proc.info["ppid"], []).append(proc.pid)
    return children


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces): state,
    parent pid, ...; ``None`` when the process is gone. (psutil has no call that answers the
    raw fields; the benchmark reads its CPU ticks from here.)"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_kb(pid: int, name: str, key: str) -> int:
    """A KiB figure of ``/proc/PID/NAME``, e.g. ``("status", "VmRSS")``; 0 when the process is
    gone or the line is missing."""
    try:
        with open(f"/proc/{pid}/{name}") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def kill_left(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to exit, then SIGKILL those still alive; those."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    # Polled rather than psutil.wait_procs, which waits for a zombie that is not our child
    # until the timeout: a zombie has exited.
    give_up = time.monotonic() + timeout
    while any(live(p) for p in procs) and time.monotonic() < give_up:
        time.sleep(0.05)
    left = [p for p in procs if live(p)]
    for proc in left:
        try:
            proc.kill()  # psutil checks first that the pid is still this process
        except psutil.Error:
            pass
    return [p.pid for p in left]
