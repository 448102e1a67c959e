"""A small blocking HTTP client: one request at a time on a kept-alive loopback connection.

Used where one sequential client is the point (cold start, the 50 ms worker-count poller,
management calls), never to generate load: :mod:`mmserver.commands.loadtest.wrk` and
:mod:`mmserver.commands.loadtest.users` do that.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mmserver.commands.procfs import HOST

BODY = b"[[0.5]]"
JSON_HEADERS = {"Content-Type": "application/json"}


class Client:
    """Requests to ``host:port`` (``127.0.0.1`` unless given), reconnecting when the server
    closes the connection."""

    def __init__(self, port: int, timeout: float = 30.0, host: str = HOST) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes, float]:
        """(status, body, seconds from sending to the whole answer read)."""
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            start = time.perf_counter()
            try:
                self._conn.request(method, path, body=body, headers=headers or {})
                response = self._conn.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt == 2:
                    raise
                continue
            return response.status, data, time.perf_counter() - start
        raise AssertionError("unreachable")

    def predict(self, model: str, body: bytes = BODY) -> tuple[int, float]:
        """(status, seconds) of ``POST /predictions/{model}``."""
        status, _, seconds = self.request("POST", f"/predictions/{model}", body, JSON_HEADERS)
        return status, seconds

    def describe(self, model: str) -> dict[str, Any] | None:
        """The model of ``GET /models/{model}`` (DJL's array of workflows, each holding its
        models), or None when it is not 200."""
        status, data, _ = self.request("GET", f"/models/{model}")
        if status != 200:
            return None
        described = json.loads(data)
        if not (isinstance(described, list) and described and described[0].get("models")):
            return None
        model_info: dict[str, Any] = described[0]["models"][0]
        return model_info

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def worker_count(described: dict[str, Any] | None) -> int:
    if not described:
        return 0
    return sum(len(group.get("workers", [])) for group in described.get("workerGroups", []))


def max_workers(described: dict[str, Any] | None) -> int:
    if not described or not described.get("workerGroups"):
        return 0
    return int(described["workerGroups"][0].get("maxWorkers", 0))


def worker_start_times(described: dict[str, Any] | None) -> list[float]:
    """Each worker's ``startTime`` as a Unix time."""
    times = []
    for group in (described or {}).get("workerGroups", []):
        for worker in group.get("workers", []):
            try:
                times.append(datetime.fromisoformat(worker["startTime"]).timestamp())
            except (KeyError, TypeError, ValueError):
                continue
    return times


@dataclass
class Sample:
    t: float  # s since the poller's t0
    workers: int
    probe_ms: float | None  # latency of one probe request to the model, None if it failed


@dataclass
class Poller:
    """Every ``interval`` s: the model's worker count (``GET /models/{model}``) and the latency
    of one probe request to it, in a background thread, until :meth:`stop` (or ``limit_s``)."""

    port: int
    model: str
    interval: float = 0.05
    limit_s: float = 600.0
    t0: float = field(default_factory=time.time)
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Poller:
        self._thread = threading.Thread(target=self._run, name="bench-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples

    def _run(self) -> None:
        client = Client(self.port, timeout=5)
        try:
            next_at = time.monotonic()
            end = next_at + self.limit_s
            while not self._stop.is_set() and time.monotonic() < end:
                t = time.time() - self.t0
                try:
                    workers = worker_count(client.describe(self.model))
                    status, seconds = client.predict(self.model)
                    probe = seconds * 1e3 if status == 200 else None
                except OSError:
                    client.close()
                    workers, probe = -1, None
                self.samples.append(Sample(round(t, 4), workers, probe))
                next_at += self.interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        finally:
            client.close()
