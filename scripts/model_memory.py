#!/usr/bin/env python3
"""What loaded models cost in memory: every process of the server with one model loaded, then
with N, and the difference per model.

Runs a WorkLoadManager with real backend processes over a store (default: a temporary reference
store of N archives), loads one model, then N, and prints each process's RSS and PSS.

Usage: .venv/bin/python scripts/model_memory.py [--models N] [--backend-processes K] [--store DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmserver.codecs import make_request  # noqa: E402
from mmserver.config import ServerConfig  # noqa: E402
from mmserver.metrics import Metrics  # noqa: E402
from mmserver.store import ModelStore  # noqa: E402
from mmserver.wlm import WorkLoadManager  # noqa: E402


def _kb(pid: int, path: str, key: str) -> int:
    with open(f"/proc/{pid}/{path}") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def snapshot(wlm: WorkLoadManager) -> dict[str, tuple[int, int]]:
    """RSS and PSS in KiB of the frontend and of each backend process."""
    pids = {"frontend": os.getpid()}
    pids.update({f"backend {i}": pid for i, pid in enumerate(wlm.backend.pids())})
    return {
        name: (_kb(pid, "status", "VmRSS:"), _kb(pid, "smaps_rollup", "Pss:"))
        for name, pid in pids.items()
    }


async def measure(store: Path, models: int, processes: int) -> None:
    config = ServerConfig(model_store=str(store), backend_processes=processes)
    wlm = WorkLoadManager(
        config, ModelStore(config.store_path, config.cache_path, 2**30), Metrics()
    )
    await wlm.start()
    x = make_request(b"[[0.5]]", "application/json", None)
    try:
        await wlm.infer("sklearn-0", x)
        one = snapshot(wlm)
        for i in range(models):
            await wlm.infer(f"sklearn-{i}", x)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--backend-processes", type=int, default=2)
    parser.add_argument("--store", type=Path, help="a reference store (default: a temporary one)")
    args = parser.parse_args()
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
