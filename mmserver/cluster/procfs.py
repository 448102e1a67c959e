"""Processes as ``/proc`` shows them, by pid, and free loopback ports. Linux only.

The cluster's process handling (:mod:`mmserver.cluster.procs`) builds on these; the tools under
``scripts/`` (benchmark, stress tools) import them through ``scripts/proctools.py``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory in KiB: resident (RSS, ``VmRSS``; shared pages counted in each
    process) and proportional (PSS, ``smaps_rollup``; shared pages split between the sharers)."""

    pid: int
    name: str
    rss_kb: int
    pss_kb: int


def tree_memory(pid: int) -> list[ProcessMemory]:
    """The memory of ``pid`` and of each live descendant, ``pid`` first (parents before
    children); a process that exits meanwhile is left out."""
    out = []
    for each in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{each}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        out.append(
            ProcessMemory(
                each, name, proc_kb(each, "status", "VmRSS"), proc_kb(each, "smaps_rollup", "Pss")
            )
        )
    return out
