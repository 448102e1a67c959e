"""``mmserver recommend MODEL``: load-test a model over a small grid of settings and recommend
its ``serving.properties`` and the instances a target throughput needs.

The load comes from this machine: wrk with the benchmark's script where wrk is installed, else
one Python process (:mod:`mmserver.loadtest.pyload`); either shares the CPUs with a server it
starts itself.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mmserver.loadtest import wrk
from mmserver.model_config import MAX_BATCH_DELAY_MS, cpu_count
from mmserver.recommend import plot
from mmserver.recommend.advice import Advice
from mmserver.recommend.progress import Progress
from mmserver.recommend.search import RUN_OVERHEAD_S, Plan, SettingResult, runs_per_setting, search
from mmserver.recommend.settings import Setting, grid, write_properties
from mmserver.recommend.target import Target, TargetError

#: Seconds a run lasts at most, however long the budget.
MAX_RUN_S = 10
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


def _body(args: argparse.Namespace) -> str | None:
    if args.payload is None:
        return None
    try:
        text = args.payload.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UsageError(f"--payload {args.payload}: cannot read it: {exc}") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--payload {args.payload} is not JSON: {exc}") from None
    if "\n" in text:  # wrk's script takes the body from one environment variable
        text = json.dumps(json.loads(text), separators=(",", ":"))
    body: str = text
    return body


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
            raise UsageError(f"--model-store {store} is not a folder")
        entries = [p for p in store.iterdir() if p.name.split(".", 1)[0] == args.model]
        if not entries:
            raise UsageError(f"the model store {store} has no model {args.model}")
        if args.write and not (store / args.model).is_dir():
            raise UsageError(
                f"--write: {args.model} is an archive in {store}, not a folder; put the "
                "recommended lines into its serving.properties yourself"
            )
    if args.load_generator == "wrk" and not wrk.installed():
        raise UsageError("--load-generator wrk: wrk is not installed (apt-get install wrk)")
    settings = grid(
        _numbers(args.batch_sizes, "--batch-sizes", 1),
        _numbers(args.batch_delays, "--batch-delays", 0, MAX_BATCH_DELAY_MS),
        _numbers(f"1,{cpu_count()}" if args.workers is None else args.workers, "--workers", 1),
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


def sample_body(inputs: list[dict[str, Any]]) -> str:
    """One request made from the model's V2 inputs: a row of 0.5s (as wide as the model takes),
    or one record for a model of named columns (0.5, or ``"a"`` for a string column)."""
    if len(inputs) == 1 and len(inputs[0].get("shape", [])) == 2:
        width = int(inputs[0]["shape"][1])
        return json.dumps([[0.5] * max(1, width)])
    if inputs:
        record = {i["name"]: "a" if i.get("datatype") == "BYTES" else 0.5 for i in inputs}
        return json.dumps([record])
    return "[[0.5]]"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        settings = check(args)
        body = _body(args)
    except UsageError as exc:
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
    model: str = args.model
    if args.model_store is not None:
        print(f"{PROG}: starting mmserver over {args.model_store}", file=sys.stderr)
        target = Target.start(args.model_store)
    else:
        target = Target.at(args.url)
    try:
        if body is None:
            body = sample_body(target.inputs(model))
        target.load(model, body.encode())
        runs = len(settings) * runs_per_setting(args.steps)
        left = deadline - time.monotonic()
        run_s = min(MAX_RUN_S, math.floor(left / runs - RUN_OVERHEAD_S))
        plan = Plan(model, body, args.p99_ms, max(1, run_s), args.steps, deadline, use_wrk)
        progress = Progress(runs, deadline)
        results: list[SettingResult] = []
        for setting in settings:
            before = progress.count
            results.append(search(target, setting, plan, progress.step))
            # A setting that stopped early counts its runs as done, so the bar reaches the end.
            progress.count = before + runs_per_setting(args.steps) - 1
            progress.step(f"{setting.label}: done")
        progress.finish()
        advice = Advice(
            model,
            args.p99_ms,
            args.target_rps,
            cpu_count(),
            "wrk" if use_wrk else "one Python process",
            results,
        )
        chosen = advice.chosen
        if args.write and chosen is not None:
            if args.model_store is not None:
                written = write_properties(args.model_store / model, chosen.setting)
                wrote = f"wrote {written}"
            else:
                target.keep(model, chosen.setting)
                wrote = f"applied to {model} on {target.url} (until it is unloaded)"
        else:
            wrote = ""
    finally:
        target.close()
    print(advice.text())
    if wrote:
        print(wrote)
    _write_outputs(args.out, advice)
    return 0 if chosen is not None else 1


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
