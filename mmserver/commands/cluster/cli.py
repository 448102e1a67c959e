"""mmserver cluster: several mmserver instances behind HAProxy on one port.

start       start a cluster in the background; returns once it serves
run         the same in the foreground, until Ctrl-C or SIGTERM
stop        stop the cluster of a state directory (HAProxy first, then the instances drain)
restart     restart the instances one at a time, each out of HAProxy until it is warm again
upgrade     the same, onto the mmserver installed now
status      the instances, their health and their load, as HAProxy sees them
config      print the HAProxy configuration for a list of instances (other machines too)
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mmserver.commands.cluster import balancer, cluster, rolling
from mmserver.commands.cluster.instances import InstanceSpec
from mmserver.commands.procfs import HOST
from mmserver.commands.procs import ProcessId
from mmserver.config.server import resolves_to_loopback

PROG = "mmserver cluster"
DEFAULT_STATE_DIR = Path(".cache/cluster")
START_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 3600.0
STRATEGIES = [s.value for s in balancer.Strategy]


def default_backend_processes(instances: int) -> int:
    """The machine's cores shared out between the instances, at least one each."""
    return max(1, (os.cpu_count() or 1) // max(1, instances))


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=3, help="mmserver instances (3)")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="LEAST_OUTSTANDING_REQUESTS",
        help="routing strategy (LEAST_OUTSTANDING_REQUESTS)",
    )
    parser.add_argument("--port", type=int, default=8080, help="HAProxy's port on 127.0.0.1 (8080)")
    parser.add_argument(
        "--model-store",
        type=Path,
        default=Path("model_store"),
        help="the model store every instance serves (model_store)",
    )
    parser.add_argument(
        "--backend-processes",
        type=int,
        default=0,
        help="backend processes per instance (default: CPU cores / instances, at least 1)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every mmserver serve (repeat; e.g. "
        "--server-arg=--max-loaded-models=200)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"pid, state, configuration and log files ({DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--stats-port",
        type=int,
        default=0,
        help="HAProxy's stats page and Prometheus metrics on 127.0.0.1 "
        "(default: a free port; see status)",
    )
    parser.add_argument(
        "--hash-balance-factor",
        type=int,
        default=150,
        help="MODEL_AFFINITY: most load an instance takes, in %% of the "
        "average, before a model spills to the next instance (150)",
    )
    parser.add_argument(
        "--check-interval-ms", type=int, default=500, help="health check interval on /ping (500)"
    )
    parser.add_argument(
        "--warm-ready-timeout",
        type=float,
        default=120.0,
        help="s an instance started again stays out of the balancer while it loads the models "
        "it had (its warm set), at most (120)",
    )
    parser.add_argument(
        "--no-restart", action="store_true", help="do not restart an instance whose process ends"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("start", "start a cluster in the background"),
        ("run", "run a cluster in the foreground until Ctrl-C or SIGTERM"),
    ):
        _cluster_options(sub.add_parser(name, help=text, description=text))
    for name, text in (
        ("stop", "stop the cluster of a state directory"),
        ("status", "show the cluster of a state directory"),
        ("restart", "restart the instances of a running cluster one at a time"),
        ("upgrade", "restart the instances of a running cluster onto the mmserver installed now"),
    ):
        each = sub.add_parser(name, help=text, description=text)
        each.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
        if name in ("restart", "upgrade"):
            each.add_argument(
                "--timeout",
                type=float,
                default=RESTART_TIMEOUT_S,
                help=f"s to wait for the restart to end ({RESTART_TIMEOUT_S:.0f})",
            )
    config = sub.add_parser(
        "config",
        help="print an HAProxy configuration",
        description="Print the HAProxy configuration for the given instances: the one file "
        "every balancer in front of them can use.",
    )
    config.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="an mmserver instance (repeat; order fixes the server ids)",
    )
    config.add_argument("--strategy", choices=STRATEGIES, default="LEAST_OUTSTANDING_REQUESTS")
    config.add_argument("--bind", default=HOST, help="address HAProxy listens on (127.0.0.1)")
    config.add_argument("--port", type=int, default=8080)
    config.add_argument(
        "--management-token",
        default="",
        help="token HAProxy asks of management calls (Authorization: Bearer TOKEN); needed "
        "with a --bind that is not loopback",
    )
    config.add_argument(
        "--insecure-management",
        action="store_true",
        help="allow a non-loopback --bind without a management token",
    )
    config.add_argument(
        "--stats-bind",
        default=HOST,
        help="address of the stats page and HAProxy's metrics, which have no token (127.0.0.1)",
    )
    config.add_argument("--stats-port", type=int, default=8404)
    config.add_argument("--hash-balance-factor", type=int, default=150)
    config.add_argument("--check-interval-ms", type=int, default=500)
    args = parser.parse_args(argv)
    if args.command in ("start", "run"):
        if args.instances < 1 or args.backend_processes < 0:
            parser.error("--instances >= 1 and --backend-processes >= 0 are required")
        if args.hash_balance_factor and args.hash_balance_factor <= 100:
            parser.error("--hash-balance-factor is a percentage above 100 (or 0: unbounded)")
        if args.warm_ready_timeout < 0:
            parser.error("--warm-ready-timeout must be 0 or more")
        if _instance_option(args.server_arg, "state_dir") not in ("", None):
            parser.error(
                "the instances cannot share a state_dir (--server-arg=--state-dir or "
                "MMSERVER_STATE_DIR): each has its own under the cluster's --state-dir (its "
                "warm set), and asynchronous inference keeps its journal on one server; "
                "serve it with mmserver serve"
            )
        if _instance_option(args.server_arg, "grpc_port") not in ("", "0", None):
            parser.error(
                "the instances cannot share a grpc_port (--server-arg=--grpc-port or "
                "MMSERVER_GRPC_PORT): only the first would listen on it, and the balancer "
                "carries HTTP only; serve gRPC with mmserver serve"
            )
    return args


def _instance_option(server_args: list[str], name: str) -> str | None:
    """The value every instance would get for the server option ``name``: from a server
    argument, or else from the environment they inherit; None when neither gives one."""
    flag = "--" + name.replace("_", "-")
    value = os.environ.get("MMSERVER_" + name.upper())
    for i, arg in enumerate(server_args):
        if arg == flag:
            value = server_args[i + 1] if i + 1 < len(server_args) else ""
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return None if value is None else value.strip()


def _spec(args: argparse.Namespace) -> cluster.ClusterSpec:
    store = args.model_store.resolve()
    try:
        cluster.admin_socket(args.state_dir.resolve())
    except ValueError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    if not store.is_dir():
        raise SystemExit(
            f"{PROG}: no model store at {store} (write one with "
            f".venv/bin/python scripts/generate_store.py --out {args.model_store})"
        )
    return cluster.ClusterSpec(
        instances=args.instances,
        strategy=balancer.Strategy(args.strategy),
        port=args.port,
        instance=InstanceSpec(
            model_store=store,
            backend_processes=args.backend_processes or default_backend_processes(args.instances),
            server_args=tuple(args.server_arg),
            warm_ready_timeout=args.warm_ready_timeout,
        ),
        state_dir=args.state_dir.resolve(),
        stats_port=args.stats_port,
        hash_balance_factor=args.hash_balance_factor,
        check_inter_ms=args.check_interval_ms,
        restart=not args.no_restart,
    )


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    the_cluster = cluster.Cluster(spec, stop)
    signal.signal(rolling.RESTART_SIGNAL, lambda *_: the_cluster.restart_requested.set())
    try:
        the_cluster.start()
    except cluster.Stopped:
        return 0
    except RuntimeError as exc:
        logging.getLogger("cluster").error("%s", exc)
        return 1
    print(
        f"serving on {the_cluster.balancer.url} ({spec.strategy.value}); "
        f"stats on {the_cluster.state()['stats_url']}",
        flush=True,
    )
    try:
        code = the_cluster.supervise()
    finally:
        the_cluster.stop()
    return code


def start(args: argparse.Namespace) -> int:
    """Run the supervisor (``run``) detached, in its own session, and wait until it serves."""
    spec = _spec(args)
    balancer.haproxy_binary()
    spec.state_dir.mkdir(parents=True, exist_ok=True)
    cluster.refuse_if_running(spec.state_dir)
    (spec.state_dir / cluster.STATE_FILE).unlink(missing_ok=True)
    argv = [sys.executable, "-m", "mmserver", "cluster", "run", *_forwarded(args, spec)]
    log_path = spec.state_dir / "cluster.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_S + spec.instance.warm_ready_timeout
    while time.monotonic() < deadline:
        state = cluster.read_state(spec.state_dir)
        if (
            state
            and state.get("phase") == "ready"
            and (state.get("supervisor") or {}).get("pid") == proc.pid
        ):
            _print_state(state)
            return 0
        if proc.poll() is not None:
            print(
                f"{PROG}: the cluster did not start (exit code {proc.returncode}):\n"
                + _tail(log_path),
                file=sys.stderr,
            )
            return 1
        time.sleep(0.1)
    print(f"{PROG}: not ready in {START_TIMEOUT_S:.0f} s; stopping it", file=sys.stderr)
    ident = ProcessId.of(proc.pid)
    if ident is not None:
        ident.signal(signal.SIGTERM)
    proc.wait()
    return 1


def _forwarded(args: argparse.Namespace, spec: cluster.ClusterSpec) -> list[str]:
    out = [
        "--instances",
        str(spec.instances),
        "--strategy",
        spec.strategy.value,
        "--port",
        str(spec.port),
        "--model-store",
        str(spec.instance.model_store),
        "--backend-processes",
        str(spec.instance.backend_processes),
        "--state-dir",
        str(spec.state_dir),
        "--stats-port",
        str(spec.stats_port),
        "--hash-balance-factor",
        str(spec.hash_balance_factor),
        "--check-interval-ms",
        str(spec.check_inter_ms),
        "--warm-ready-timeout",
        f"{spec.instance.warm_ready_timeout:g}",
        *(f"--server-arg={a}" for a in spec.instance.server_args),
    ]
    return out + (["--no-restart"] if args.no_restart else [])


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _print_state(state: dict[str, Any]) -> None:
    supervisor = (state.get("supervisor") or {}).get("pid")
    print(
        f"{state['strategy']} on {state['url']} (stats {state['stats_url']}); "
        f"supervisor pid {supervisor}"
    )
    for inst in state.get("instances", []):
        print(f"  {inst['name']}: http://{HOST}:{inst['port']} pid {inst.get('pid')}")


def stop(args: argparse.Namespace) -> int:
    print(cluster.stop_recorded(args.state_dir.resolve()))
    return 0


def restart(args: argparse.Namespace) -> int:
    """Ask the supervisor for a rolling restart and follow it to its end: 0 when every
    instance is back, 1 when one did not come back or the wait timed out, 2 when there is no
    running cluster to restart."""
    state_dir = args.state_dir.resolve()
    try:
        outcome = cluster.restart_recorded(
            state_dir, args.timeout, lambda step: print(f"  {step}", flush=True)
        )
    except cluster.NoCluster as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 1
    for each in outcome["instances"]:
        versions = each["version_before"] or "?"
        if each["version_after"] and each["version_after"] != each["version_before"]:
            versions += f" -> {each['version_after']}"
        print(
            f"  {each['name']}: pid {each['old_pid']} -> {each['new_pid'] or '-'}, {versions}, "
            f"models loaded {_count(each['models_before'])} before, "
            f"{_count(each['models_after'])} when back"
        )
    if outcome["phase"] != rolling.Phase.DONE.value:
        print(f"{PROG} {args.command}: {outcome['phase']}: {outcome['message']}", file=sys.stderr)
        return 1
    print(outcome["message"])
    return 0


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def status(args: argparse.Namespace) -> int:
    state = cluster.read_state(args.state_dir.resolve())
    supervisor = cluster.supervisor_of(state) if state else None
    if state is None or supervisor is None or not supervisor.alive():
        print(f"no cluster running from {args.state_dir}")
        return 1
    print(f"phase {state['phase']}")
    _print_state(state)
    restart = state.get("restart") or {}
    if restart.get("phase", "none") not in ("none", rolling.Phase.RUNNING.value):
        print(f"  last rolling restart: {restart['phase']}: {restart['message']}")
    elif restart.get("phase") == rolling.Phase.RUNNING.value and restart.get("steps"):
        print(f"  rolling restart under way: {restart['steps'][-1]}")
    stats = balancer.server_stats(int(state["stats_port"]))
    print(f"  {'instance':<9}{'status':<10}{'in flight':>10}{'requests':>10}{'failed':>8}")
    for name, row in stats.items():
        failed = int(row.get("econ") or 0) + int(row.get("eresp") or 0)
        print(f"  {name:<9}{row['status']:<10}{row['scur']:>10}{row['stot']:>10}{failed:>8}")
    return 0


def config(args: argparse.Namespace) -> int:
    servers = []
    for n, each in enumerate(args.server):
        host, _, port = each.rpartition(":")
        if not host or not port.isdigit():
            raise SystemExit(f"{PROG}: --server {each!r} is not HOST:PORT")
        servers.append((f"i{n}", host, int(port)))
    if not (args.management_token or args.insecure_management or resolves_to_loopback(args.bind)):
        print(
            f"{PROG}: refusing to bind {args.bind}: the instances behind HAProxy take "
            "management calls (POST, PUT and DELETE on /models, the /v2/repository load and "
            "unload calls) from whoever reaches them; pass --management-token TOKEN for "
            "HAProxy to ask it of those calls, or --insecure-management to publish them "
            "without one",
            file=sys.stderr,
        )
        return 2
    spec = balancer.BalancerSpec(
        strategy=balancer.Strategy(args.strategy),
        port=args.port,
        stats_port=args.stats_port,
        servers=tuple(servers),
        hash_balance_factor=args.hash_balance_factor,
        check_inter_ms=args.check_interval_ms,
        bind=args.bind,
        stats_bind=args.stats_bind,
        management_token=args.management_token,
    )
    try:
        text = balancer.render(spec)
    except ValueError as exc:
        print(f"{PROG}: --management-token: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = parse_args(argv)
    commands = {
        "start": start,
        "run": run,
        "stop": stop,
        "restart": restart,
        "upgrade": restart,
        "status": status,
        "config": config,
    }
    return int(commands[args.command](args))
