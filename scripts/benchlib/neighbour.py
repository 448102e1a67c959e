"""The neighbour section: light models served alone, beside a heavy model saturated by its own
clients, beside a flood of large requests, and beside a stream of cold loads.

Four loads, alternated in each run (the order rotates from run to run): the light models alone
(``light_connections`` connections spread evenly over ``light_models`` reference models), the
same beside the heavy forest (a second wrk keeps ``heavy_connections`` connections busy on it,
started first and stopped after), the heavy forest alone, and the light models beside cold
loads (:data:`LOAD_CLIENTS` connections requesting the store's other models, each once, then
unloading them with ``DELETE /models/{name}`` and starting over, until the light load ends), and
the light models beside :data:`IDLE_LOOP`, a busy loop at idle CPU priority outside the server:
what any busy neighbour costs them on this machine, however the server schedules. The light
models' latency and throughput beside each neighbour are compared with theirs alone, in the
same run, and so are the heavy model's beside the light models with its own alone: every model
gets a floor, not only the light ones (issue 34).

Beside the large requests: :data:`LARGE_CONNECTIONS` connections in a closed loop send
:data:`LARGE_ROWS`-row bodies to :data:`~benchlib.store.LARGE_MODEL`, a forest cheap for one
row and costly for a thousand, from a second before the light load to a second after (a
customer whose requests are all large, issue 49). The case also counts the lane moves of every
model while it runs, from the server's log, and reads the large model's lane and cost from
``GET /models/NAME`` after it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

from benchlib import scale
from benchlib.loads import Log, Settings, describe_run, rotated
from benchlib.servers import Server
from benchlib.store import HEAVY_FEATURES, HEAVY_MODEL, LARGE_MODEL
from mmserver.commands.loadtest import cpu, wrk
from mmserver.commands.loadtest.client import Client

LIGHT_MODELS = 100
LIGHT_CONNECTIONS = 8
HEAVY_CONNECTIONS = 8
HEAVY_BODY = "[[" + ", ".join(["0.25"] * HEAVY_FEATURES) + "]]"
#: How long the heavy load runs before the light one starts (it saturates the backends by then).
HEAVY_LEAD_S = 1.0

#: The large requests: closed-loop connections, the rows of each request, and the body (rows of
#: values that vary, as real ones do).
LARGE_CONNECTIONS = 4
LARGE_ROWS = 1000
LARGE_BODY = (
    "["
    + ", ".join(
        "["
        + ", ".join(f"{((i * 37 + j * 11) % 200) / 100 - 1:.2f}" for j in range(HEAVY_FEATURES))
        + "]"
        for i in range(LARGE_ROWS)
    )
    + "]"
)
#: The key of the large-request case's lane moves and the large model's state in the results.
LANE_MOVES = "lane moves beside large requests"
#: A lane move in the server's log (text or JSON lines alike).
_MOVE = re.compile(r"model (\S+): moves to the (\w+) lane")

#: Connections loading cold models beside the light ones, and the models they load (the
#: reference store's models the light load does not use).
LOAD_CLIENTS = 16
COLD_MODELS = [f"sklearn-{i}" for i in range(LIGHT_MODELS, 1000)]

#: The key of the cold loads' own figures in the section's results.
COLD_LOADS = "cold loads beside light"

#: The machine's own floor for the light models beside a busy neighbour: a Python busy loop
#: (no memory traffic) at the lowest CPU priority Linux has, SCHED_IDLE, outside the server.
IDLE_LOOP = (
    "import os\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True:\n    pass\n"
)

CASES = (
    "light alone",
    "light beside heavy",
    "heavy alone",
    "light beside large requests",
    "light beside loads",
    "light beside idle loop",
)


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


def _one_model(
    server: Server, settings: Settings, duration_s: float, model: str, connections: int, body: str
) -> wrk.Load:
    """Closed-loop requests of ``body`` on ``model`` alone: the heavy forest, or the large
    requests' flood."""
    return wrk.Load(
        url=server.url,
        pattern="single",
        model=model,
        duration_s=duration_s,
        connections=connections,
        threads=1,
        api=settings.api,
        body=body,
    )


def _heavy(server: Server, settings: Settings, duration_s: float) -> wrk.Load:
    return _one_model(server, settings, duration_s, HEAVY_MODEL, HEAVY_CONNECTIONS, HEAVY_BODY)


def _large(server: Server, settings: Settings, duration_s: float) -> wrk.Load:
    return _one_model(server, settings, duration_s, LARGE_MODEL, LARGE_CONNECTIONS, LARGE_BODY)


def _warm(server: Server) -> None:
    """Load every model of the section (and let the costly ones' cost be measured)."""
    client = Client(server.port)
    try:
        for i in range(LIGHT_MODELS):
            client.predict(f"sklearn-{i}")
        for model, body in ((HEAVY_MODEL, HEAVY_BODY), (LARGE_MODEL, LARGE_BODY)):
            for _ in range(5):
                status, _ = client.predict(model, body.encode())
                if status != 200:
                    raise RuntimeError(f"{model} answered {status}")
    finally:
        client.close()


def _log_size(server: Server) -> int:
    return server.log_path.stat().st_size if server.log_path.exists() else 0


def _lane_moves(server: Server, offset: int) -> dict[str, int]:
    """The lane moves the server logged past ``offset``, by model."""
    moves: dict[str, int] = {}
    with server.log_path.open("rb") as log:
        log.seek(offset)
        for line in log.read().decode(errors="replace").splitlines():
            found = _MOVE.search(line)
            if found:
                moves[found.group(1)] = moves.get(found.group(1), 0) + 1
    return moves


def _large_state(server: Server) -> dict[str, Any]:
    """The large model's lane, the CPU one of its requests takes (``None`` from a server that
    does not say) and its rows per request, from ``GET /models/NAME``."""
    client = Client(server.port)
    try:
        described = client.describe(LARGE_MODEL) or {}
    finally:
        client.close()
    return {
        "lane": described.get("lane"),
        "request_ms": described.get("costPerRequestMillis"),
        "rows_per_request": described.get("rowsPerRequest"),
    }


class _ColdLoads:
    """Cold loads of :data:`COLD_MODELS` from :data:`LOAD_CLIENTS` connections in a thread, each
    model once, then all of them unloaded, over and over until :meth:`stop`."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loads = 0
        self.errors = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cold-loads", daemon=True)

    def start(self) -> _ColdLoads:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(scale.COLD_TIMEOUT_S + 60)
        rate = self.loads / self.seconds if self.seconds else 0.0
        return {"loads": self.loads, "loads_per_s": rate, "errors": self.errors}

    def _run(self) -> None:
        client = Client(self.server.port)
        try:
            while not self._stop.is_set():
                for name in COLD_MODELS:  # loaded by an earlier round or section
                    client.request("DELETE", f"/models/{name}")
                result = scale.cold_loads(self.server, COLD_MODELS, LOAD_CLIENTS)
                self.loads += result["models"]
                self.seconds += result["seconds"]
                self.errors += sum(n for code, n in result["statuses"].items() if code != "200")
        finally:
            client.close()


def run(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """Every case ``settings.runs`` times; wrk results by case (and the heavy model's
    throughput while beside the light ones)."""
    _warm(server)
    out: dict[str, Any] = {case: [] for case in CASES}
    out["heavy beside light"] = []
    out["large beside light"] = []
    out[LANE_MOVES] = []
    out[COLD_LOADS] = []
    for r in range(settings.runs):
        log(f"neighbour, run {r + 1}/{settings.runs}")
        for case in rotated(CASES, r):
            cpu.wait_quiet(settings.quiet_wait_s)
            if case == "light alone":
                load = _light(server, settings, r)
                result = wrk.run(load, server.pid)
            elif case == "heavy alone":
                load = _heavy(server, settings, settings.duration_s)
                result = wrk.run(load, server.pid)
            elif case == "light beside idle loop":
                loop = subprocess.Popen([sys.executable, "-c", IDLE_LOOP])
                try:
                    time.sleep(HEAVY_LEAD_S)
                    load = _light(server, settings, r)
                    result = wrk.run(load, server.pid)
                finally:
                    loop.kill()
                    loop.wait()
            elif case == "light beside large requests":
                offset, started = _log_size(server), time.monotonic()
                large = _large(server, settings, settings.duration_s + 2 * HEAVY_LEAD_S)
                beside = wrk.start(large)
                time.sleep(HEAVY_LEAD_S)
                load = _light(server, settings, r)
                result = wrk.run(load, server.pid)
                large_result = wrk.finish(beside, large)
                moves = {
                    "seconds": time.monotonic() - started,
                    "moves": _lane_moves(server, offset),
                    **_large_state(server),
                }
                out["large beside light"].append(large_result.to_json())
                out[LANE_MOVES].append(moves)
                log(describe_run("large", large, large_result))
                log(
                    f"  lane moves: {moves['moves'] or 'none'} in {moves['seconds']:.0f} s; "
                    f"{LARGE_MODEL} in the {moves['lane']} lane, a request "
                    f"{moves['request_ms']} ms of CPU at {moves['rows_per_request']} rows"
                )
            elif case == "light beside loads":
                cold = _ColdLoads(server).start()
                load = _light(server, settings, r)
                result = wrk.run(load, server.pid)
                loads = cold.stop()
                out[COLD_LOADS].append(loads)
                log(f"  cold loads beside: {loads['loads']} at {loads['loads_per_s']:.0f}/s")
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
