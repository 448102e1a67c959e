"""Sections measured with wrk: closed loop, open loop, scaling of the hot model, batching.

Every section runs ``runs`` times; within a run the server and its baseline (the HTTP floor, or
the unbatched model) alternate which goes first, so slow drift of the machine hits both alike.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchlib.servers import Server
from mmserver.commands.loadtest import cpu, wrk
from mmserver.commands.loadtest.client import (
    Client,
    Poller,
    max_workers,
    worker_count,
    worker_start_times,
)

HOT_MODEL = "sklearn-0"
Log = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    duration_s: float
    concurrency: int
    open_connections: int
    threads: int
    runs: int
    api: str
    quiet_wait_s: float = 0.0


def describe_run(name: str, load: wrk.Load, result: wrk.WrkResult) -> str:
    errors = f", errors {result.errors}" if result.errors else ""
    cpu = result.cpu
    usage = (
        f"  cpu % server {cpu.get('server', 0):.0f}+{cpu.get('server_children', 0):.0f}"
        f" wrk {cpu.get('wrk', 0):.0f}"
    )
    rate = f" (offered {load.rate:.0f})" if load.rate else ""
    if result.waited_s:
        errors += f"  (waited {result.waited_s:.1f} s for a quiet machine)"
    return (
        f"  {name:<8} {load.pattern:<8} {result.rps:8.0f} req/s{rate}  p50 {result.p50_ms:6.2f}"
        f"  p99 {result.p99_ms:7.2f}  max {result.max_ms:7.1f} ms{usage}{errors}"
    )


def _reset_workers(server: Server, model: str) -> int:
    """Unload ``model`` and load it again, so it starts from its minWorkers; the worker count."""
    client = Client(server.port)
    try:
        client.request("DELETE", f"/models/{model}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, _ = client.predict(model)
            if status == 200:
                break
            time.sleep(0.1)
        return worker_count(client.describe(model))
    finally:
        client.close()


def _polled(
    server: Server,
    load: wrk.Load,
    reset: bool,
    log: Log,
    quiet_wait_s: float,
) -> tuple[wrk.WrkResult, dict[str, Any]]:
    """Run ``load`` against mmserver while polling the hot model's workers (and timing one
    probe request to it) every 50 ms; with ``reset``, start the hot model from minWorkers."""
    waited = cpu.wait_quiet(quiet_wait_s) if quiet_wait_s else 0.0
    client = Client(server.port)
    try:
        at_start = (
            _reset_workers(server, HOT_MODEL) if reset else worker_count(client.describe(HOT_MODEL))
        )
    finally:
        client.close()
    burst = time.time()
    poller = Poller(server.port, HOT_MODEL, t0=burst, limit_s=load.duration_s + 60).start()
    try:
        result = wrk.run(load, server.pid)
    finally:
        samples = poller.stop()
    result.waited_s = waited
    client = Client(server.port)
    try:
        described = client.describe(HOT_MODEL)
    finally:
        client.close()
    top = max_workers(described)
    reached = [s.t for s in samples if top and s.workers >= top]
    starts = [t - burst for t in worker_start_times(described) if t >= burst]
    if top and worker_count(described) >= top:
        to_max_ms: float | None = max(starts) * 1e3 if starts else 0.0
    else:
        to_max_ms = None
    scaling = {
        "workers_at_start": at_start,
        "max_workers": top,
        "workers_at_end": worker_count(described),
        "to_max_ms": to_max_ms,  # from the workers' startTime
        "to_max_polled_ms": reached[0] * 1e3 if reached else None,  # 50 ms resolution
        "samples": [s.__dict__ for s in samples],
    }
    if reset:
        log(
            f"           hot model: {at_start} -> {top} workers in "
            f"{'-' if to_max_ms is None else f'{to_max_ms:.0f} ms'}"
        )
    return result, scaling


#: Connections of the scaling burst: a model batching up to 32 queued jobs gets a second
#: worker only once more than 2 x 32 jobs wait (DJL's rule), which 32 connections never make.
BURST_CONNECTIONS = 256
BURST_SECONDS = 3.0


def _burst(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """A burst on the hot model alone, from minWorkers: how soon it reaches maxWorkers."""
    load = wrk.Load(
        url=server.url,
        pattern="single",
        model=HOT_MODEL,
        duration_s=BURST_SECONDS,
        connections=BURST_CONNECTIONS,
        threads=settings.threads,
        api=settings.api,
    )
    _, polled = _polled(server, load, True, log, settings.quiet_wait_s)
    polled["reset"] = True
    return polled


def _alternating(
    server: Server, floor: Server | None, run: int, peer: Server | None = None
) -> list[tuple[str, Server]]:
    """mmserver, the floor (and a peer), in turns: the order rotates from run to run."""
    targets = [("mmserver", server)] + ([("floor", floor)] if floor else [])
    if peer is not None:
        targets.append((peer.name, peer))
    return rotated(targets, run)


T = TypeVar("T")


def rotated(items: Sequence[T], run: int) -> list[T]:
    """``items`` in the order of run ``run``: rotated by one each run, so no case is always
    measured first (on a machine growing busier or quieter)."""
    shift = run % len(items)
    return [*items[shift:], *items[:shift]]


def _schedule(
    server: Server,
    floor: Server | None,
    patterns: list[str],
    settings: Settings,
    log: Log,
    title: str,
    peer: Server | None = None,
) -> Iterator[tuple[int, str, str, Server]]:
    """``(run, pattern, server name, server)`` for every load run of a section, in order: each
    run logs its title, then goes through the patterns, alternating mmserver, the floor and the
    peer."""
    for run in range(settings.runs):
        log(f"{title}, run {run + 1}/{settings.runs}")
        for pattern in patterns:
            for name, target in _alternating(server, floor, run, peer):
                yield run, pattern, name, target


def _load(
    target: Server,
    pattern: str,
    settings: Settings,
    run: int,
    *,
    connections: int,
    rate: float = 0.0,
) -> wrk.Load:
    """The wrk load of one run (its seed follows from ``run``)."""
    return wrk.Load(
        url=target.url,
        pattern=pattern,
        duration_s=settings.duration_s,
        connections=connections,
        threads=settings.threads,
        rate=rate,
        api=target.api or settings.api,
        seed=run + 1,
    )


def closed_loop(
    server: Server,
    floor: Server | None,
    patterns: list[str],
    settings: Settings,
    track_scaling: bool,
    log: Log,
    peer: Server | None = None,
) -> dict[str, Any]:
    """Each pattern at ``concurrency`` connections, alternating mmserver, the floor and the
    peer."""
    out: dict[str, Any] = {p: {"mmserver": [], "floor": [], "polled": []} for p in patterns}
    if peer is not None:
        for p in patterns:
            out[p][peer.name] = []
    runs = _schedule(server, floor, patterns, settings, log, "closed loop", peer)
    for run, pattern, name, target in runs:
        load = _load(target, pattern, settings, run, connections=settings.concurrency)
        if name == "mmserver":
            if pattern == "hot" and track_scaling:
                out[pattern]["polled"].append(_burst(target, settings, log))
            result, polled = _polled(target, load, False, log, settings.quiet_wait_s)
            polled["reset"] = False
            out[pattern]["polled"].append(polled)
        elif target.name == "mmserver":
            # A --baseline-exe build: polled as mmserver is, so both carry the same extra load.
            result, _ = _polled(target, load, False, log, settings.quiet_wait_s)
        else:
            result = wrk.run(load, target.pid, settings.quiet_wait_s)
        out[pattern][name].append(result.to_json())
        log(describe_run(name, load, result))
    return out


def open_loop(
    server: Server,
    floor: Server | None,
    patterns: list[str],
    rate: float,
    settings: Settings,
    log: Log,
    peer: Server | None = None,
) -> dict[str, Any]:
    """Each pattern at a fixed offered ``rate``, alternating mmserver, the floor and the peer."""
    out: dict[str, Any] = {"rate": rate}
    names = ["mmserver", "floor"] + ([peer.name] if peer is not None else [])
    out.update({p: {name: [] for name in names} for p in patterns})
    title = f"open loop at {rate:.0f} req/s"
    schedule = _schedule(server, floor, patterns, settings, log, title, peer)
    for run, pattern, name, target in schedule:
        load = _load(
            target, pattern, settings, run + 100, connections=settings.open_connections, rate=rate
        )
        result = wrk.run(load, target.pid, settings.quiet_wait_s)
        out[pattern][name].append(result.to_json())
        late = f"  late sends {result.late}/{result.sent}" if result.late else ""
        log(describe_run(name, load, result) + late)
    return out


def batching(
    server: Server,
    models: dict[str, str],
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    """The same closed-loop load on the slow model without and with batching, alternated."""
    client = Client(server.port)
    try:
        for model in models.values():
            for _ in range(5):
                client.predict(model)
    finally:
        client.close()
    out: dict[str, Any] = {label: [] for label in models}
    for run in range(settings.runs):
        log(f"batching, run {run + 1}/{settings.runs}")
        order = list(models.items())
        if run % 2:
            order.reverse()
        for label, model in order:
            load = wrk.Load(
                url=server.url,
                pattern="single",
                model=model,
                duration_s=settings.duration_s,
                connections=settings.concurrency,
                threads=settings.threads,
                api=settings.api,
            )
            result = wrk.run(load, server.pid, settings.quiet_wait_s)
            out[label].append(result.to_json())
            log(describe_run(label, load, result))
    return out


def profile(
    server: Server,
    settings: Settings,
    seconds: float,
    out_dir: Path,
    log: Log,
    *,
    pattern: str = "hot",
    rate: float = 0.0,
) -> dict[str, Any]:
    """py-spy on the frontend process and on the busiest backend process during a run of
    ``pattern``, closed loop, or open loop at ``rate`` requests a second: collapsed stacks
    (``profile-frontend.txt``, ``profile-backend.txt``; any flame graph tool reads them) and the
    top frames by own time.

    py-spy samples wall time while a thread is not idle: on a machine whose CPUs are shared, a
    process preempted inside a system call (a socket write that wakes its reader) is counted
    there, so system calls that wake another process look dearer than their CPU cost."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        log("profile: py-spy not found (pip install py-spy); skipped")
        return {"skipped": "py-spy not installed"}
    load = wrk.Load(
        url=server.url,
        pattern=pattern,
        duration_s=seconds + 6,
        connections=settings.open_connections if rate else settings.concurrency,
        threads=settings.threads,
        rate=rate,
        api=settings.api,
    )
    proc = wrk.start(load)
    out: dict[str, Any] = {}
    try:
        before = cpu.tree_cpu(server.pid)
        time.sleep(1.5)
        after = cpu.tree_cpu(server.pid)
        used = {pid: after[pid] - before.get(pid, 0.0) for pid in after if pid != server.pid}
        targets = {"frontend": server.pid}
        if used:
            targets["backend"] = max(used, key=lambda pid: used[pid])
        spies = {
            role: subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(round(seconds)),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--nonblocking",
                    "-o",
                    str(out_dir / f"profile-{role}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role, pid in targets.items()
        }
        for spy in spies.values():
            try:
                spy.wait(seconds + 60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
    finally:
        result = wrk.finish(proc, load)
    for role, pid in targets.items():
        raw = out_dir / f"profile-{role}.txt"
        if raw.is_file():
            own, total = top_frames(raw)
            out[role] = {"pid": pid, "raw": str(raw), "own": own, "samples": total}
    out["rps"] = result.rps
    out["load"] = f"{pattern} pattern" + (f" at {rate:.0f} req/s" if rate else "")
    log(
        f"profile: {', '.join(str(out_dir / f'profile-{r}.txt') for r in targets)} "
        f"({result.rps:.0f} req/s meanwhile)"
    )
    return out


def top_frames(raw: Path, limit: int = 25) -> tuple[list[tuple[str, float]], int]:
    """Frames by own time (share of samples whose innermost frame it is) from py-spy's raw
    (collapsed stacks) output, and the number of samples."""
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frame = stack.split(";")[-1]
        own[frame] = own.get(frame, 0) + int(count)
        total += int(count)
    ranked = sorted(own.items(), key=lambda kv: kv[1], reverse=True)[:limit]
    return [(frame, n / total if total else 0.0) for frame, n in ranked], total
