"""Processes as ``/proc`` shows them, and free loopback ports: what the benchmark
(``benchlib``), the stress tools (``stresslib``) and the cluster tool (``clusterlib``) share.

Each of them runs with ``scripts/`` on ``PYTHONPATH`` and imports this module as ``proctools``.
Linux only.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable

HOST = "127.0.0.1"


def free_port() -> int:
    """A port the kernel picks as free on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces): state,
    parent pid, ...; ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running (gone and zombie processes are not)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children_map() -> dict[int, list[int]]:
    """Live processes by parent pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before children."""
    children = children_map()
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo and len(found) < 10_000:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def proc_kb(pid: int, name: str, key: str) -> int:
    """A KiB figure of ``/proc/PID/NAME``, e.g. ``("status", "VmRSS")`` or
    ``("smaps_rollup", "Pss")``; 0 when the process is gone or the line is missing."""
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
