"""Sections measured with one sequential client (cold start, memory), and every model loaded
by a few clients at once.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import uvloop
from proctools import HOST, tree_memory

from benchlib.servers import Server
from mmserver.commands.loadtest import users
from mmserver.commands.loadtest.client import BODY, JSON_HEADERS, Client

WARM_MODEL = "sklearn-0"
#: What loading every model may take.
LOAD_ALL_LIMIT_S = 600.0


def cold_start(server: Server, models: list[str]) -> dict[str, Any]:
    """The first request to each of ``models`` (unloaded) versus a request to a warm model.

    One request at a time: warm up ``WARM_MODEL``, then for each cold model its first request
    followed by one to the warm model, so both are measured under the same conditions.
    """
    client = Client(server.port)
    try:
        for _ in range(20):
            client.predict(WARM_MODEL)
        cold, warm, errors = [], [], 0
        for model in models:
            status, seconds = client.predict(model)
            if status == 200:
                cold.append(seconds * 1e3)
            else:
                errors += 1
            status, seconds = client.predict(WARM_MODEL)
            if status == 200:
                warm.append(seconds * 1e3)
            else:
                errors += 1
    finally:
        client.close()
    cold_median = statistics.median(cold) if cold else None
    warm_median = statistics.median(warm) if warm else None
    return {
        "models": models,
        "cold_ms": cold,
        "warm_ms": warm,
        "cold_median_ms": cold_median,
        "warm_median_ms": warm_median,
        "extra_ms": None
        if cold_median is None or warm_median is None
        else cold_median - warm_median,
        "errors": errors,
    }


def load_all(server: Server, count: int, parallel: int = 4) -> dict[str, Any]:
    """Request each of ``sklearn-0 .. sklearn-(count-1)`` once, ``parallel`` at a time (the
    package's closed-loop users, one connection each)."""
    names = iter(f"sklearn-{i}" for i in range(count))
    statuses: dict[str, int] = {}
    failed: list[str] = []

    def next_request(rng: random.Random) -> tuple[bytes, str] | None:
        name = next(names, None)
        if name is None:
            return None
        path = f"/predictions/{name}"
        return users.request("POST", path, BODY, JSON_HEADERS, host=HOST, port=server.port), name

    def answered(name: str, outcome: users.Outcome) -> None:
        if outcome.error:
            failed.append(f"{name}: {outcome.error}")
        else:
            statuses[str(outcome.status)] = statuses.get(str(outcome.status), 0) + 1

    start = time.perf_counter()
    uvloop.run(
        users.closed_loop(
            server.url,
            parallel,
            next_request,
            answered,
            duration_s=LOAD_ALL_LIMIT_S,
            max_requests=count,
            timeout_s=30.0,
        )
    )
    elapsed = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"loading every model failed ({len(failed)}), e.g. {failed[:3]}")
    return {"models": count, "seconds": elapsed, "statuses": statuses}


def memory(server: Server, samples: int = 3) -> dict[str, Any]:
    """Resident memory of the server's process tree, the median of ``samples`` readings."""
    readings: list[dict[str, Any]] = []
    for i in range(samples):
        if i:
            time.sleep(0.5)
        procs = tree_memory(server.pid)
        readings.append(
            {
                "rss_mb": sum(p.rss_kb for p in procs) * 1024 / 1e6,
                "pss_mb": sum(p.pss_kb for p in procs) * 1024 / 1e6,
                "processes": [p.__dict__ for p in procs],
            }
        )
    return {
        "rss_mb": statistics.median(float(r["rss_mb"]) for r in readings),
        "pss_mb": statistics.median(float(r["pss_mb"]) for r in readings),
        "processes": readings[-1]["processes"],
    }


def scrape(server: Server) -> dict[str, Any]:
    """One ``GET /metrics``: its time and size (a scrape must stay cheap with 1,000 models),
    and the models loaded now and loads so far as it says."""
    client = Client(server.port)
    try:
        status, body, seconds = client.request("GET", "/metrics")
    finally:
        client.close()
    values: dict[str, float | None] = dict.fromkeys(_SCRAPED.values())
    for line in body.decode(errors="replace").splitlines():
        key = _SCRAPED.get(line.split(" ", 1)[0])
        if key is not None:
            values[key] = float(line.split()[1])
    return {"status": status, "ms": seconds * 1e3, "bytes": len(body), **values}


#: The server-wide samples :func:`scrape` reads, by the key it returns them under.
_SCRAPED = {
    "mmserver_models_loaded": "models_loaded",
    "mmserver_model_loads_total": "model_loads",
}
