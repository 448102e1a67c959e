"""Processes as ``/proc`` shows them, and free loopback ports: what the benchmark
(``benchlib``), the stress tools (``stresslib``) and the routing experiment (``clusterlib``)
share.

Each of them runs with ``scripts/`` on ``PYTHONPATH`` and imports this module as ``proctools``.
What the cluster command needs too lives in the package, :mod:`mmserver.cluster.procfs`, and is
imported from there; this module adds what only the tools use. Linux only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

from mmserver.cluster.procfs import (
    HOST,
    ProcessMemory,
    children_map,
    descendants,
    free_port,
    proc_kb,
    stat_fields,
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
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def kill_left(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to exit, then SIGKILL those still alive; those."""
    pids = list(pids)
    give_up = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < give_up:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
