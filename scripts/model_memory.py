#!/usr/bin/env python3
"""What loaded models cost in memory: every process of the server with one model loaded, then
with N, and the difference per model; or, with ``--forests``, whether the memory budget holds.

Runs a WorkLoadManager with real backend processes over a store (default: a temporary reference
store of N archives), loads one model, then N, and prints each process's RSS and PSS.

With ``--forests N``: writes N RandomForestRegressors (``--trees`` unbounded-depth trees each,
13.6 MB on disk at 75; hard links of one forest) into a temporary store, starts
``mmserver serve`` (``--server-exe``) on a free loopback port with ``--max-memory-mb``, sends
``--requests`` one-row requests to forests drawn at random (seeded), one at a time, and prints
the PSS of the server's whole process tree before the first request and after the last, each
process's, and the growth against the budget.

Usage: .venv/bin/python scripts/model_memory.py [--models N] [--backend-processes K] [--store DIR]
       .venv/bin/python scripts/model_memory.py --forests 60 --max-memory-mb 150 --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from proctools import free_port, tree_memory  # noqa: E402

from mmserver.codecs.requests import make_request  # noqa: E402
from mmserver.commands.launch import Child, Serve  # noqa: E402
from mmserver.config.server import ServerConfig  # noqa: E402
from mmserver.manager.wlm import WorkLoadManager  # noqa: E402
from mmserver.ops.metrics import Metrics  # noqa: E402
from mmserver.store.local import ModelStore  # noqa: E402


def snapshot(wlm: WorkLoadManager) -> dict[str, tuple[int, int]]:
    """RSS and PSS in KiB of the frontend and of each backend process."""
    pids = {"frontend": os.getpid()}
    pids.update({f"backend {i}": pid for i, pid in enumerate(wlm.backend.pids())})
    memory = {name: psutil.Process(pid).memory_full_info() for name, pid in pids.items()}
    return {name: (m.rss // 1024, m.pss // 1024) for name, m in memory.items()}


async def measure(store: Path, models: int, processes: int) -> None:
    config = ServerConfig(model_store=str(store), backend_processes=processes)
    wlm = WorkLoadManager(
        config, ModelStore(config.store_path, config.cache_path, 2**30), Metrics()
    )
    await wlm.start()
    x = make_request(b"[[0.5]]", "application/json", None)
    try:
        await wlm.submit("sklearn-0", x).answer
        one = snapshot(wlm)
        for i in range(models):
            await wlm.submit(f"sklearn-{i}", x).answer
        many = snapshot(wlm)
    finally:
        await wlm.stop(5.0)
    print(
        f"{'process':>12} {'RSS 1 model':>12} {'RSS ' + str(models):>10} "
        f"{'PSS 1 model':>12} {'PSS ' + str(models):>10} {'PSS per model':>14}"
    )
    for name in one:
        (rss1, pss1), (rssn, pssn) = one[name], many[name]
        per = (pssn - pss1) * 1024 / max(1, models - 1)
        print(
            f"{name:>12} {rss1 / 1024:10.1f}MB {rssn / 1024:8.1f}MB "
            f"{pss1 / 1024:10.1f}MB {pssn / 1024:8.1f}MB {per / 1024:11.1f} KB"
        )
    total = sum(p for _, p in many.values()) - sum(p for _, p in one.values())
    print(
        f"all processes: {total / max(1, models - 1):.1f} KB PSS per loaded model "
        "(the fork server, shared by the backends, is not included)"
    )


def tree_pss(pid: int) -> tuple[float, str]:
    """The PSS of ``pid`` and its descendants in MiB, and each process's (name pid: MiB)."""
    procs = tree_memory(pid)
    each = ", ".join(f"{p.name} {p.pid}: {p.pss_kb / 1024:.0f}" for p in procs)
    return sum(p.pss_kb for p in procs) / 1024, each


def forests(args: argparse.Namespace) -> None:
    """The ``--forests`` measurement (see the module docstring)."""
    import tree_models

    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "store"
        store.mkdir()
        tree_models.write_pickle(store / "forest-0", tree_models.forest(args.trees, depth=None))
        for i in range(1, args.forests):
            (store / f"forest-{i}").mkdir()
            os.link(store / "forest-0" / "model.joblib", store / f"forest-{i}" / "model.joblib")
        size = (store / "forest-0" / "model.joblib").stat().st_size
        server = Child(
            Serve(
                store,
                free_port(),
                args=("--max-memory-mb", str(args.max_memory_mb), "--log-level", "warning"),
                exe=args.server_exe,
            ),
            Path(folder) / "server.log",
        )
        server.start()
        base = server.url
        try:
            server.wait_ready(60.0)
            before, each_before = tree_pss(server.pid)
            rng = random.Random(0)
            body = json.dumps([[0.1 * i for i in range(tree_models.FEATURES)]]).encode()
            errors = 0
            started = time.monotonic()
            for _ in range(args.requests):
                request = urllib.request.Request(
                    f"{base}/predictions/forest-{rng.randrange(args.forests)}",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                try:
                    urllib.request.urlopen(request, timeout=60).read()
                except OSError:
                    errors += 1
            seconds = time.monotonic() - started
            after, each_after = tree_pss(server.pid)
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        finally:
            server.stop(30.0)
    loaded = [line for line in metrics.splitlines() if line.startswith("mmserver_models_loaded ")]
    print(f"{args.forests} forests of {size / 1e6:.1f} MB, --max-memory-mb {args.max_memory_mb}")
    print(f"{args.requests} requests in {seconds:.0f} s, {errors} errors; {', '.join(loaded)}")
    print(f"PSS before: {before:.1f} MiB ({each_before})")
    print(f"PSS after:  {after:.1f} MiB ({each_after})")
    print(f"growth: {after - before:+.1f} MiB against a budget of {args.max_memory_mb} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--backend-processes", type=int, default=2)
    parser.add_argument("--store", type=Path, help="a reference store (default: a temporary one)")
    parser.add_argument("--forests", type=int, default=0, help="the budget measurement's forests")
    parser.add_argument("--trees", type=int, default=75, help="trees of each forest")
    parser.add_argument("--max-memory-mb", type=int, default=150)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--server-exe", type=Path, default=ROOT / ".venv" / "bin" / "mmserver")
    args = parser.parse_args()
    if args.forests:
        forests(args)
        return
    if args.store is not None:
        asyncio.run(measure(args.store, args.models, args.backend_processes))
        return
    from tests.models import make_linear_archive

    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder)
        archive = make_linear_archive(store / "sklearn-0.tar.gz")
        for i in range(1, args.models):
            os.link(archive, store / f"sklearn-{i}.tar.gz")
        asyncio.run(measure(store, args.models, args.backend_processes))


if __name__ == "__main__":
    main()
