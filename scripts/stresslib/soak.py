"""A long mixed load on the 1,000-model reference store with fewer models allowed in memory than
the load touches, so models are loaded and unloaded all the time:
``scripts/soak [--duration SECONDS] ...`` (``--help`` lists the options).

Each request picks its model from one of three patterns, in turn: uniform over the store, hot
(90 % ``sklearn-0``, the rest uniform), and Zipf (s = 1.1, over an order reshuffled every period,
so the hot set moves). A bounded asyncio client keeps ``--concurrency`` requests in flight; every
answer is checked against the model's right answer.

Every period (a minute by default) it prints: requests, errors by status, p99 latency, resident
memory of the server's process tree (RSS summed, and PSS; and the RSS of the frontend and of the
backend processes), loaded models, loads and unloads, backend restarts. At
the end, the verdict: no errors, and memory flat after warm-up (RSS of the last period within
``--rss-margin`` of the second period's). Exit code 0 when both hold and the server then stops
cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from stresslib import load, proc

MAX_DURATION = 4 * 3600


@dataclass
class Period:
    index: int
    seconds: float
    requests: int
    errors: dict[str, int]
    p99_ms: float
    rss_mb: float
    pss_mb: float
    frontend_mb: float
    backends_mb: float
    processes: int
    loaded: int
    loads: int
    unloads: int
    restarts: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/soak", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=600.0,
        help=f"seconds of load (default 600, at most {MAX_DURATION})",
    )
    parser.add_argument("--period", type=float, default=60.0, help="seconds per report line")
    parser.add_argument("--count", type=int, default=1000, help="sklearn-N archives in the store")
    parser.add_argument(
        "--store",
        type=Path,
        default=proc.REPO / ".cache" / "soak-store",
        help="where the store is generated (kept between runs)",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=300,
        help="loaded-model budget of the server (below the working set)",
    )
    parser.add_argument(
        "--backend-processes",
        type=int,
        default=None,
        help="backend processes (default: the server's, one per core)",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--rss-margin",
        type=float,
        default=0.10,
        help="allowed RSS change from the second period to the last",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the server log and report.json (default: a temp one)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.duration <= MAX_DURATION or not 1 <= args.period <= args.duration:
        parser.error(f"need 1 <= --period <= --duration <= {MAX_DURATION}")
    if not 2 <= args.count <= 100_000 or not 1 <= args.concurrency <= 256:
        parser.error("--count must be 2-100000 and --concurrency 1-256")
    if args.max_loaded_models and args.max_loaded_models <= args.concurrency:
        parser.error("--max-loaded-models must exceed --concurrency (or be 0: no limit)")
    return args


class Mix:
    """Picks a model: uniform, hot and Zipf in turn (each a third of the requests)."""

    def __init__(self, names: list[str], rng: random.Random, s: float = 1.1) -> None:
        self.names = names
        self.rng = rng
        self.order = list(names)
        weights = [1.0 / (rank**s) for rank in range(1, len(names) + 1)]
        self.cumulative = list(itertools.accumulate(weights))
        self.turn = itertools.cycle(("uniform", "hot", "zipf"))
        self.reshuffle()

    def reshuffle(self) -> None:
        """A new Zipf order: the hot set moves."""
        self.rng.shuffle(self.order)

    def __call__(self) -> str:
        pattern = next(self.turn)
        if pattern == "hot" and self.rng.random() < 0.9:
            return self.names[0]
        if pattern == "zipf":
            x = self.rng.random() * self.cumulative[-1]
            return self.order[min(bisect.bisect_left(self.cumulative, x), len(self.order) - 1)]
        return self.rng.choice(self.names)


def row(p: Period) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(p.errors.items())) or "none"
    return (
        f"{p.index:>4} {p.requests:>9} {p.requests / p.seconds:>7.0f} {p.p99_ms:>8.1f} "
        f"{p.rss_mb:>8.0f} {p.pss_mb:>8.0f} {p.frontend_mb:>6.0f} {p.backends_mb:>6.0f} "
        f"{p.processes:>5} {p.loaded:>6} {p.loads:>7} "
        f"{p.unloads:>7} {p.restarts:>4}  {errors}"
    )


HEADER = (
    "   #  requests   req/s  p99 ms   RSS MiB  PSS MiB  front backnd procs loaded   loads "
    "unloads rest  errors"
)


async def soak(
    args: argparse.Namespace, out: Path, started: list[proc.Server]
) -> tuple[list[Period], list[str]]:
    rng = random.Random(args.seed)
    print(f"store: {args.store} ({args.count} archives)", flush=True)
    proc.generate_store(args.store, args.count)
    extra = ["--max-loaded-models", str(args.max_loaded_models)]
    if args.backend_processes is not None:
        extra += ["--backend-processes", str(args.backend_processes)]
    server = proc.Server(args.store, out / "server.log", *extra)
    started.append(server)
    server.start()
    print(f"server pid {server.pid} on {server.url} ({' '.join(extra)})", flush=True)
    problems: list[str] = []
    periods: list[Period] = []
    try:
        await _run(args, server, rng, periods, problems)
    finally:
        code, left = server.stop()
        if code != 0:
            problems.append(f"the server stopped with exit code {code}")
        if left:
            problems.append(f"processes left after the stop: {left}")
        print(f"server log: {server.log_path}")
    return periods, problems


async def _run(
    args: argparse.Namespace,
    server: proc.Server,
    rng: random.Random,
    periods: list[Period],
    problems: list[str],
) -> None:
    names = [f"sklearn-{i}" for i in range(args.count)]
    probes = load.Probes()
    async with aiohttp.ClientSession() as session:
        await probes.learn(session, server.url, names[0])
    # The store's archives are copies of one model: every one must give sklearn-0's answer.
    for name in names:
        probes.bodies[name] = probes.bodies[names[0]]
        probes.answers[name] = probes.answers[names[0]]
    mix = Mix(names, rng)
    record = load.Record()
    start = time.monotonic()
    end = start + args.duration
    load_task = asyncio.ensure_future(
        load.run_load(
            server.url,
            mix,
            probes,
            record,
            concurrency=args.concurrency,
            until=end,
            max_requests=1_000_000_000,
        )
    )
    print(HEADER, flush=True)
    previous: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        previous = await load.metrics(session, server.url)
        for index in range(1, int(args.duration // args.period) + 2):
            period_end = min(end, start + index * args.period)
            if period_end <= start + (index - 1) * args.period:
                break
            await asyncio.sleep(max(0.0, period_end - time.monotonic()))
            if load_task.done():
                break
            since = start + (index - 1) * args.period
            window = [o for o in record.outcomes if since <= o.at < period_end]
            counts = record.by_status(since, period_end)
            current = await load.metrics(session, server.url)
            memory = proc.memory(server.pid)

            period = Period(
                index=index,
                seconds=period_end - since,
                requests=len(window),
                errors={k: v for k, v in counts.items() if k != "200"},
                p99_ms=1000 * load.p99([o.seconds for o in window]),
                rss_mb=memory.rss_mb,
                pss_mb=memory.pss_mb,
                frontend_mb=memory.frontend_rss_mb,
                backends_mb=memory.backends_rss_mb,
                processes=memory.processes,
                loaded=round(current.get("mmserver_models_loaded", 0.0)),
                loads=_delta(current, previous, "mmserver_model_loads_total"),
                unloads=_delta(current, previous, "mmserver_model_evictions_total"),
                restarts=_delta(current, previous, "mmserver_backend_restarts_total"),
            )
            previous = current
            periods.append(period)
            print(row(period), flush=True)
            mix.reshuffle()
    await load_task
    errors = record.by_status()
    errors.pop("200", None)
    if errors:
        problems.append(f"errors: {dict(errors)}")
    if not record.outcomes:
        problems.append("no request was answered")


def _delta(current: dict[str, float], previous: dict[str, float], name: str) -> int:
    return round(current.get(name, 0.0) - previous.get(name, 0.0))


def verdict(periods: list[Period], margin: float) -> list[str]:
    problems: list[str] = []
    if not periods:
        return ["no period completed"]
    base = periods[1] if len(periods) > 1 else periods[0]
    last = periods[-1]
    change = last.rss_mb / base.rss_mb - 1 if base.rss_mb else float("inf")
    print(
        f"memory: RSS {base.rss_mb:.0f} MiB in period {base.index}, {last.rss_mb:.0f} MiB in "
        f"period {last.index} ({100 * change:+.1f} %); PSS {base.pss_mb:.0f} -> "
        f"{last.pss_mb:.0f} MiB"
    )
    if abs(change) > margin:
        problems.append(
            f"memory not flat: RSS changed {100 * change:+.1f} % from period {base.index} to "
            f"{last.index} (allowed {100 * margin:.0f} %)"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("command: scripts/soak " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    proc.interrupt_on_sigterm()
    started: list[proc.Server] = []
    try:
        with tempfile.TemporaryDirectory(prefix="mmserver-soak-") as tmp:
            out = args.out or Path(tmp)
            out.mkdir(parents=True, exist_ok=True)
            periods, problems = asyncio.run(soak(args, out, started))
            problems += verdict(periods, args.rss_margin)
            if args.out is not None:
                report = {"periods": [asdict(p) for p in periods], "problems": problems}
                (out / "report.json").write_text(json.dumps(report, indent=2))
    except KeyboardInterrupt:
        print("interrupted: stopping the server", file=sys.stderr)
        return 130
    finally:
        for server in started:
            server.stop()  # does nothing when already stopped
    print("\n" + HEADER)
    for period in periods:
        print(row(period))
    total = sum(p.requests for p in periods)
    print(f"\n{total} requests in {len(periods)} period(s)")
    for problem in problems:
        print(f"  FAIL: {problem}")
    print(f"verdict: {'PASS' if not problems else 'FAIL'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
