"""The routing experiment's model: its prediction time varies widely, as a generative model's.

``model.py`` answers ``2 * x`` per row after sleeping a lognormal time, with the median and
99th percentile given in ``serving.properties`` and capped at ``cap_s``. The row's value ``x``
in (0, 1) is the quantile of that time (any other value: the median), so the client draws the
random times: with the same seed, two runs ask for the same work in the same order, and the
difference between them is the routing's, not the dice's (with so heavy a tail, 500 draws'
mean still varies by about 8 %). ``time.sleep`` gives the CPU away, so many instances on a
small machine are limited by how many predictions each runs at once, not by its cores.
"""

from __future__ import annotations

from pathlib import Path

MODEL_NAME = "variable-latency"

HANDLER = '''\
"""2 * x per row, after sleeping the x-quantile of a lognormal time (median_ms, p99_ms), at
most cap_s; x outside (0, 1) sleeps the median."""

import math
import time
from statistics import NormalDist

Z99 = NormalDist().inv_cdf(0.99)


def load(model_dir, properties):
    median = float(properties["median_ms"]) / 1000
    sigma = math.log(float(properties["p99_ms"]) / 1000 / median) / Z99
    return math.log(median), sigma, float(properties["cap_s"])


def predict(model, batch):
    mu, sigma, cap = model
    seconds = 0.0
    for row in batch:
        q = float(row[0])
        z = NormalDist().inv_cdf(q) if 0.0 < q < 1.0 else 0.0
        seconds += min(math.exp(mu + sigma * z), cap)
    time.sleep(seconds)
    return [2.0 * float(row[0]) for row in batch]
'''


def write_variable_latency_dir(
    folder: Path, median_ms: float, p99_ms: float, workers: int, cap_s: float = 5.0
) -> Path:
    """The model folder; ``workers`` is both minWorkers and maxWorkers (no scaling in a run),
    one request per batch (a batch of generations costs more than one)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(HANDLER)
    properties = {
        "minWorkers": workers,
        "maxWorkers": workers,
        "batch_size": 1,
        "job_queue_size": 1000,
        "median_ms": median_ms,
        "p99_ms": p99_ms,
        "cap_s": cap_s,
    }
    (folder / "serving.properties").write_text(
        "".join(f"{key}={value}\n" for key, value in properties.items())
    )
    return folder
