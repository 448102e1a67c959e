"""What the machine gives this server: CPUs and memory, as a container's limits see them.

In a container the host's core count and free memory are the wrong defaults: a pod limited to two
CPUs on a 64-core node that starts 64 backend processes is throttled, and one whose memory budget
comes from the node's free memory is OOM-killed before it evicts anything. So the defaults come
from, in order:

- CPUs: the cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
  the smallest along the path from the process's cgroup to the root, rounded up), capped by the
  CPU affinity mask (``sched_getaffinity``, which ``taskset`` and cpusets set);
- memory: the cgroup's limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``; the smallest along
  the path), capped by the host's ``MemAvailable``.

Every reader takes the root directory of the file system it reads (``/`` in production), so the
tests pass fake cgroup v1 and v2 trees they write. Each answer says where it came from, for the
log line at start.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/")
#: cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything this large is
#: no limit.
_NO_LIMIT = 1 << 60
_DEFAULT_MEMORY_MB = 4096


@dataclass(frozen=True)
class Limit:
    """A capacity and where it came from (``"cgroup v2 cpu.max 150000 100000"``...)."""

    value: int
    source: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(root: Path) -> dict[str, str]:
    """The process's cgroup per controller from ``/proc/self/cgroup``: ``""`` is the v2
    (unified) hierarchy, otherwise a v1 controller name (``cpu``, ``memory``...)."""
    text = _read(root / "proc/self/cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            paths[""] = path
        for name in controllers.split(","):
            if name:
                paths[name] = path
    return paths


def _chain(mount: Path, path: str) -> Iterator[Path]:
    """The cgroup folders from the process's own up to the hierarchy's root under ``mount``.
    Inside a container the path shown is the host's and the mount is the container's own
    cgroup: a path that is not there starts at the mount itself."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    while parts and not mount.joinpath(*parts).is_dir():
        parts = parts[1:]
    for depth in range(len(parts), -1, -1):
        yield mount.joinpath(*parts[:depth])


def _v1_mount(root: Path, controller: str) -> Path | None:
    base = root / "sys/fs/cgroup"
    for name in (controller, "cpu,cpuacct", "cpuacct,cpu"):
        candidate = base / name
        if candidate.is_dir():
            return candidate
    return None


def _is_v2(root: Path) -> bool:
    return (root / "sys/fs/cgroup/cgroup.controllers").is_file()


def cgroup_cpus(root: Path = ROOT) -> Limit | None:
    """The CPUs the cgroup's quota allows (rounded up, at least 1), or ``None`` with no quota."""
    paths = _cgroup_paths(root)
    best: tuple[float, str] | None = None
    if _is_v2(root) and "" in paths:
        for folder in _chain(root / "sys/fs/cgroup", paths[""]):
            text = _read(folder / "cpu.max")
            if not text:
                continue
            fields = text.split()
            if len(fields) != 2 or fields[0] == "max":
                continue
            try:
                quota, period = int(fields[0]), int(fields[1])
            except ValueError:
                continue
            if quota > 0 and period > 0 and (best is None or quota / period < best[0]):
                best = (quota / period, f"cgroup v2 cpu.max {quota} {period}")
    else:
        mount = _v1_mount(root, "cpu")
        if mount is not None:
            for folder in _chain(mount, paths.get("cpu", "/")):
                quota_text = _read(folder / "cpu.cfs_quota_us")
                period_text = _read(folder / "cpu.cfs_period_us")
                try:
                    quota, period = int(quota_text or ""), int(period_text or "")
                except ValueError:
                    continue
                if quota > 0 and period > 0 and (best is None or quota / period < best[0]):
                    best = (
                        quota / period,
                        f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}",
                    )
    if best is None:
        return None
    return Limit(max(1, math.ceil(best[0] - 1e-9)), best[1])


def cgroup_memory_bytes(root: Path = ROOT) -> Limit | None:
    """The cgroup's memory limit in bytes, or ``None`` with no limit."""
    paths = _cgroup_paths(root)
    best: Limit | None = None
    if _is_v2(root) and "" in paths:
        folders, name, label = _chain(root / "sys/fs/cgroup", paths[""]), "memory.max", "v2"
    else:
        mount = _v1_mount(root, "memory")
        if mount is None:
            return None
        folders = _chain(mount, paths.get("memory", "/"))
        name, label = "memory.limit_in_bytes", "v1"
    for folder in folders:
        text = _read(folder / name)
        if not text or text == "max":
            continue
        try:
            value = int(text)
        except ValueError:
            continue
        if 0 < value < _NO_LIMIT and (best is None or value < best.value):
            best = Limit(value, f"cgroup {label} {name} {value}")
    return best


def affinity_mask() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask; none known off Linux)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return frozenset(getaffinity(0)) if getaffinity is not None else frozenset()


def affinity_cpus() -> int:
    """How many CPUs this process may run on (its affinity mask; off Linux, the CPU count)."""
    return len(affinity_mask()) or max(1, os.cpu_count() or 1)


def cpus(root: Path = ROOT, affinity: int | None = None) -> Limit:
    """The CPUs to size the server by: the cgroup's quota capped by the affinity mask."""
    mask = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpus(root)
    if quota is not None and quota.value < mask:
        return quota
    return Limit(mask, f"CPU affinity mask ({mask} CPUs)")


def available_memory_bytes(root: Path = ROOT) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``: what new allocations can take on the host."""
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def memory_budget(own_bytes: int, root: Path = ROOT, share: float = 0.8) -> Limit:
    """The default memory budget for loaded models: ``share`` of what is left for them, which is
    the cgroup's limit less ``own_bytes`` (what the server's processes hold already), capped by
    the host's available memory."""
    limit = cgroup_memory_bytes(root)
    available = available_memory_bytes(root)
    if limit is not None:
        room = max(0, limit.value - own_bytes)
        if available is None or room <= available:
            mb = int(room * share) // 2**20
            return Limit(
                mb,
                f"{share:.0%} of {limit.source} less {own_bytes // 2**20} MiB used by the server",
            )
    if available is None:
        return Limit(_DEFAULT_MEMORY_MB, "built-in default (no cgroup limit, no /proc/meminfo)")
    return Limit(
        int(available * share) // 2**20, f"{share:.0%} of MemAvailable {available // 2**20} MiB"
    )


def rss_bytes(pids: list[int], root: Path = ROOT) -> int:
    """Resident memory of ``pids`` together (``/proc/PID/statm``; shared pages counted in each,
    so this errs high, which a budget should)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in pids:
        text = _read(root / f"proc/{pid}/statm")
        try:
            total += int((text or "").split()[1]) * page
        except (IndexError, ValueError):
            continue
    return total
