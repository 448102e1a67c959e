#!/usr/bin/env python3
"""What one batch costs to ship to a backend process and back, by batch shape.

Runs an identity model (``model.py`` returning its input's first column) in one backend process
and in the frontend's threads, sends it one ``.npy`` request of each shape, and prints the median
round trip per batch (decoding and encoding included, on both sides) with the difference: the
price of the process boundary (pickle protocol 5 over a Unix socket).

Usage: .venv/bin/python scripts/ipc_cost.py [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from mmserver.backend.placement import BackendPool
from mmserver.backend.wire import LoadSpec
from mmserver.codecs.requests import make_request
from mmserver.config.server import ModelConfig
from mmserver.ops.metrics import Metrics

IDENTITY = """\
def load(model_dir, properties):
    return None


def predict(model, batch):
    return batch[:, 0]
"""

SHAPES = ((1, 1), (32, 1), (1000, 10), (10000, 100))


async def measure(processes: int, model_dir: Path, repeat: int) -> dict[tuple[int, int], float]:
    pool = BackendPool(processes, Metrics())
    await pool.start()
    slot = pool.slots[0]
    await slot.load(LoadSpec("identity#1", model_dir, ModelConfig()))
    loop = asyncio.get_running_loop()
    medians = {}
    try:
        for shape in SHAPES:
            buffer = io.BytesIO()
            np.save(buffer, np.random.default_rng(0).random(shape))
            request = make_request(buffer.getvalue(), "application/x-npy", None)
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                answered: asyncio.Future[None] = loop.create_future()

                def done(_: object, error: BaseException | None, fut: Any = answered) -> None:
                    if error is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(error)

                slot.send_batch("identity#1", [request], loop.time() + 60, done)
                await answered
                times.append(time.perf_counter() - started)
            medians[shape] = statistics.median(times)
    finally:
        await pool.stop()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        (model_dir / "model.py").write_text(IDENTITY)
        # On uvloop, as the server runs.
        threads = uvloop.run(measure(0, model_dir, args.repeat))
        process = uvloop.run(measure(1, model_dir, args.repeat))
    columns = ("batch shape", "MiB", "threads µs", "process µs", "boundary µs")
    print("{:>14} {:>8} {:>11} {:>11} {:>12}".format(*columns))
    for shape in SHAPES:
        mib = shape[0] * shape[1] * 8 / 2**20
        t, p = threads[shape] * 1e6, process[shape] * 1e6
        print(f"{shape!s:>14} {mib:8.3f} {t:11.1f} {p:11.1f} {p - t:12.1f}")


if __name__ == "__main__":
    main()
