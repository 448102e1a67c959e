"""Run wrk with the load script (``load.lua``) and read the JSON line it prints; or, where wrk is
not installed, :mod:`mmserver.commands.loadtest.pyload`, which takes the same parameters and prints
the same line.

Closed loop: ``threads`` wrk threads keep ``connections`` connections busy, each sending its next
request as soon as the previous answer arrives.

Open loop: each wrk thread offers ``rate / threads`` requests per second on a fixed schedule
(``load.lua``'s ``delay()``), spread over its connections. wrk times a request from when it is
written, so a send that had to wait for a free connection hides that wait. The script counts the
sends that went out more than 1 ms after their slot (a share ``f`` of them); every other request's
latency as seen from its slot is at most wrk's latency plus 1 ms. Hence the p99 seen from the
schedule is at most wrk's quantile ``99 + 100 f`` plus 1 ms: :attr:`WrkResult.p99_bound_ms`.
With enough connections ``f`` is 0 and the bound is wrk's own p99 plus 1 ms.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.commands.loadtest import cpu

LUA_SCRIPT = Path(__file__).with_name("load.lua")
WRK_TIMEOUT_S = 5
# Beyond the run's duration: wrk's start-up, its in-flight requests' timeout, and the done() line.
_GRACE_S = 30


@dataclass(frozen=True)
class Load:
    """One wrk run: where, which traffic, how long, closed or open loop."""

    url: str
    pattern: str  # uniform | hot | zipf | single | cycle
    duration_s: float
    connections: int
    threads: int = 2
    rate: float = 0.0  # offered requests/s in total; 0 = closed loop
    model: str = "sklearn-0"  # the single pattern's model
    models: int = 1000
    api: str = "djl"
    seed: int = 1
    start: int = 0  # the cycle pattern's first model
    body: str = "[[0.5]]"  # rows; the v2 API sends them as a V2 inference request
    raw_body: bool = False  # send ``body`` as it is, whatever the API (e.g. a V2 request)
    body_file: str = ""  # the body read from this file instead (djl API; any size)
    content_type: str = "application/json"  # of the djl API's body
    timeout_s: int = 0  # a request's timeout; 0 = WRK_TIMEOUT_S
    authorization: str = ""  # the Authorization header of every request (a tenant's token)


@dataclass
class WrkResult:
    """What one wrk run measured. Latencies in ms."""

    requests: int
    duration_s: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    errors: dict[str, int] = field(default_factory=dict)  # by HTTP status or socket error kind
    offered_rps: float = 0.0
    sent: int = 0
    late: int = 0
    max_lag_ms: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core, by process
    p99_bound_ms: float | None = None  # open loop; None when 1 % or more of the sends were late
    waited_s: float = 0.0  # waited for the machine to be quiet before the run

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["error_count"] = self.error_count
        return data


def parse(stdout: str, load: Load) -> WrkResult:
    """The result from wrk's output (the ``BENCH_JSON`` line of ``load.lua``'s ``done()``)."""
    for line in stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            raw = json.loads(line.removeprefix("BENCH_JSON "))
            break
    else:
        raise RuntimeError(f"wrk printed no result line:\n{stdout[-2000:]}")
    lat = raw["latency_us"]
    q = lat["quantiles"]
    errors = {status: int(n) for status, n in raw["statuses"].items() if n}
    for kind in ("connect", "read", "write", "timeout"):
        if raw["errors"][kind]:
            errors[kind] = int(raw["errors"][kind])
    duration_s = raw["duration_us"] / 1e6
    requests = int(raw["requests"])
    opened = raw["open"]
    late_share = opened["late"] / opened["sent"] if opened["sent"] else 0.0
    bound = lat["p99_bound"] / 1e3 + (1.0 if load.rate else 0.0)
    return WrkResult(
        requests=requests,
        duration_s=duration_s,
        rps=requests / duration_s if duration_s else 0.0,
        p50_ms=q["50"] / 1e3,
        p90_ms=q["90"] / 1e3,
        p99_ms=q["99"] / 1e3,
        p999_ms=q["99.9"] / 1e3,
        max_ms=lat["max"] / 1e3,
        mean_ms=lat["mean"] / 1e3,
        errors=errors,
        offered_rps=load.rate,
        sent=int(opened["sent"]),
        late=int(opened["late"]),
        max_lag_ms=opened["max_lag_us"] / 1e3,
        p99_bound_ms=bound if late_share < 0.01 else None,
    )


def command(load: Load) -> tuple[list[str], dict[str, str]]:
    """The wrk command line and environment of ``load``."""
    argv = [
        "wrk",
        f"-t{load.threads}",
        f"-c{load.connections}",
        f"-d{max(1, round(load.duration_s))}s",
        f"--timeout={load.timeout_s or WRK_TIMEOUT_S}s",
        "--latency",
        "-s",
        str(LUA_SCRIPT),
        load.url,
    ]
    env = dict(os.environ)
    env.update(
        BENCH_PATTERN=load.pattern,
        BENCH_MODELS=str(load.models),
        BENCH_MODEL=load.model,
        BENCH_API=load.api,
        BENCH_THREADS=str(load.threads),
        BENCH_THREAD_RATE=f"{load.rate / load.threads:.6f}" if load.rate else "0",
        BENCH_SEED=str(load.seed),
        BENCH_START=str(load.start),
        BENCH_BODY=load.body if load.raw_body else request_body(load.api, load.body),
        BENCH_BODY_FILE=load.body_file,
        BENCH_CONTENT_TYPE=load.content_type,
        BENCH_AUTHORIZATION=load.authorization,
    )
    return argv, env


def request_body(api: str, rows: str) -> str:
    """The body wrk sends for ``rows`` (a JSON list of rows): the rows themselves, or for the
    ``v2`` and ``mlserver`` APIs an Open Inference Protocol request holding them as one FP64
    tensor."""
    if api not in ("v2", "mlserver"):
        return rows
    values = json.loads(rows)
    tensor = {
        "name": "input-0",
        "shape": [len(values), len(values[0])],
        "datatype": "FP64",
        "data": values,
    }
    return json.dumps({"inputs": [tensor]})


def start(load: Load) -> subprocess.Popen[str]:
    """Start wrk on ``load``; :func:`finish` waits for it and parses its result."""
    argv, env = command(load)
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen[str], load: Load) -> WrkResult:
    try:
        stdout, _ = proc.communicate(timeout=load.duration_s + _GRACE_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"wrk did not finish within {load.duration_s + _GRACE_S:.0f} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited with {proc.returncode}:\n{stdout[-2000:]}")
    return parse(stdout, load)


def run(
    load: Load,
    server_pid: int | None = None,
    quiet_wait_s: float = 0.0,
    execute: Callable[[Load], WrkResult] | None = None,
) -> WrkResult:
    """Run wrk on ``load`` and return what it measured, with the CPU use of wrk and (given its
    pid) of the server's process tree meanwhile. First wait up to ``quiet_wait_s`` for the
    machine to be quiet (:func:`cpu.wait_quiet`). ``execute`` runs another load generator
    in wrk's place (its child processes' CPU is counted as wrk's)."""
    waited = cpu.wait_quiet(quiet_wait_s) if quiet_wait_s else 0.0
    wrk_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_before = cpu.tree_cpu(server_pid) if server_pid else {}
    busy_before = cpu.machine_busy()
    started = time.monotonic()
    result = execute(load) if execute is not None else finish(start(load), load)
    elapsed = time.monotonic() - started
    busy = cpu.machine_busy() - busy_before
    wrk_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if server_pid:
        after = cpu.tree_cpu(server_pid)
        share = cpu.cpu_percent(server_pid, server_before, after, elapsed)
        result.cpu["server"] = share["main"]
        result.cpu["server_children"] = share["children"]
    used = (wrk_after.ru_utime + wrk_after.ru_stime) - (wrk_before.ru_utime + wrk_before.ru_stime)
    result.cpu["wrk"] = 100 * used / elapsed
    # Whatever else kept the machine busy meanwhile (the benchmark itself, other programs).
    server_share = result.cpu.get("server", 0.0) + result.cpu.get("server_children", 0.0)
    ours = used + server_share * elapsed / 100
    result.cpu["other"] = max(0.0, 100 * (busy - ours) / elapsed)
    result.waited_s = waited
    return result


def installed() -> bool:
    """Whether wrk is on the PATH."""
    return shutil.which("wrk") is not None


def execute_python(load: Load) -> WrkResult:
    """Run ``load`` with :mod:`mmserver.commands.loadtest.pyload` (one Python process) instead of
    wrk:
    an ``execute`` for :func:`run` where wrk is not installed."""
    _, env = command(load)
    env["BENCH_THREADS"] = "1"
    env["BENCH_THREAD_RATE"] = f"{load.rate:.6f}" if load.rate else "0"
    argv = [
        sys.executable,
        "-m",
        "mmserver.commands.loadtest.pyload",
        load.url,
        str(load.duration_s),
        str(load.connections),
    ]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return finish(proc, load)
