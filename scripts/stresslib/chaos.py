"""Kill backend processes with SIGKILL at random moments under load, then check the server
recovered: ``scripts/chaos [--kills N] ...`` (``--help`` lists the options).

It starts its own server on a generated store (fewer loaded models allowed than the store holds,
so kills also land while models load and unload), learns every model's answer to a probe, puts
the server under load from a bounded asyncio client, and kills a random backend process N times.
Then it reports the requests by status and checks:

- every request got an HTTP answer; every 200 is the model's right answer; every other answer is
  500 ``BackendDied`` (only a batch running in a killed process may fail);
- one backend restart per kill;
- the process count returns to frontend + fork server + resource tracker + backend processes;
- every model answers its probe correctly again;
- resident memory (RSS summed over the process tree) is back within a margin of its pre-chaos
  value;
- SIGTERM then stops the server with exit code 0 and no process left.

Exit code 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import proctools

from stresslib import load, proc


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/chaos", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--kills", type=int, default=10, help="backend processes to kill (1-500)")
    parser.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(0.2, 1.5),
        metavar=("MIN", "MAX"),
        help="random seconds between two kills",
    )
    parser.add_argument(
        "--models",
        type=int,
        default=40,
        help="sklearn-N archives in the generated store (plus 4 examples)",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=24,
        help="loaded-model budget of the server (below the store: churn)",
    )
    parser.add_argument("--backend-processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--rss-margin",
        type=float,
        default=0.25,
        help="allowed RSS growth after recovery, as a fraction",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the store and the server log (default: a temp folder)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.kills <= 500:
        parser.error("--kills must be between 1 and 500")
    if not 0 <= args.interval[0] <= args.interval[1] <= 30:
        parser.error("--interval needs 0 <= MIN <= MAX <= 30")
    if not 1 <= args.concurrency <= 256 or not 1 <= args.backend_processes <= 64:
        parser.error("--concurrency must be 1-256 and --backend-processes 1-64")
    if args.max_loaded_models and args.max_loaded_models <= args.concurrency:
        parser.error("--max-loaded-models must exceed --concurrency (or be 0: no limit)")
    return args


async def list_models(session: aiohttp.ClientSession, url: str) -> list[str]:
    names: list[str] = []
    token = ""
    for _ in range(1000):  # pages of 100: up to 100,000 models
        query = f"?limit=100&next_page_token={token}" if token else "?limit=100"
        async with session.get(f"{url}/models{query}") as response:
            page = await response.json()
        names.extend(m["modelName"] for m in page["models"])
        token = page.get("nextPageToken", "")
        if not token:
            break
    return names


async def wait_for_tree(server: proc.Server, backends: int, timeout: float) -> proc.Tree:
    """The process tree once it has exactly ``backends`` backend processes and nothing else
    unexpected (or as it is when ``timeout`` passes)."""
    give_up = time.monotonic() + timeout
    while True:
        current = proc.tree(server.pid)
        settled = (
            len(current.backends) == backends
            and not current.others
            and current.fork_server is not None
            and current.resource_tracker is not None
        )
        if settled or time.monotonic() > give_up:
            return current
        await asyncio.sleep(0.1)


async def killer(
    server: proc.Server,
    kills: int,
    interval: tuple[float, float],
    rng: random.Random,
    killed: list[tuple[float, int]],
) -> None:
    for _ in range(kills):
        await asyncio.sleep(rng.uniform(*interval))
        for _ in range(100):  # a replacement may be starting: wait up to 10 s for a backend
            backends = proc.tree(server.pid).backends
            if backends:
                break
            await asyncio.sleep(0.1)
        else:
            continue
        pid = rng.choice(backends)
        server.remember_family()
        if pid not in proctools.descendants(server.pid):  # only a process of the server we started
            continue
        os.kill(pid, signal.SIGKILL)
        killed.append((time.monotonic(), pid))
        for _ in range(100):  # gone within 10 s: the next kill cannot pick it again
            if not proctools.alive(pid):
                break
            await asyncio.sleep(0.01)


async def chaos(args: argparse.Namespace, out: Path, started: list[proc.Server]) -> list[Check]:
    rng = random.Random(args.seed)
    store = out / "store"
    print(f"store: {store} ({args.models} archives + examples)", flush=True)
    proc.generate_store(store, args.models)
    server = proc.Server(
        store,
        out / "server.log",
        "--backend-processes",
        str(args.backend_processes),
        "--max-loaded-models",
        str(args.max_loaded_models),
    )
    started.append(server)
    server.start()
    checks: list[Check] = []
    try:
        checks = await _run(args, server, rng)
    finally:
        code, left = server.stop()
        checks.append(Check("stopped by SIGTERM with exit code 0", code == 0, f"exit code {code}"))
        checks.append(Check("no process left after the stop", not left, f"left: {left}"))
        print(f"server log: {server.log_path}")
    return checks


async def _run(args: argparse.Namespace, server: proc.Server, rng: random.Random) -> list[Check]:
    checks: list[Check] = []
    expected_count = 3 + args.backend_processes
    probes = load.Probes()
    async with aiohttp.ClientSession() as session:
        models = await list_models(session, server.url)
        largest_batch = 1
        for model in models:
            await probes.learn(session, server.url, model)
            async with session.get(f"{server.url}/models/{model}") as response:
                [workflow] = await response.json()
                largest_batch = max(largest_batch, workflow["models"][0]["batchSize"])
        print(f"server pid {server.pid} on {server.url}: {len(models)} models probed", flush=True)
        before_tree = await wait_for_tree(server, args.backend_processes, 30)
        before = proc.memory(server.pid)
        restarts_before = (await load.metrics(session, server.url)).get(
            "mmserver_backend_restarts_total", 0.0
        )
    print(
        f"before: {before_tree.count} processes, RSS {before.rss_mb:.0f} MiB, "
        f"PSS {before.pss_mb:.0f} MiB",
        flush=True,
    )

    record = load.Record()
    killed: list[tuple[float, int]] = []
    stop = asyncio.Event()
    started = time.monotonic()
    bound = started + args.kills * (args.interval[1] + 10) + 30
    load_task = asyncio.ensure_future(
        load.run_load(
            server.url,
            lambda: rng.choice(models),
            probes,
            record,
            concurrency=args.concurrency,
            until=bound,
            max_requests=10_000_000,
            stop=stop,
        )
    )
    try:
        await killer(server, args.kills, tuple(args.interval), rng, killed)
        await asyncio.sleep(2.0)  # load goes on a moment after the last kill
    finally:
        stop.set()
        await load_task
    seconds = time.monotonic() - started

    counts = record.by_status()
    total = sum(counts.values())
    print(f"\nchaos: {len(killed)} backend processes killed in {seconds:.1f} s, {total} requests")
    for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {key:<28} {count:>8}  ({100 * count / max(1, total):.2f} %)")
    failed = {k: v for k, v in counts.items() if k != "200"}
    unanswered = sum(v for k, v in failed.items() if k.startswith("0 "))
    wrong = sum(1 for o in record.outcomes if o.wrong)
    died = failed.get("500 BackendDied", 0)
    others = {k: v for k, v in failed.items() if k != "500 BackendDied"}
    checks.append(
        Check(
            "every request got an HTTP answer", unanswered == 0, f"{unanswered} without an answer"
        )
    )
    for o in [o for o in record.outcomes if o.wrong][:5]:
        print(f"  wrong answer from {o.model}: {o.answer!r}, expected {probes.answers[o.model]!r}")
    checks.append(Check("every 200 is the model's right answer", wrong == 0, f"{wrong} wrong"))
    checks.append(Check("every failure is 500 BackendDied", not others, f"others: {others}"))
    checks.append(
        Check(
            "at most one batch failed per kill",
            died <= len(killed) * largest_batch,
            f"{died} BackendDied for {len(killed)} kills, batches of up to {largest_batch}",
        )
    )

    # Recovery.
    after_tree = await wait_for_tree(server, args.backend_processes, 30)
    checks.append(
        Check(
            "process count back to frontend + fork server + resource tracker + backends",
            after_tree.count == expected_count
            and len(after_tree.backends) == args.backend_processes,
            f"{after_tree.count} processes ({len(after_tree.backends)} backends), "
            f"expected {expected_count}",
        )
    )
    async with aiohttp.ClientSession() as session:
        restarts = (await load.metrics(session, server.url)).get(
            "mmserver_backend_restarts_total", 0.0
        ) - restarts_before
        checks.append(
            Check(
                "one backend restart per kill",
                restarts == len(killed),
                f"{restarts:.0f} restarts for {len(killed)} kills",
            )
        )
        bad: list[str] = []
        for model in models:
            outcome = await load.one(session, server.url, model, probes, 30)
            if outcome.status != 200 or outcome.wrong:
                bad.append(f"{model}: {outcome.status} {outcome.error}")
        checks.append(
            Check(
                "every model answers correctly after the chaos",
                not bad,
                f"{len(models) - len(bad)}/{len(models)} right; {bad[:3]}",
            )
        )
    after = proc.memory(server.pid)
    ratio = after.rss_mb / before.rss_mb if before.rss_mb else float("inf")
    print(
        f"after: {after_tree.count} processes, RSS {after.rss_mb:.0f} MiB, "
        f"PSS {after.pss_mb:.0f} MiB (RSS x{ratio:.2f} of before)"
    )
    checks.append(
        Check(
            f"RSS back within {100 * args.rss_margin:.0f} % of before",
            after.rss_mb <= before.rss_mb * (1 + args.rss_margin),
            f"{before.rss_mb:.0f} MiB before, {after.rss_mb:.0f} MiB after",
        )
    )
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc.interrupt_on_sigterm()
    started: list[proc.Server] = []
    try:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            checks = asyncio.run(chaos(args, args.out, started))
        else:
            with tempfile.TemporaryDirectory(prefix="mmserver-chaos-") as tmp:
                checks = asyncio.run(chaos(args, Path(tmp), started))
    except KeyboardInterrupt:
        print("interrupted: stopping the server", file=sys.stderr)
        return 130
    finally:
        for server in started:
            server.stop()  # does nothing when already stopped
    print("\nchecks:")
    for check in checks:
        print(f"  [{'PASS' if check.ok else 'FAIL'}] {check.name} ({check.detail})")
    ok = all(check.ok for check in checks)
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
