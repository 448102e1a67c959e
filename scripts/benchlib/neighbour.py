"""The neighbour section: light models served alone, and beside a heavy model saturated by its
own clients.

Three loads, alternated in each run (the order rotates from run to run): the light models alone
(``light_connections`` connections spread evenly over ``light_models`` reference models), the
same beside the heavy forest (a second wrk keeps ``heavy_connections`` connections busy on it,
started first and stopped after), and the heavy forest alone. The light models' latency and
throughput beside the heavy one are compared with theirs alone, in the same run.
"""

from __future__ import annotations

import time
from typing import Any

from benchlib import servers, wrk
from benchlib.client import Client
from benchlib.loads import Log, Settings, describe_run
from benchlib.servers import Server
from benchlib.store import HEAVY_FEATURES, HEAVY_MODEL

LIGHT_MODELS = 100
LIGHT_CONNECTIONS = 8
HEAVY_CONNECTIONS = 8
HEAVY_BODY = "[[" + ", ".join(["0.25"] * HEAVY_FEATURES) + "]]"
#: How long the heavy load runs before the light one starts (it saturates the backends by then).
HEAVY_LEAD_S = 1.0

CASES = ("light alone", "light beside heavy", "heavy alone")


def _light(server: Server, settings: Settings, run: int) -> wrk.Load:
    return wrk.Load(
        url=server.url,
        pattern="uniform",
        models=LIGHT_MODELS,
        duration_s=settings.duration_s,
        connections=LIGHT_CONNECTIONS,
        threads=1,
        api=settings.api,
        seed=run + 1,
    )


def _heavy(server: Server, settings: Settings, duration_s: float) -> wrk.Load:
    return wrk.Load(
        url=server.url,
        pattern="single",
        model=HEAVY_MODEL,
        duration_s=duration_s,
        connections=HEAVY_CONNECTIONS,
        threads=1,
        api=settings.api,
        body=HEAVY_BODY,
    )


def _warm(server: Server) -> None:
    """Load every model of the section (and let the heavy one's cost be measured)."""
    client = Client(server.port)
    try:
        for i in range(LIGHT_MODELS):
            client.predict(f"sklearn-{i}")
        for _ in range(5):
            status, _ = client.predict(HEAVY_MODEL, HEAVY_BODY.encode())
            if status != 200:
                raise RuntimeError(f"{HEAVY_MODEL} answered {status}")
    finally:
        client.close()


def run(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """Every case ``settings.runs`` times; wrk results by case (and the heavy model's
    throughput while beside the light ones)."""
    _warm(server)
    out: dict[str, Any] = {case: [] for case in CASES}
    out["heavy beside light"] = []
    for r in range(settings.runs):
        log(f"neighbour, run {r + 1}/{settings.runs}")
        order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
        for case in order:
            servers.wait_quiet(settings.quiet_wait_s)
            if case == "light alone":
                load = _light(server, settings, r)
                result = wrk.run(load, server.pid)
            elif case == "heavy alone":
                load = _heavy(server, settings, settings.duration_s)
                result = wrk.run(load, server.pid)
            else:
                heavy = _heavy(server, settings, settings.duration_s + 2 * HEAVY_LEAD_S)
                beside = wrk.start(heavy)
                time.sleep(HEAVY_LEAD_S)
                load = _light(server, settings, r)
                result = wrk.run(load, server.pid)
                heavy_result = wrk.finish(beside, heavy)
                out["heavy beside light"].append(heavy_result.to_json())
                log(describe_run("heavy", heavy, heavy_result))
            out[case].append(result.to_json())
            log(describe_run(case.split()[0], load, result) + f"  ({case})")
    return out
