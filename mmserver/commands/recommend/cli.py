"""``mmserver recommend MODEL``: load-test a model over a small grid of settings and recommend
its ``serving.properties`` and the instances a target throughput needs.

The load comes from this machine: wrk with the benchmark's script where wrk is installed, else
one Python process (:mod:`mmserver.commands.loadtest.pyload`); either shares the CPUs with a server
it starts itself.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path

from mmserver.commands.loadtest import wrk
from mmserver.commands.recommend import plot
from mmserver.commands.recommend.advice import Advice
from mmserver.commands.recommend.payloads import PayloadError, read_payload
from mmserver.commands.recommend.progress import Progress
from mmserver.commands.recommend.search import RUN_OVERHEAD_S, SettingResult, runs_per_setting
from mmserver.commands.recommend.settings import LANES, Setting, grid, write_properties
from mmserver.commands.recommend.target import Target, TargetError
from mmserver.commands.recommend.trials import Trials
from mmserver.commands.recommend.trials import run as trials_run
from mmserver.config.model import LEAST, MAX_BATCH_DELAY_MS, cpu_count

PROG = "mmserver recommend"


class UsageError(Exception):
    """A bad argument; the message says which and why."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Load-test MODEL under increasing load over a small grid of settings (batch_size, "
            "max_batch_delay, maxWorkers) and recommend its serving.properties: the highest "
            "throughput whose p99 stays under --p99-ms, the CPU a request and the memory a "
            "copy takes, and the instances --target-rps needs."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="the model's name")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--model-store",
        metavar="DIR",
        type=Path,
        help="serve this model store on a free loopback port for the test (stopped after)",
    )
    where.add_argument(
        "--url",
        metavar="URL",
        help="a running mmserver (http://HOST:PORT) whose model this may reconfigure during the "
        "test; its settings are put back after (unless --write)",
    )
    parser.add_argument(
        "--p99-ms", type=float, required=True, metavar="MS", help="the p99 latency target"
    )
    parser.add_argument(
        "--target-rps",
        type=float,
        default=None,
        metavar="N",
        help="requests per second to size the instances for",
    )
    parser.add_argument(
        "--payload",
        type=Path,
        metavar="FILE",
        help="a JSON request body to send (default: one row made from the model's inputs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("recommendation"),
        metavar="DIR",
        help="where recommendation.json and recommendation.png go (./recommendation)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="write the recommended lines into the model folder's serving.properties "
        "(--model-store), or apply them to the running server's model (--url)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=3.0,
        metavar="M",
        help="time budget of the whole test, the server's start included (3)",
    )
    parser.add_argument(
        "--batch-sizes", default="1,32", metavar="LIST", help="batch_size values (1,32)"
    )
    parser.add_argument(
        "--batch-delays",
        default="0,2",
        metavar="LIST",
        help="max_batch_delay values in ms, tried with batch sizes over 1 (0,2)",
    )
    parser.add_argument(
        "--workers",
        default=None,
        metavar="LIST",
        help=f"maxWorkers values (1 and this machine's CPUs: 1,{cpu_count()})",
    )
    parser.add_argument(
        "--lanes",
        default="auto",
        metavar="LIST",
        help="auto: the server's lanes (a model costing more than heavy_batch_ms a request runs "
        "in the heavy lane, at a lower CPU priority); one: a server with one lane "
        "(--heavy-processes 0); auto,one tries both, each on a server of its own "
        "(--model-store only) (auto)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        metavar="N",
        help="open-loop runs per setting after its closed-loop run (4)",
    )
    parser.add_argument(
        "--load-generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="wrk (where installed) or one Python process (auto: wrk if installed)",
    )
    for option, what in (
        ("trusted-models", "model name patterns whose files are fully trusted"),
        ("trusted-types", "importable names every model's pickle may use"),
    ):
        parser.add_argument(
            f"--{option}",
            metavar="LIST",
            default="",
            help=f"(--model-store only) the server's {option.replace('-', '_')}: {what}",
        )
    parser.add_argument(
        "--no-isolate-trusted",
        action="store_true",
        help="(--model-store only) trusted models share the backend processes, as on a server "
        "with isolate_trusted=false",
    )
    return parser


def _numbers(text: str, flag: str, least: int, most: int | None = None) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r} is not a comma-separated list of integers") from None
    if not values:
        raise UsageError(f"{flag} is empty")
    for value in values:
        if value < least or (most is not None and value > most):
            upper = f" and at most {most}" if most is not None else ""
            raise UsageError(f"{flag}: {value} must be at least {least}{upper}")
    return sorted(set(values))


def check(args: argparse.Namespace) -> list[Setting]:
    """The grid, after checking every argument; :class:`UsageError` says what is wrong."""
    if not math.isfinite(args.p99_ms) or args.p99_ms <= 0:
        raise UsageError(f"--p99-ms must be a positive number of ms, not {args.p99_ms:g}")
    if args.target_rps is not None and (not math.isfinite(args.target_rps) or args.target_rps <= 0):
        raise UsageError(f"--target-rps must be positive, not {args.target_rps:g}")
    if not math.isfinite(args.max_minutes) or args.max_minutes <= 0:
        raise UsageError(f"--max-minutes must be positive, not {args.max_minutes:g}")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, not {args.steps}")
    if args.model_store is not None:
        store = args.model_store
        if not store.is_dir():
            raise UsageError(
                f"--model-store {store} is not a folder (for a store elsewhere, serve it and "
                "give --url)"
            )
        prefix = args.model + "."
        if not (store / args.model).exists() and not any(
            p.name.startswith(prefix) for p in store.iterdir()
        ):
            raise UsageError(f"the model store {store} has no model {args.model}")
        if args.write and not (store / args.model).is_dir():
            raise UsageError(
                f"--write: {args.model} is an archive in {store}, not a folder; put the "
                "recommended lines into its serving.properties yourself"
            )
    if args.load_generator == "wrk" and not wrk.installed():
        raise UsageError("--load-generator wrk: wrk is not installed (apt-get install wrk)")
    lanes = [part.strip() for part in args.lanes.split(",") if part.strip()]
    for lane in lanes:
        if lane not in LANES:
            raise UsageError(f"--lanes: {lane!r} is not one of {', '.join(LANES)}")
    if not lanes:
        raise UsageError("--lanes is empty")
    if args.url is not None and lanes != ["auto"]:
        raise UsageError(
            "--lanes: a running server's lanes are its own (a server option); try one lane "
            "with --model-store, which starts a server of each"
        )
    settings = grid(
        _numbers(args.batch_sizes, "--batch-sizes", LEAST["batch_size"]),
        _numbers(args.batch_delays, "--batch-delays", LEAST["max_batch_delay"], MAX_BATCH_DELAY_MS),
        _numbers(f"1,{cpu_count()}" if args.workers is None else args.workers, "--workers", 1),
        sorted(set(lanes), key=list(LANES).index),
    )
    runs = len(settings) * runs_per_setting(args.steps)
    least_s = runs * (1 + RUN_OVERHEAD_S)
    if args.max_minutes * 60 < least_s:
        raise UsageError(
            f"--max-minutes {args.max_minutes:g} is too short for {len(settings)} settings of "
            f"{runs_per_setting(args.steps)} runs of at least 1 s: give at least "
            f"{math.ceil(least_s / 6) / 10:g} minutes, or fewer settings (--batch-sizes, "
            "--batch-delays, --workers) or --steps"
        )
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        settings = check(args)
        body = read_payload(args.payload)
    except (UsageError, PayloadError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    use_wrk = args.load_generator == "wrk" or (args.load_generator == "auto" and wrk.installed())
    deadline = started + args.max_minutes * 60
    # SIGTERM ends the test as Ctrl-C does: through the finally that stops the server it started
    # (in a session of its own, which the signal to this process's group does not reach).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _recommend(args, settings, body, use_wrk, deadline)
    except TargetError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except (
        RuntimeError
    ) as exc:  # the load generator failed (mmserver.commands.loadtest.wrk says how)
        print(f"{PROG}: the load generator failed: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _recommend(
    args: argparse.Namespace,
    settings: list[Setting],
    body: str | None,
    use_wrk: bool,
    deadline: float,
) -> int:
    trials = Trials(
        model=args.model,
        settings=settings,
        p99_ms=args.p99_ms,
        steps=args.steps,
        deadline=deadline,
        use_wrk=use_wrk,
        model_store=args.model_store,
        url=args.url or "",
        body=body,
        server_args=(
            *(
                arg
                for option in ("trusted_models", "trusted_types")
                if getattr(args, option)
                for arg in (f"--{option.replace('_', '-')}", getattr(args, option))
            ),
            *(("--no-isolate-trusted",) if args.no_isolate_trusted else ()),
        ),
    )
    wrote: list[str] = []

    def advise(results: list[SettingResult]) -> Advice:
        generator = "wrk" if use_wrk else "one Python process"
        return Advice(args.model, args.p99_ms, args.target_rps, cpu_count(), generator, results)

    def apply_on_url(target: Target, results: list[SettingResult]) -> None:
        chosen = advise(results).chosen
        if args.write and args.url and chosen is not None:
            target.keep(args.model, chosen.setting)
            wrote.append(f"applied to {args.model} on {target.url} (until it is unloaded)")

    progress = Progress(len(settings) * runs_per_setting(args.steps), deadline)
    try:
        results = trials_run(trials, progress, _say, apply_on_url)
    finally:
        progress.finish()
    advice = advise(results)
    chosen = advice.chosen
    if args.write and args.model_store is not None and chosen is not None:
        wrote.append(f"wrote {write_properties(args.model_store / args.model, chosen.setting)}")
    print(advice.text())
    for line in wrote:
        print(line)
    _write_outputs(args.out, advice)
    return 0 if chosen is not None else 1


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr)


def _write_outputs(out: Path, advice: Advice) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "recommendation.json").write_text(json.dumps(advice.to_json(), indent=2) + "\n")
    print(f"wrote {out / 'recommendation.json'}")
    if plot.available():
        plot.write_plot(out / "recommendation.png", advice.results, advice.p99_ms)
        print(f"wrote {out / 'recommendation.png'}")
    else:
        print(
            "recommendation.png needs matplotlib: pip install 'mmserver[plot]' "
            "(recommendation.json has every figure)"
        )
