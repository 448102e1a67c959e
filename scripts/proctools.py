"""Process trees (with :mod:`psutil`), and free loopback ports: what the benchmark
(``benchlib``), the stress tools (``stresslib``) and the routing experiment (``clusterlib``)
share.

Each of them runs with ``scripts/`` on ``PYTHONPATH`` and imports this module as ``proctools``.
What the package's commands need too lives in the package, :mod:`mmserver.commands.procfs`,
and is imported from there (a server started, ready and stopped is
:mod:`mmserver.commands.launch`'s); this module adds what only the tools use. Linux only.
"""

from __future__ import annotations

import psutil

from mmserver.commands.procfs import (
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
