"""Per setting, the highest throughput whose p99 stays under the target: a short search.

First one closed-loop run (:func:`closed_connections` connections, each sending its next request
as soon as its answer arrives) says roughly what the setting can serve at all. Then open-loop runs
at fixed offered rates, starting at :data:`START_SHARE` of that, bisect between the highest rate
that passed and the lowest that failed (:func:`next_rate`), ``steps`` runs at most. A run passes
when every request was answered 2xx, the p99 as seen from the send schedule
(:attr:`~mmserver.commands.loadtest.wrk.WrkResult.p99_bound_ms`, or a looser bound when over 1 % of
the sends were late: :func:`_schedule_p99`) is at most the target, and the server
kept up with the offered rate (:data:`KEPT_UP`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmserver.commands.loadtest import cpu, wrk
from mmserver.commands.recommend.settings import Setting
from mmserver.commands.recommend.target import Target

START_SHARE = 0.8
#: A run whose answered rate is under this share of the offered rate fell behind.
KEPT_UP = 0.9
#: Bisection stops once the highest pass and the lowest failure are this close (relative).
CLOSE_ENOUGH = 0.05
OPEN_CONNECTIONS = 64
#: Seconds a run costs beyond its duration (wrk's start, the CPU readings), for the budget.
RUN_OVERHEAD_S = 1.0


@dataclass(frozen=True)
class Plan:
    """How the search runs: the target, the load, the clock."""

    model: str
    body: str
    p99_ms: float
    run_s: int
    steps: int
    deadline: float  # time.monotonic() by which every run must be done
    use_wrk: bool = True


@dataclass(frozen=True)
class Run:
    """One load run of a setting. ``offered_rps`` 0 is the closed-loop run."""

    offered_rps: float
    rps: float
    p50_ms: float
    p99_ms: float | None  # in the open loop, a bound of the p99 seen from the send schedule
    errors: int
    cpu_ms_per_request: float | None
    passed: bool
    #: The errors by HTTP status or socket error kind (``"503"``, ``"timeout"``...).
    error_kinds: dict[str, int] = field(default_factory=dict)
    #: What other programs kept busy meanwhile, in % of one core (neither the server nor the
    #: load generator: :func:`mmserver.commands.loadtest.wrk.run`'s ``other``).
    other_cpu_percent: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SettingResult:
    setting: Setting
    runs: list[Run] = field(default_factory=list)
    memory_bytes: int | None = None
    lane: str | None = None
    note: str = ""

    @property
    def best(self) -> Run | None:
        """The passing open-loop run of the highest rate."""
        passed = [r for r in self.runs if r.passed and r.offered_rps]
        return max(passed, key=lambda r: r.rps, default=None)

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            **self.setting.to_json(),
            "rps_at_target": best.rps if best else None,
            "p99_ms": best.p99_ms if best else None,
            "cpu_ms_per_request": best.cpu_ms_per_request if best else None,
            "memory_bytes": self.memory_bytes,
            "ran_in_lane": self.lane,
            "note": self.note,
            "runs": [r.to_json() for r in self.runs],
        }


def next_rate(capacity: float, passed: float, failed: float | None) -> float:
    """The next offered rate, from the closed loop's ``capacity``, the highest rate that passed
    (0: none yet) and the lowest that failed (None: none yet)."""
    if failed is None:
        return capacity * START_SHARE if not passed else passed * 1.25
    if not passed:
        return failed / 2
    return (passed + failed) / 2


def done(passed: float, failed: float | None) -> bool:
    return bool(passed and failed and (failed - passed) / failed < CLOSE_ENOUGH)


def closed_connections(setting: Setting) -> int:
    """Connections of the closed-loop run: enough to fill two rounds of full batches on every
    worker (8 to :data:`OPEN_CONNECTIONS`)."""
    return min(OPEN_CONNECTIONS, max(8, 2 * setting.max_workers * setting.batch_size))


def runs_per_setting(steps: int) -> int:
    return 1 + steps


def search(
    target: Target,
    setting: Setting,
    plan: Plan,
    progress: Callable[[str], None],
) -> SettingResult:
    """Apply ``setting`` and search its highest passing rate; ``progress`` is called after each
    run. Stops early (saying so in the result's ``note``) when the deadline comes."""
    result = SettingResult(setting)
    target.apply(plan.model, setting)
    connections = closed_connections(setting)
    if not _time_left(plan):
        result.note = "not measured: the time budget ran out"
        return result
    closed = _run(target, plan, 0.0, connections)
    result.runs.append(closed)
    progress(f"{setting.label}: closed loop {closed.rps:,.0f} req/s")
    facts = target.describe(plan.model)
    result.memory_bytes, result.lane = facts.memory_bytes, facts.lane
    capacity, passed, failed = closed.rps, 0.0, None
    for _ in range(plan.steps):
        if done(passed, failed) or capacity <= 0:
            break
        if not _time_left(plan):
            result.note = "search cut short: the time budget ran out"
            break
        rate = max(1.0, next_rate(capacity, passed, failed))
        run = _run(target, plan, rate, OPEN_CONNECTIONS)
        result.runs.append(run)
        if run.passed:
            passed = rate
        else:
            failed = rate
        progress(f"{setting.label}: {rate:,.0f} req/s offered, {verdict(run, plan.p99_ms)}")
    return result


def verdict(run: Run, p99_ms: float) -> str:
    """What an open-loop run showed, for the progress: its p99, and why it failed."""
    p99 = "no p99" if run.p99_ms is None else f"p99 {run.p99_ms:.1f} ms"
    if run.passed:
        return f"{p99}: ok"
    if run.errors:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(run.error_kinds.items()))
        return f"{p99}, errors ({kinds or run.errors}): failed"
    if run.p99_ms is None or run.p99_ms > p99_ms:
        return f"{p99}: over the target"
    return f"{p99}, answered {run.rps:,.0f} req/s: fell behind"


def _time_left(plan: Plan) -> bool:
    return time.monotonic() + plan.run_s + RUN_OVERHEAD_S <= plan.deadline


def _run(target: Target, plan: Plan, rate: float, connections: int) -> Run:
    load = wrk.Load(
        url=target.url,
        pattern="single",
        duration_s=plan.run_s,
        connections=connections,
        threads=2,
        rate=rate,
        model=plan.model,
        models=1,
        body=plan.body,
    )
    before = _server_cpu(target)
    result = wrk.run(
        load,
        server_pid=target.pid,
        execute=None if plan.use_wrk else wrk.execute_python,
    )
    used = _server_cpu(target) - before
    p99 = result.p99_ms if not rate else _schedule_p99(result)
    passed = bool(
        rate
        and result.error_count == 0
        and p99 is not None
        and p99 <= plan.p99_ms
        and result.rps >= KEPT_UP * rate
    )
    return Run(
        offered_rps=rate,
        rps=result.rps,
        p50_ms=result.p50_ms,
        p99_ms=p99,
        errors=result.error_count,
        cpu_ms_per_request=1e3 * used / result.requests if result.requests else None,
        passed=passed,
        error_kinds=dict(result.errors),
        other_cpu_percent=result.cpu.get("other", 0.0),
    )


def _schedule_p99(result: wrk.WrkResult) -> float:
    """A bound of the open loop's p99 as seen from the send schedule: wrk's bound while under
    1 % of the sends went out late; else no request waited longer than the latest send's lag
    plus the slowest answer. (A loaded machine delays wrk's own threads: the looser bound still
    lets a run that answered everything fast pass.)"""
    if result.p99_bound_ms is not None:
        return result.p99_bound_ms
    return result.max_lag_ms + result.max_ms


def _server_cpu(target: Target) -> float:
    """CPU seconds of the server so far: its process tree when it is our child, else what its
    ``GET /metrics`` says of its processes."""
    if target.pid is not None:
        return sum(cpu.tree_cpu(target.pid).values())
    return target.cpu_seconds()
