"""``scripts/bench``: benchmark mmserver on the 1,000-model reference store.

One invocation starts mmserver (a fresh archive cache, so every model starts cold) and the HTTP
floor on free loopback ports and measures, in this order: cold start, memory with every model
loaded, closed loop and open loop in three traffic patterns (against both servers, alternated),
scaling of the hot model, batching. It prints a table and writes ``table.txt``,
``results.json`` and ``bench.png`` to ``--out``.

wrk, the server and its backend processes share this machine's cores: nothing is pinned, so the
figures include the load generator's CPU use, for mmserver and the floor alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (
    asyncbench,
    envsbench,
    explainbench,
    grpcload,
    loads,
    neighbour,
    onnxbench,
    peers,
    probes,
    report,
    rollout,
    scale,
    servers,
    store,
    tabular,
    tenantsbench,
    tracingbench,
    transformbench,
    trees,
)
from mmserver.commands.loadtest import cpu, wrk

SECTIONS = (
    "cold",
    "memory",
    "closed",
    "open",
    "scaling",
    "batching",
    "neighbour",
    "trees",
    "onnx",
    "explain",
    "tabular",
    "grpc",
    "scale",
    "async",
    "transform",
    "rollout",
    "tenants",
    "tracing",
    "envs",
)
#: Sections a run without --only leaves out: they run servers or clients of their own, or
#: need packages of their own (onnx: skl2onnx and onnxruntime).
OPT_IN = (
    "grpc",
    "scale",
    "async",
    "transform",
    "rollout",
    "onnx",
    "explain",
    "tenants",
    "tracing",
    "envs",
)
PATTERNS = report.PATTERNS
#: The sections with servers of their own and nothing of their own to be told: how each runs,
#: and its lines of the table.
OWN_SERVERS = {
    "rollout": (rollout.run, rollout.summary_lines),
    "tenants": (tenantsbench.run, tenantsbench.summary_lines),
    "tracing": (tracingbench.run, tracingbench.summary_lines),
    "envs": (envsbench.run, envsbench.summary_lines),
}
BATCH_MODELS = {"batch 1": "bench-forest-b1", "batch 32": "bench-forest-b32"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description=(__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sections: " + ", ".join(SECTIONS) + ". Patterns: " + ", ".join(PATTERNS) + ".",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="s per load run (10)")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure; medians (3)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke check: 3 s runs, 1 run, 5 cold models"
    )
    parser.add_argument(
        "--only",
        default="",
        metavar="LIST",
        help="comma-separated sections and/or patterns (default: everything)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for table.txt, results.json, bench.png (bench-results/)",
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        help=f"reference store, generated when missing (default {store.default_store()})",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open-loop offered req/s (default: half the hot closed-loop req/s)",
    )
    parser.add_argument(
        "--open-connections",
        type=int,
        default=0,
        help="open-loop connections (default: 2 x concurrency, at least 64)",
    )
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument(
        "--cold-models",
        type=int,
        default=20,
        help="unloaded models whose first request is timed, per run (20)",
    )
    parser.add_argument(
        "--api",
        choices=("djl", "sagemaker", "v2", "grpc"),
        default="djl",
        help="inference path of the wrk loads: /predictions/NAME, /invocations or "
        "/v2/models/NAME/infer (djl); grpc: the grpc section (V2 over gRPC beside V2 REST, "
        "and with --peer mlserver beside MLServer's gRPC), the wrk loads on the V2 path",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="before each load run, wait up to this long for other programs to leave the "
        "machine quiet (20; 0 = do not wait)",
    )
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also run py-spy on the frontend and the busiest backend under one pattern "
        "(--profile-pattern)",
    )
    parser.add_argument(
        "--profile-pattern",
        choices=PATTERNS,
        default="hot",
        help="the pattern --profile runs (hot)",
    )
    parser.add_argument(
        "--profile-rate",
        type=float,
        default=0.0,
        metavar="REQ/S",
        help="run --profile's load at this offered rate (open loop; 0: closed loop), so that "
        "two builds' profiles count the same requests",
    )
    parser.add_argument(
        "--server-exe",
        type=Path,
        default=None,
        metavar="PATH",
        help="the mmserver executable to measure (default: this checkout's .venv/bin/mmserver); "
        "e.g. another checkout's, to compare two versions of the server",
    )
    parser.add_argument(
        "--peer",
        choices=peers.PEERS,
        default=None,
        help="also measure another model server on the same 1,000 models in the closed and "
        "open loops, alternated with mmserver and the floor (mlserver: MLServer "
        f"{peers.MLSERVER_VERSION}, installed into its own venv on first use)",
    )
    parser.add_argument(
        "--floor",
        choices=("aiohttp", "raw"),
        default="aiohttp",
        help="the HTTP floor of the closed and open loops: aiohttp's web framework with nothing "
        "behind it, or raw, a protocol on httptools writing a fixed answer, the most one Python "
        "process on uvloop answers (aiohttp)",
    )
    parser.add_argument(
        "--baseline-exe",
        type=Path,
        default=None,
        metavar="PATH",
        help="measure this mmserver executable (another build) in place of the HTTP floor in "
        "the closed and open loops, alternated with the server: 'x floor' is then the ratio "
        "to that build",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for mmserver serve (repeat; e.g. --server-arg=--backend-processes=2)",
    )
    parser.add_argument(
        "--baseline-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the --baseline-exe server only, after the --server-arg ones "
        "(repeat): the same build with one option changed, e.g. --server-arg=--access-log "
        "--baseline-arg=--no-access-log",
    )
    parser.add_argument(
        "--async-requests",
        type=int,
        default=10_000,
        help="asynchronous requests per run of the async section (10000)",
    )
    parser.add_argument(
        "--async-large-mb",
        type=int,
        default=1024,
        help="MiB of the async section's one large CSV input (1024; 0 = none)",
    )
    group = parser.add_argument_group("transform section (--only transform)")
    group.add_argument(
        "--transform-rows",
        type=int,
        default=1_000_000,
        help="CSV rows of each model's job, in 20 files (1000000)",
    )
    group.add_argument(
        "--transform-concurrency",
        type=int,
        default=0,
        help="requests in flight of the job and of wrk beside it (0 = the CPU cores)",
    )
    group = parser.add_argument_group("scale section (--only scale)")
    group.add_argument(
        "--models", type=int, default=100_000, help="archives in the section's store (100000)"
    )
    group.add_argument("--scale-clients", type=int, default=16, help="client connections (16)")
    group.add_argument(
        "--scale-loaded", type=int, default=20_000, help="cold models loaded, each once (20000)"
    )
    group.add_argument(
        "--churn-loads",
        type=int,
        default=1_000_000,
        help="loads of the churn run; 0 = no churn run (1000000)",
    )
    group.add_argument(
        "--churn-cap", type=int, default=1000, help="--max-loaded-models of the churn run (1000)"
    )
    group.add_argument(
        "--churn-seconds",
        type=float,
        default=1800.0,
        help="the churn run ends after this long even short of --churn-loads (1800)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.runs, args.cold_models = 3.0, 1, 5
    if args.duration <= 0 or args.runs < 1 or args.concurrency < args.threads:
        parser.error("--duration > 0, --runs >= 1 and --concurrency >= --threads are required")
    if args.runs * args.cold_models > 1000:
        parser.error("--runs x --cold-models must be at most 1000 (distinct unloaded models)")
    chosen = {t.strip() for t in args.only.split(",") if t.strip()}
    unknown = chosen - set(SECTIONS) - set(PATTERNS)
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}")
    patterns = [p for p in PATTERNS if p in chosen] or list(PATTERNS)
    sections = [s for s in SECTIONS if s in chosen]
    if args.api == "grpc" and "grpc" not in sections:
        sections = [s for s in SECTIONS if s in chosen or s == "grpc"]
    if not sections:
        # Everything but scale, which runs servers of its own on a store of --models archives,
        # and grpc (--api grpc).
        sections = (
            ["closed", "open", "scaling"] if chosen else [s for s in SECTIONS if s not in OPT_IN]
        )
    if "scaling" in sections and "hot" not in patterns:
        patterns.insert(0, "hot")
    args.patterns, args.sections = patterns, sections
    args.open_connections = args.open_connections or max(64, 2 * args.concurrency)
    return args


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_SPIN = (
    "import time\nend = time.perf_counter() + {s}\nn = 0\n"
    "while time.perf_counter() < end:\n    n += 1\nprint(n)"
)


def cpu_capacity(seconds: float = 0.5) -> float:
    """How many cores' worth of work two busy processes get done, relative to one: a machine
    whose logical CPUs share less than that many physical cores shows it here."""

    def spin(count: int) -> int:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True
            )
            for _ in range(count)
        ]
        return sum(int(p.communicate(timeout=30)[0]) for p in procs)

    one = spin(1)
    return spin(2) / one if one else 0.0


def _header(args: argparse.Namespace, capacity: float, load: tuple[float, ...]) -> list[str]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=store.REPO,
            timeout=10,
        ).stdout.strip()
    except OSError:
        commit = "?"
    return [
        f"mmserver benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}  commit {commit or '?'}"
        f" (uncommitted changes included)  Python {platform.python_version()}",
        f"machine: {os.cpu_count()} logical CPUs doing {capacity:.2f} cores' worth of work "
        f"(two busy processes vs one); load average {load[0]:.2f} before the run",
        f"wrk -t{args.threads} -c{args.concurrency}, {args.duration:g} s x {args.runs} run(s), "
        f"medians; api {args.api}",
        "wrk, mmserver and its backend processes share the cores (no pinning), as do wrk and "
        "the floor.",
        f"command: scripts/bench {' '.join(sys.argv[1:])}".rstrip(),
        (
            f"the 'floor' rows are mmserver built at {args.baseline_exe} (the baseline)"
            if args.baseline_exe is not None
            else f"the 'floor' rows are the {args.floor} floor (benchlib/floor.py)"
        ),
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = loads.Settings(
        duration_s=args.duration,
        concurrency=args.concurrency,
        open_connections=args.open_connections,
        threads=args.threads,
        runs=args.runs,
        api="v2" if args.api == "grpc" else args.api,
        quiet_wait_s=args.quiet_wait,
    )
    raw: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    if "scale" in args.sections:
        scale_settings = scale.ScaleSettings(
            models=args.models,
            clients=args.scale_clients,
            loaded=args.scale_loaded,
            churn_loads=args.churn_loads,
            churn_cap=args.churn_cap,
            churn_seconds=args.churn_seconds,
            threads=args.threads,
            runs=args.runs,
        )
        with tempfile.TemporaryDirectory(prefix="mmserver-bench-") as tmp:
            raw["scale"] = scale.run(
                scale_settings,
                Path(tmp),
                args.out,
                args.server_arg,
                args.server_exe,
                _log,
                args.baseline_exe,
            )
        if args.sections == ["scale"]:
            return raw
    model_store = args.store or store.default_store()
    _log(f"model store: {model_store}")
    store.ensure_reference(model_store)
    if "async" in args.sections:
        with tempfile.TemporaryDirectory(prefix="mmserver-bench-") as tmp:
            raw["async"] = asyncbench.run(
                model_store,
                Path(tmp),
                args.out,
                args.server_arg,
                args.server_exe,
                settings,
                args.async_requests,
                args.async_large_mb,
                _log,
            )
        if args.sections == ["async"]:
            return raw
    if "transform" in args.sections:
        with tempfile.TemporaryDirectory(prefix="mmserver-bench-") as tmp:
            raw["transform"] = transformbench.run(
                model_store,
                Path(tmp),
                args.out,
                args.server_arg,
                args.server_exe,
                settings,
                args.transform_rows,
                args.transform_concurrency,
                _log,
            )
        if args.sections == ["transform"]:
            return raw
    for section, (run_section, _) in OWN_SERVERS.items():
        if section not in args.sections:
            continue
        with tempfile.TemporaryDirectory(prefix="mmserver-bench-") as tmp:
            raw[section] = run_section(
                model_store, Path(tmp), args.out, args.server_arg, args.server_exe, settings, _log
            )
        if args.sections == [section]:
            return raw
    if "batching" in args.sections:
        store.ensure_forests(model_store)
    if "neighbour" in args.sections:
        store.ensure_heavy(model_store)
    if "trees" in args.sections:
        trees.ensure(model_store)
    if "onnx" in args.sections:
        onnxbench.ensure(model_store)
    if "explain" in args.sections:
        explainbench.ensure(model_store)
    if "tabular" in args.sections:
        tabular.ensure(model_store)
    needs_floor = {"closed", "open"} & set(args.sections)
    with tempfile.TemporaryDirectory(prefix="mmserver-bench-") as tmp:
        server = servers.mmserver(
            model_store,
            Path(tmp) / "cache",
            args.out / "server.log",
            args.server_arg,
            args.server_exe,
            grpc="grpc" in args.sections,
        )
        floor: servers.Server | None
        if needs_floor and args.baseline_exe is not None:
            floor = servers.mmserver(
                model_store,
                Path(tmp) / "baseline-cache",
                args.out / "baseline.log",
                [*args.server_arg, *args.baseline_arg],
                args.baseline_exe,
            )
        else:
            floor = servers.floor(args.out / "floor.log", args.floor) if needs_floor else None
        peer = None
        if args.peer == "mlserver" and (needs_floor or "grpc" in args.sections):
            peer = peers.mlserver(model_store, Path(tmp), args.out / "mlserver.log")
        tabular_peer = None
        if args.peer == "mlserver" and "tabular" in args.sections:
            tabular_peer = peers.mlserver_tabular(
                model_store,
                list(tabular.MODELS.values()),
                Path(tmp),
                args.out / "mlserver-tabular.log",
            )
        try:
            server.start()
            _log(f"mmserver pid {server.pid} on {server.url}")
            for other in (floor, peer):
                if other is not None:
                    other.start()
                    _log(f"{other.name} pid {other.pid} on {other.url}")
            _measure(args, settings, server, floor, raw, peer)
            if "tabular" in args.sections:
                if tabular_peer is not None:  # only now: it would idle beside the others
                    tabular_peer.start()
                    _log(f"{tabular_peer.name} pid {tabular_peer.pid} on {tabular_peer.url}")
                raw["tabular"] = tabular.run(server, tabular_peer, model_store, settings, _log)
        finally:
            for each in (server, floor, peer, tabular_peer):
                if each is not None:
                    each.stop()
    return raw


def _measure(
    args: argparse.Namespace,
    settings: loads.Settings,
    server: servers.Server,
    floor: servers.Server | None,
    raw: dict[str, Any],
    peer: servers.Server | None = None,
) -> None:
    sections = args.sections
    if "cold" in sections:
        raw["cold"] = []
        for r in range(args.runs):
            models = [f"sklearn-{999 - r * args.cold_models - i}" for i in range(args.cold_models)]
            cpu.wait_quiet(args.quiet_wait)
            result = probes.cold_start(server, models)
            raw["cold"].append(result)
            _log(
                f"cold start, run {r + 1}/{args.runs}: first request "
                f"{result['cold_median_ms']:.1f} ms vs warm {result['warm_median_ms']:.2f} ms"
            )
    if {"memory", "closed", "open", "scaling", "grpc"} & set(sections):
        loaded = probes.load_all(server, 1000)
        raw["load_all"] = loaded
        if floor is not None and args.baseline_exe is not None:
            probes.load_all(floor, 1000)
        _log(f"loaded 1,000 models in {loaded['seconds']:.1f} s: statuses {loaded['statuses']}")
        if "memory" in sections:
            time.sleep(1)
            raw["memory"] = probes.memory(server)
            raw["scrape"] = probes.scrape(server)
            _log(
                f"memory: RSS {raw['memory']['rss_mb']:.0f} MB, "
                f"PSS {raw['memory']['pss_mb']:.0f} MB; /metrics {raw['scrape']['ms']:.0f} ms, "
                f"{raw['scrape']['bytes'] / 1e6:.1f} MB"
            )
    if "closed" in sections or "scaling" in sections:
        patterns = args.patterns if "closed" in sections else ["hot"]
        raw["closed"] = loads.closed_loop(
            server,
            floor if "closed" in sections else None,
            patterns,
            settings,
            "scaling" in sections,
            _log,
            peer if "closed" in sections else None,
        )
    if "open" in sections:
        rate = args.rate
        if not rate:
            hot = raw.get("closed", {}).get("hot", {}).get("mmserver")
            if hot:
                rate = 0.5 * float(report.median(r["rps"] for r in hot) or 0)
            else:
                load = wrk.Load(
                    url=server.url,
                    pattern="hot",
                    duration_s=args.duration,
                    connections=args.concurrency,
                    threads=args.threads,
                    api=args.api,
                )
                rate = 0.5 * wrk.run(load).rps
            rate = max(1.0, round(rate))
        raw["open"] = loads.open_loop(server, floor, args.patterns, rate, settings, _log, peer)
    if "batching" in sections:
        raw["batching"] = loads.batching(server, BATCH_MODELS, settings, _log)
    if "neighbour" in sections:
        raw["neighbour"] = neighbour.run(server, settings, _log)
    if "trees" in sections:
        raw["trees"] = trees.run(server, settings, _log)
    if "onnx" in sections:
        raw["onnx"] = onnxbench.run(server, settings, _log)
    if "explain" in sections:
        raw["explain"] = explainbench.run(server, settings, _log)
    if "grpc" in sections:
        raw["grpc"] = grpcload.section(server, peer, args.patterns, settings, _log)
    if args.profile:
        raw["profile"] = loads.profile(
            server,
            settings,
            args.profile,
            args.out,
            _log,
            pattern=args.profile_pattern,
            rate=args.profile_rate,
        )


def _profile_lines(prof: dict[str, Any]) -> list[str]:
    lines = []
    for role in ("frontend", "backend"):
        if role not in prof:
            continue
        entry = prof[role]
        load = prof.get("load", "hot pattern")
        lines += [
            "",
            f"Profile of the {role} (pid {entry['pid']}; py-spy, {load}, "
            f"{entry['samples']} samples): frames by own time",
        ]
        lines += [f"  {share * 100:5.1f} %  {frame}" for frame, share in entry["own"][:15]]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        _log("wrk is not installed (scripts/bench installs it with apt-get)")
        return 2
    started = time.monotonic()
    load = os.getloadavg()
    capacity = cpu_capacity()
    if load[0] > 0.5:
        _log(f"warning: load average {load[0]:.2f}: something else is running on this machine")
    raw = run(args)
    raw["machine"] = {"cpus": os.cpu_count(), "capacity": capacity, "loadavg": load}
    raw["floor"] = "baseline" if args.baseline_exe else args.floor
    summary = report.summarize(raw)
    text = report.table(summary, _header(args, capacity, load))
    if "grpc" in raw:
        text = text.rstrip("\n") + "\n" + "\n".join(grpcload.summary_lines(raw["grpc"])) + "\n"
    if "async" in raw:
        text = text.rstrip("\n") + "\n" + "\n".join(asyncbench.summary_lines(raw["async"])) + "\n"
    if "transform" in raw:
        text = text.rstrip("\n") + "\n" + "\n".join(transformbench.summary_lines(raw["transform"]))
        text += "\n"
    for section, (_, summary_lines) in OWN_SERVERS.items():
        if section in raw:
            text = text.rstrip("\n") + "\n" + "\n".join(summary_lines(raw[section])) + "\n"
    text += "\n".join(_profile_lines(raw.get("profile", {})))
    text = text.rstrip("\n") + f"\n\n({time.monotonic() - started:.0f} s)\n"
    print(text, end="")
    (args.out / "table.txt").write_text(text)
    report.write_json(args.out / "results.json", {"summary": summary, "raw": raw})
    if not report.plot(args.out / "bench.png", raw, summary):
        _log("matplotlib is not installed: no bench.png (pip install -e '.[bench]')")
    _log(f"wrote {args.out}/table.txt, results.json, bench.png")
    return 0
