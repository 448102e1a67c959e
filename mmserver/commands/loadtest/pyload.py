"""The load of :mod:`mmserver.commands.loadtest.wrk` from one Python process, where wrk is not
installed.

``python -m mmserver.commands.loadtest.pyload URL DURATION_S CONNECTIONS`` takes the same
``BENCH_*`` environment as ``load.lua`` (pattern, API, body, open-loop rate) and prints the same
``BENCH_JSON`` line, so :func:`mmserver.commands.loadtest.wrk.parse` reads either. One asyncio loop
on uvloop keeps ``CONNECTIONS`` keep-alive HTTP/1.1 connections busy (closed loop), or hands them
send slots ``1 / rate`` apart (open loop: ``BENCH_THREAD_RATE`` times ``BENCH_THREADS`` in all),
counting the sends more than 1 ms after their slot as ``load.lua`` does; the connections are
:mod:`~mmserver.commands.loadtest.users`' users. A request is timed from its write to the end of
its answer, as wrk times it.

One process: it costs more CPU a request than wrk (on 2 cores, about 35 % of a core against
wrk's 13 % for the same 5,000 requests per second) and never more than one core, taken from the
server on a small machine.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from mmserver.commands.loadtest import users

TIMEOUT_S = 5.0
QUANTILES = (50, 75, 90, 99, 99.9)
#: Requests a second no run of one Python process reaches: the count's bound of a run.
MAX_RATE = 1_000_000


@dataclass
class _Tally:
    latencies_us: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("connect", "read", "write", "status", "timeout"), 0)
    )
    bytes: int = 0

    def add(self, _: None, outcome: users.Outcome) -> None:
        if outcome.error:
            self.errors[outcome.error] += 1
            return
        self.latencies_us.append(outcome.seconds * 1e6)
        self.bytes += outcome.size
        if not 200 <= outcome.status <= 299:
            self.statuses[str(outcome.status)] = self.statuses.get(str(outcome.status), 0) + 1
            self.errors["status"] += 1


def _requests(host: str, port: int) -> tuple[list[bytes], Callable[[random.Random], int]]:
    """The prebuilt requests and the pattern's pick of one (as ``load.lua`` builds them)."""
    api = os.environ.get("BENCH_API", "djl")
    body = os.environ.get("BENCH_BODY", "[[0.5]]").encode()
    pattern = os.environ.get("BENCH_PATTERN", "uniform")
    count = int(os.environ.get("BENCH_MODELS", "1000"))
    names = (
        [os.environ.get("BENCH_MODEL", "sklearn-0")]
        if pattern == "single"
        else [f"sklearn-{i}" for i in range(count)]
    )

    def build(name: str) -> bytes:
        headers = {"Content-Type": "application/json"}
        if api == "sagemaker":
            path = "/invocations"
            headers["X-Amzn-SageMaker-Target-Model"] = name + ".tar.gz"
        elif api in ("v2", "mlserver"):
            path = f"/v2/models/{name}/infer"
        else:
            path = f"/predictions/{name}"
        return users.request("POST", path, body, headers, host=host, port=port)

    requests = [build(name) for name in names]
    hot = float(os.environ.get("BENCH_HOT", "0.9"))
    if pattern == "single":
        return requests, lambda rng: 0
    if pattern == "hot":
        return requests, lambda rng: 0 if rng.random() < hot else rng.randrange(1, count)
    if pattern == "zipf":
        s = float(os.environ.get("BENCH_ZIPF_S", "1.1"))
        weights = np.cumsum([1 / k**s for k in range(1, count + 1)])
        cdf = list(weights / weights[-1])
        return requests, lambda rng: min(bisect.bisect_left(cdf, rng.random()), count - 1)
    if pattern == "uniform":
        return requests, lambda rng: rng.randrange(count)
    if pattern == "cycle":
        start = int(os.environ.get("BENCH_START", "0"))
        state = {"next": start}

        def cycle(rng: random.Random) -> int:
            index = state["next"] % count
            state["next"] += 1
            return index

        return requests, cycle
    raise SystemExit(f"BENCH_PATTERN must be uniform, hot, zipf, single or cycle, not {pattern}")


async def run(url: str, duration_s: float, connections: int) -> dict[str, object]:
    """Generate the load; the ``BENCH_JSON`` object ``load.lua`` prints."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    requests, pick = _requests(host, port)
    rate = float(os.environ.get("BENCH_THREAD_RATE", "0") or 0) * int(
        os.environ.get("BENCH_THREADS", "1")
    )
    seed = int(os.environ.get("BENCH_SEED", "1"))
    tally = _Tally()
    schedule = users.Schedule(rate) if rate > 0 else None
    started = time.perf_counter()
    # Any host, as wrk: mmserver recommend --url names the server. Bounded by the duration; the
    # count's bound is above what one process sends in that time.
    await users.run(
        host,
        port,
        connections,
        lambda rng: (requests[pick(rng)], None),
        tally.add,
        duration_s=duration_s,
        max_requests=int(MAX_RATE * duration_s) + connections,
        timeout_s=TIMEOUT_S,
        seed=seed,
        schedule=schedule,
    )
    elapsed = time.perf_counter() - started
    lat = np.array(tally.latencies_us) if tally.latencies_us else np.zeros(1)
    sent = schedule.sent if schedule else 0
    late = schedule.late if schedule else 0
    late_share = late / sent if sent else 0.0
    bound_q = min(100.0, 99 + 100 * late_share)
    return {
        "duration_us": int(elapsed * 1e6),
        "requests": len(tally.latencies_us),
        "bytes": tally.bytes,
        "errors": tally.errors,
        "statuses": tally.statuses,
        "latency_us": {
            "min": float(lat.min()),
            "max": float(lat.max()),
            "mean": float(lat.mean()),
            "stdev": float(lat.std()),
            "quantiles": {str(q): float(np.percentile(lat, q)) for q in QUANTILES},
            "p99_bound_quantile": bound_q,
            "p99_bound": float(np.percentile(lat, bound_q)),
        },
        "open": {
            "thread_rate": rate,
            "sent": sent,
            "late": late,
            "max_lag_us": schedule.max_lag_us if schedule else 0.0,
        },
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(
            "usage: python -m mmserver.commands.loadtest.pyload URL DURATION_S CONNECTIONS",
            file=sys.stderr,
        )
        return 2
    import uvloop

    result = uvloop.run(run(argv[0], float(argv[1]), int(argv[2])))
    print("BENCH_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
