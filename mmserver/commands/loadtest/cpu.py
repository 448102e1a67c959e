"""CPU seconds used by a process tree and by the whole machine, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from mmserver.commands.procfs import descendant_processes


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) used so far by ``pid`` and each of its descendants."""
    out: dict[int, float] = {}
    try:
        procs = [psutil.Process(pid), *descendant_processes(pid)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # exited meanwhile
        out[proc.pid] = times.user + times.system
    return out


def cpu_percent(
    root: int,
    before: dict[int, float],
    after: dict[int, float],
    seconds: float,
) -> dict[str, float]:
    """The CPU use between two :func:`tree_cpu` readings, in % of one core: the root process
    (``main``) and its descendants together (``children``)."""
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    main = used.pop(root, 0.0)
    return {"main": 100 * main / seconds, "children": 100 * sum(used.values()) / seconds}


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (everything but idle and iowait)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(f) for f in fields[:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit_s: float, cores: float = 0.25, window_s: float = 0.5) -> float:
    """Wait (up to ``limit_s``) until the machine is less busy than ``cores`` over
    ``window_s``; the seconds waited. Between load runs the servers idle, so what keeps the
    machine busy then is other programs, which would disturb the next run."""
    waited = 0.0
    while waited < limit_s:
        before = machine_busy()
        time.sleep(window_s)
        if machine_busy() - before < cores * window_s:
            break
        waited += window_s
    return waited
