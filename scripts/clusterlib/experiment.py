"""``scripts/cluster experiment``: LEAST_OUTSTANDING_REQUESTS against RANDOM, and
MODEL_AFFINITY against RANDOM, through HAProxy on this machine's loopback.

Routing (the published comparison's shape): instances and closed-loop users grow together,
``--users-per-instance`` (4) each, and every request goes to one model whose prediction time is
lognormal (median ``--median-ms`` 20, p99 ``--p99-ms`` 300), as a generative model's varies.
Each instance runs ``--instance-concurrency`` (1) predictions at a time: one backend process per
unit, two workers per process so the next request is already waiting when a prediction ends,
and the process runs them in order. That is what makes the comparison mean something: a real
instance (a GPU, a core) runs a fixed number of predictions at once and queues the rest, while
sleeps alone would run side by side without bound and no instance would ever be busy. The
instances start once per size; the strategies then alternate on them (a fresh HAProxy per run),
so the machine's other load falls on both alike. Figures are medians over ``--runs``.

Affinity: ``--affinity-instances`` (4) fresh instances per run over the 1,000-model reference
store, each run with an empty archive cache, and the same list of ``--affinity-requests``
(6,000) requests for both strategies: half to one hot model, the rest to a model drawn
uniformly from the 1,000 (about 3 requests each). The run ends when the list is done (or after
4 x ``--duration`` s). After it: resident memory of each instance (its server and backend
processes), the models each holds and their memory as the server counts it, the loads all
together, and how many instances served the hot model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvloop
from proctools import HOST, free_port

from clusterlib.load import LoadResult, closed_loop, closed_loop_list
from clusterlib.models import MODEL_NAME, write_variable_latency_dir
from clusterlib.queueing import simulate
from mmserver.commands.cluster.balancer import Balancer, BalancerSpec, Strategy
from mmserver.commands.cluster.instances import Instance, InstanceSpec, stop_instances
from mmserver.commands.launch import http_get
from mmserver.commands.procs import tree_memory

ROUTING = (Strategy.RANDOM, Strategy.LEAST_OUTSTANDING_REQUESTS)
AFFINITY = (Strategy.RANDOM, Strategy.MODEL_AFFINITY)
SHORT = {
    Strategy.RANDOM: "RANDOM",
    Strategy.LEAST_OUTSTANDING_REQUESTS: "LOR",
    Strategy.MODEL_AFFINITY: "AFFINITY",
}
HOT_MODEL = "sklearn-0"
GENERATOR = Path(__file__).resolve().parent.parent / "generate_store.py"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "experiment",
        help="the routing experiment (a table, and a plot with matplotlib)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--instances", default="1,2,4,8", help="instance counts, comma-separated (1,2,4,8)"
    )
    parser.add_argument("--users-per-instance", type=int, default=4, help="(4)")
    parser.add_argument("--duration", type=float, default=20.0, help="measured s per run (20)")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured s per run (3)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; medians (3)")
    parser.add_argument("--median-ms", type=float, default=20.0, help="prediction time (20)")
    parser.add_argument("--p99-ms", type=float, default=300.0, help="prediction time (300)")
    parser.add_argument(
        "--instance-concurrency",
        type=int,
        default=1,
        help="predictions one instance runs at once (1)",
    )
    parser.add_argument(
        "--affinity-instances",
        type=int,
        default=4,
        help="instances of the MODEL_AFFINITY runs; 0 skips them (4)",
    )
    parser.add_argument(
        "--affinity-requests", type=int, default=6000, help="requests of each affinity run (6000)"
    )
    parser.add_argument(
        "--hot-share",
        type=float,
        default=0.5,
        help="share of the affinity runs' requests to the hot model (0.5)",
    )
    parser.add_argument("--hash-balance-factor", type=int, default=150, help="(150)")
    parser.add_argument(
        "--store",
        type=Path,
        default=Path("model_store"),
        help="the 1,000-model reference store, written when missing (model_store)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("cluster-results"),
        help="table.txt, results.json and routing.png (cluster-results/)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: 5 s runs, 1 run, 1,2,4 instances, 2 for affinity",
    )


@dataclass
class Run:
    """One measured run."""

    section: str
    strategy: str
    instances: int
    users: int
    run: int
    p50_ms: float
    p99_ms: float
    throughput_per_instance: float
    measured: int
    errors: dict[str, int]
    by_instance: dict[str, int]
    rss_mb: list[float] = field(default_factory=list)
    pss_mb: list[float] = field(default_factory=list)
    models_loaded: list[int] = field(default_factory=list)
    model_mb: list[float] = field(default_factory=list)
    model_loads: int = 0
    hot_model_instances: int = 0
    latencies_ms: list[float] = field(default_factory=list, repr=False)  # not in results.json


def _run(section: str, strategy: Strategy, n: int, users: int, run: int, result: LoadResult) -> Run:
    return Run(
        section=section,
        strategy=strategy.value,
        instances=n,
        users=users,
        run=run,
        p50_ms=result.percentile_ms(50),
        p99_ms=result.percentile_ms(99),
        throughput_per_instance=result.throughput / n,
        measured=len(result.latencies),
        errors=dict(result.errors),
        by_instance=dict(result.by_instance),
        latencies_ms=[x * 1000 for x in result.latencies],
    )


@contextmanager
def running_instances(n: int, spec: InstanceSpec, logs: Path) -> Iterator[list[Instance]]:
    """``n`` instances, ready; stopped (drained, then killed by pid) on the way out."""
    instances = [
        Instance(f"i{k}", free_port(), spec, logs / f"instance-{n}-{k}.log") for k in range(n)
    ]
    try:
        for instance in instances:
            instance.start()
        for instance in instances:
            instance.wait_ready()
        yield instances
    finally:
        stop_instances(instances, timeout=20.0)


@contextmanager
def running_balancer(
    strategy: Strategy, instances: list[Instance], work: Path, factor: int
) -> Iterator[Balancer]:
    spec = BalancerSpec(
        strategy=strategy,
        port=free_port(),
        stats_port=free_port(),
        servers=tuple((i.name, HOST, i.port) for i in instances),
        hash_balance_factor=factor,
    )
    balancer = Balancer(spec, work / f"haproxy-{strategy.value}.cfg", work / "haproxy.log")
    try:
        balancer.start()
        yield balancer
    finally:
        balancer.stop()


def _latency_request(rng: random.Random) -> tuple[str, float]:
    # The quantile of the prediction time, drawn here (see clusterlib.models).
    return MODEL_NAME, rng.random()


def _load(url: str, users: int, args: argparse.Namespace, seed: int) -> LoadResult:
    return uvloop.run(
        closed_loop(
            url,
            users,
            args.duration,
            args.warmup,
            _latency_request,
            expect=lambda x: 2 * x,
            seed=seed,
        )
    )


def routing(args: argparse.Namespace, counts: list[int], work: Path) -> list[Run]:
    store = work / "latency-store"
    c = args.instance_concurrency
    write_variable_latency_dir(store / MODEL_NAME, args.median_ms, args.p99_ms, workers=2 * c)
    spec = InstanceSpec(model_store=store, backend_processes=c, cache_dir=work / "cache")
    runs: list[Run] = []
    for n in counts:
        users = n * args.users_per_instance
        with running_instances(n, spec, work) as instances:
            for instance in instances:  # load the model everywhere before measuring
                _predict(instance.port, MODEL_NAME)
            for run in range(args.runs):
                order = ROUTING if (run + counts.index(n)) % 2 == 0 else ROUTING[::-1]
                for strategy in order:
                    with running_balancer(
                        strategy, instances, work, args.hash_balance_factor
                    ) as balancer:
                        result = _load(balancer.url, users, args, seed=run + 1)
                    runs.append(_run("routing", strategy, n, users, run, result))
                    _progress(runs[-1])
    return runs


def affinity(args: argparse.Namespace, work: Path) -> list[Run]:
    n = args.affinity_instances
    users = n * args.users_per_instance
    store = args.store.resolve()
    subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(store), "--count", "1000"], check=True
    )
    names = [f"sklearn-{i}" for i in range(1000)]
    runs: list[Run] = []
    for run in range(args.runs):
        rng = random.Random(run + 1)
        requests = [
            HOT_MODEL if rng.random() < args.hot_share else rng.choice(names)
            for _ in range(args.affinity_requests)
        ]
        for strategy in AFFINITY if run % 2 == 0 else AFFINITY[::-1]:
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
            spec = InstanceSpec(model_store=store, backend_processes=1, cache_dir=cache)
            with running_instances(n, spec, work) as instances:
                with running_balancer(
                    strategy, instances, work, args.hash_balance_factor
                ) as balancer:
                    # The reference store's line, y = 2x + 1: 2.0 at x = 0.5.
                    result = uvloop.run(
                        closed_loop_list(
                            balancer.url,
                            users,
                            requests,
                            time_limit=4 * args.duration,
                            x=0.5,
                            expected=2.0,
                        )
                    )
                each = _run("affinity", strategy, n, users, run, result)
                for instance in instances:
                    assert instance.ident is not None
                    memory = tree_memory(instance.ident.pid)
                    each.rss_mb.append(memory.rss_kb / 1024)
                    each.pss_mb.append(memory.pss_kb / 1024)
                    metrics = _metrics(instance.port)
                    each.models_loaded.append(int(_metric_sum(metrics, "mmserver_models_loaded")))
                    each.model_mb.append(
                        _metric_sum(metrics, "mmserver_model_memory_bytes") / 2**20
                    )
                    each.model_loads += int(_metric_sum(metrics, "mmserver_model_loads_total"))
                each.hot_model_instances = result.instances_serving(HOT_MODEL)
            runs.append(each)
            _progress(each)
    return runs


def _predict(port: int, model: str) -> None:
    import http.client

    conn = http.client.HTTPConnection(HOST, port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/predictions/{model}",
            body=b"[[0.5]]",
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"{model} on port {port}: {response.status} {body[:200]!r}")
    finally:
        conn.close()


def _metrics(port: int) -> str:
    status, body = http_get(port, "/metrics", timeout=30)
    return body.decode() if status == 200 else ""


def _metric_sum(text: str, name: str) -> float:
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _progress(run: Run) -> None:
    errors = sum(run.errors.values())
    print(
        f"  {run.section} {run.instances} instance(s) {run.strategy:<26} run {run.run + 1}: "
        f"p50 {run.p50_ms:6.1f} ms  p99 {run.p99_ms:7.1f} ms  "
        f"{run.throughput_per_instance:6.1f} req/s/instance  errors {errors}",
        flush=True,
    )


# -- report ---------------------------------------------------------------------------------


def _median(runs: list[Run], key: Callable[[Run], float]) -> float:
    values = [key(r) for r in runs if not math.isnan(key(r))]
    return statistics.median(values) if values else float("nan")


def _pick(runs: list[Run], section: str, strategy: Strategy, n: int) -> list[Run]:
    return [
        r
        for r in runs
        if r.section == section and r.strategy == strategy.value and r.instances == n
    ]


def _pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.0f} %" if old else "-"


def _pooled(runs: list[Run], q: float) -> float:
    """The ``q`` percentile of every run's latencies together: with a heavy tail, one run's
    p99 rests on a few requests, so the runs' p99s scatter more than their pool's."""
    values = [x for r in runs for x in r.latencies_ms]
    return float(np.percentile(values, q)) if values else float("nan")


def table(args: argparse.Namespace, runs: list[Run], counts: list[int]) -> str:
    lines = [
        f"Routing: {args.users_per_instance} closed-loop users per instance, one model with a "
        f"lognormal prediction time (median {args.median_ms:g} ms, p99 {args.p99_ms:g} ms), "
        f"{args.instance_concurrency} prediction(s) at a time per instance; {args.runs} run(s) "
        f"of {args.duration:g} s per strategy and size: p50/p99 over all their requests, "
        'throughput the median run. "model": what queueing theory expects (simulated; '
        "clusterlib/queueing.py).",
        "",
        f"{'':<12}{'---------- RANDOM ----------':>30}{'------------ LOR -----------':>30}"
        f"{'--- LOR vs RANDOM ---':>24}",
        f"{'inst/users':<12}{'p50':>9}{'p99':>9}{'req/s/inst':>12}{'p50':>9}{'p99':>9}"
        f"{'req/s/inst':>12}{'p99':>8}{'req/s':>8}{'model p99':>11}{'model req/s':>12}",
    ]
    for n in counts:
        rand = _pick(runs, "routing", Strategy.RANDOM, n)
        lor = _pick(runs, "routing", Strategy.LEAST_OUTSTANDING_REQUESTS, n)
        if not rand or not lor:
            continue
        r = [
            _pooled(rand, 50),
            _pooled(rand, 99),
            _median(rand, lambda x: x.throughput_per_instance),
        ]
        lo = [_pooled(lor, 50), _pooled(lor, 99), _median(lor, lambda x: x.throughput_per_instance)]
        users = n * args.users_per_instance
        model_r = simulate(
            n, users, False, args.median_ms, args.p99_ms, concurrency=args.instance_concurrency
        )
        model_l = simulate(
            n, users, True, args.median_ms, args.p99_ms, concurrency=args.instance_concurrency
        )
        lines.append(
            f"{f'{n}/{users}':<12}{r[0]:>7.0f}ms{r[1]:>7.0f}ms{r[2]:>12.1f}"
            f"{lo[0]:>7.0f}ms{lo[1]:>7.0f}ms{lo[2]:>12.1f}{_pct(lo[1], r[1]):>8}"
            f"{_pct(lo[2], r[2]):>8}{_pct(model_l.p99_ms, model_r.p99_ms):>11}"
            f"{_pct(model_l.throughput_per_instance, model_r.throughput_per_instance):>12}"
        )
    errors = sum(sum(r.errors.values()) for r in runs)
    lines += ["", f"Failed requests in all runs: {errors}."]
    aff = [r for r in runs if r.section == "affinity"]
    if aff:
        n = aff[0].instances
        lines += [
            "",
            f"Affinity: {n} instances, {n * args.users_per_instance} users, 1,000-model store, "
            f"{args.affinity_requests} requests, {args.hot_share:.0%} of them to {HOT_MODEL}, "
            f"the rest uniform; every run starts cold; medians of {args.runs} run(s).",
            "",
            f"{'strategy':<16}{'p50':>7}{'p99':>9}{'req/s/inst':>11}{'RSS MiB/inst':>13}"
            f"{'PSS MiB/inst':>13}{'models/inst':>12}{'model MiB':>10}{'loads':>7}"
            f"{'hot on':>7}",
        ]
        for strategy in AFFINITY:
            these = _pick(runs, "affinity", strategy, n)
            if not these:
                continue
            lines.append(
                f"{strategy.value:<16}{_median(these, lambda x: x.p50_ms):>5.0f}ms"
                f"{_median(these, lambda x: x.p99_ms):>7.0f}ms"
                f"{_median(these, lambda x: x.throughput_per_instance):>11.1f}"
                f"{_median(these, lambda x: statistics.mean(x.rss_mb)):>13.0f}"
                f"{_median(these, lambda x: statistics.mean(x.pss_mb)):>13.0f}"
                f"{_median(these, lambda x: statistics.mean(x.models_loaded)):>12.0f}"
                f"{_median(these, lambda x: statistics.mean(x.model_mb)):>10.1f}"
                f"{_median(these, lambda x: x.model_loads):>7.0f}"
                f"{_median(these, lambda x: x.hot_model_instances):>7.0f}"
            )
        lines.append(
            "(Per instance: RSS counts pages shared between its processes in each, "
            'PSS splits them; "model MiB": the loaded models\' memory as the server '
            'counts it. "loads": model loads in all instances; "hot on": '
            "instances that served the hot model.)"
        )
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, runs: list[Run], counts: list[int], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for strategy, color in zip(ROUTING, ("tab:red", "tab:blue"), strict=True):
        picked = [(n, _pick(runs, "routing", strategy, n)) for n in counts]
        picked = [(n, r) for n, r in picked if r]
        xs = [n for n, _ in picked]
        name = SHORT[strategy]
        expected = [
            simulate(
                n,
                n * args.users_per_instance,
                strategy is not Strategy.RANDOM,
                args.median_ms,
                args.p99_ms,
                concurrency=args.instance_concurrency,
            )
            for n in xs
        ]
        lat.plot(xs, [_pooled(r, 99) for _, r in picked], "o-", color=color, label=f"{name} p99")
        lat.plot(xs, [_pooled(r, 50) for _, r in picked], "o--", color=color, label=f"{name} p50")
        lat.plot(
            xs,
            [e.p99_ms for e in expected],
            ":",
            color=color,
            alpha=0.6,
            label=f"{name} p99, model",
        )
        thr.plot(
            xs,
            [_median(r, lambda x: x.throughput_per_instance) for _, r in picked],
            "o-",
            color=color,
            label=name,
        )
        thr.plot(
            xs,
            [e.throughput_per_instance for e in expected],
            ":",
            color=color,
            alpha=0.6,
            label=f"{name}, model",
        )
    for axis, label in ((lat, "latency (ms)"), (thr, "throughput per instance (req/s)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [f"{n}/{n * args.users_per_instance}" for n in counts])
        axis.set_xlabel("instances / concurrent users")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    lat.set_ylim(bottom=0)
    thr.set_ylim(bottom=0)
    fig.suptitle("HAProxy routing in front of mmserver: LEAST_OUTSTANDING_REQUESTS vs RANDOM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.warmup, args.runs = 5.0, 1.0, 1
        if args.instances == "1,2,4,8":
            args.instances = "1,2,4"
        args.affinity_instances = min(args.affinity_instances, 2)
    counts = [int(n) for n in args.instances.split(",") if n.strip()]
    if not counts or min(counts) < 1 or args.runs < 1 or args.duration <= 0:
        raise SystemExit("scripts/cluster experiment: bad --instances, --runs or --duration")

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mmserver-cluster-") as tmp:
        work = Path(tmp)
        runs = routing(args, counts, work)
        if args.affinity_instances > 0:
            runs += affinity(args, work)
    text = table(args, runs, counts)
    command = "scripts/cluster experiment " + " ".join(sys.argv[2:])
    text += f"\nCommand: {command.strip()} ({time.monotonic() - started:.0f} s)\n"
    (args.out / "table.txt").write_text(text)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "runs": [{k: v for k, v in asdict(r).items() if k != "latencies_ms"} for r in runs],
            },
            indent=1,
        )
    )
    print("\n" + text)
    if plot(args, runs, counts, args.out / "routing.png"):
        print(f"plot: {args.out / 'routing.png'}")
    else:
        print("(matplotlib is not installed: no plot)")
    return 0
