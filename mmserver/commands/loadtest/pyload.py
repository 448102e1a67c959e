"""The load of :mod:`mmserver.commands.loadtest.wrk` from one Python process, where wrk is not
installed.

``python -m mmserver.commands.loadtest.pyload URL DURATION_S CONNECTIONS`` takes the same
``BENCH_*`` environment as ``load.lua`` (pattern, API, body, open-loop rate) and prints the same
``BENCH_JSON`` line, so :func:`mmserver.commands.loadtest.wrk.parse` reads either. One asyncio loop
on uvloop keeps ``CONNECTIONS`` keep-alive HTTP/1.1 connections busy (closed loop), or hands them
send slots ``1 / rate`` apart (open loop: ``BENCH_THREAD_RATE`` times ``BENCH_THREADS`` in all),
counting the sends more than 1 ms after their slot as ``load.lua`` does. A request is timed from
its write to the end of its answer, as wrk times it.

One process: it costs more CPU a request than wrk (on 2 cores, about 35 % of a core against
wrk's 13 % for the same 5,000 requests per second) and never more than one core, taken from the
server on a small machine.
"""

from __future__ import annotations

import asyncio
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

TIMEOUT_S = 5.0
QUANTILES = (50, 75, 90, 99, 99.9)


@dataclass
class _Tally:
    latencies_us: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("connect", "read", "write", "status", "timeout"), 0)
    )
    bytes: int = 0
    sent: int = 0
    late: int = 0
    max_lag_us: float = 0.0


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
        headers = {"Host": f"{host}:{port}", "Content-Type": "application/json"}
        if api == "sagemaker":
            path = "/invocations"
            headers["X-Amzn-SageMaker-Target-Model"] = name + ".tar.gz"
        elif api in ("v2", "mlserver"):
            path = f"/v2/models/{name}/infer"
        else:
            path = f"/predictions/{name}"
        headers["Content-Length"] = str(len(body))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + body

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


async def _answer(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read one answer; (status, bytes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, chunked = 0, False
    for line in lines[1:]:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "content-length":
            length = int(value)
        elif key == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    size = len(head)
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            chunk = int(size_line.split(b";")[0], 16)
            await reader.readexactly(chunk + 2)
            size += len(size_line) + chunk + 2
            if chunk == 0:
                break
    elif length:
        await reader.readexactly(length)
        size += length
    return status, size


class _Schedule:
    """Send slots ``interval`` apart, handed to whichever connection asks next."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next_slot: float | None = None

    def take(self, now: float, tally: _Tally) -> float:
        """Seconds to wait for the next slot (0 when late; a send over 1 ms late counts)."""
        if not self.interval:
            return 0.0
        if self.next_slot is None:
            self.next_slot = now
        slot = self.next_slot
        self.next_slot = slot + self.interval
        tally.sent += 1
        wait = slot - now
        if wait >= 0:
            return wait
        lag_us = -wait * 1e6
        if lag_us > 1000:
            tally.late += 1
        tally.max_lag_us = max(tally.max_lag_us, lag_us)
        return 0.0


async def _connection(
    host: str,
    port: int,
    end: float,
    requests: list[bytes],
    pick: Callable[[random.Random], int],
    rng: random.Random,
    schedule: _Schedule,
    tally: _Tally,
) -> None:
    loop = asyncio.get_running_loop()
    writer: asyncio.StreamWriter | None = None
    try:
        while loop.time() < end:
            if writer is None:
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                except OSError:
                    tally.errors["connect"] += 1
                    await asyncio.sleep(0.01)
                    continue
            wait = schedule.take(loop.time(), tally)
            if wait:
                await asyncio.sleep(wait)
                if loop.time() >= end:
                    break
            started = time.perf_counter()
            try:
                writer.write(requests[pick(rng)])
                status, size = await asyncio.wait_for(_answer(reader), TIMEOUT_S)
            except TimeoutError:
                tally.errors["timeout"] += 1
                writer.close()
                writer = None
                continue
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                tally.errors["read"] += 1
                writer.close()
                writer = None
                continue
            tally.latencies_us.append((time.perf_counter() - started) * 1e6)
            tally.bytes += size
            if not 200 <= status <= 299:
                tally.statuses[str(status)] = tally.statuses.get(str(status), 0) + 1
                tally.errors["status"] += 1
    finally:
        if writer is not None:
            writer.close()


async def run(url: str, duration_s: float, connections: int) -> dict[str, object]:
    """Generate the load; the ``BENCH_JSON`` object ``load.lua`` prints."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    requests, pick = _requests(host, port)
    rate = float(os.environ.get("BENCH_THREAD_RATE", "0") or 0) * int(
        os.environ.get("BENCH_THREADS", "1")
    )
    seed = int(os.environ.get("BENCH_SEED", "1"))
    tally, schedule = _Tally(), _Schedule(rate)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    end = loop.time() + duration_s
    await asyncio.gather(
        *(
            _connection(
                host, port, end, requests, pick, random.Random(seed * 7919 + i), schedule, tally
            )
            for i in range(connections)
        )
    )
    elapsed = time.perf_counter() - started
    lat = np.array(tally.latencies_us) if tally.latencies_us else np.zeros(1)
    late_share = tally.late / tally.sent if tally.sent else 0.0
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
            "sent": tally.sent,
            "late": tally.late,
            "max_lag_us": tally.max_lag_us,
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
