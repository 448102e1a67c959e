"""The async section (``--only async``): asynchronous requests beside the reference real-time
load, on a server of its own (with a ``state_dir``), once with inputs and outputs in local
folders and once on the S3 test server (moto in server mode, a process of its own on loopback).

The real-time load is the neighbour section's light one: wrk, one thread, 8 connections spread
evenly over ``sklearn-0`` … ``sklearn-99``. It runs twice per run: alone, and while
``--async-requests`` asynchronous requests (one small JSON input per model) are sent over the
same 100 models from :data:`SENDERS` connections and answered into the output location.
Measured: the asynchronous requests accepted per second (the 202s), answered per second (from
the first send to the last end), the time from each one's acceptance to its end as the server's
state call tells them (p50, p99), and the real-time p99 alone and beside them; then a fifth as many
asynchronous requests alone, for the CPU the frontend and the backends (and the S3 server)
spend per request. Then, in local folders, one CSV input of ``--async-large-mb`` MiB through
one model: its time and the growth of the frontend's resident set meanwhile. Targets: the
real-time p99 beside the asynchronous load at most 1.5 x alone, and at most 20 ms; the
frontend's growth with the large input at most 64 MiB.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from proctools import HOST, proc_kb

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run
from mmserver.commands.loadtest import cpu, users, wrk
from mmserver.commands.loadtest.client import Client
from tests.integration.s3server import S3Server, s3_server

MODELS = 100
CONNECTIONS = 8
SENDERS = 4
#: Seconds the answers of every request may take after the last one was sent.
ANSWER_LIMIT_S = 600.0


def _light(server: servers.Server, settings: Settings, run: int) -> wrk.Load:
    return wrk.Load(
        url=server.url,
        pattern="uniform",
        models=MODELS,
        duration_s=settings.duration_s,
        connections=CONNECTIONS,
        threads=1,
        seed=run + 1,
    )


#: The bucket of the S3 variant's inputs and outputs.
BUCKET = "bench-async"


@dataclass
class _Place:
    """Where one variant's inputs come from and its answers go."""

    name: str
    #: The input location of a model's request.
    input_of: Callable[[str], str]
    #: The server's options that say where inputs may come from and answers go.
    server_args: list[str]
    env: dict[str, str] | None = None
    #: The S3 server's process (its CPU is counted), if any.
    s3: S3Server | None = None
    #: The local folder inputs may come from, if any.
    folder: Path | None = None


def _local(tmp: Path) -> _Place:
    inputs = tmp / "async-inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    for i in range(MODELS):
        (inputs / f"sklearn-{i}.json").write_text(_body(i))
    return _Place(
        "local folder",
        lambda model: (inputs / f"{model}.json").as_uri(),
        ["--async-output-path", str(tmp / "async-outputs"), "--async-input-roots", str(inputs)],
        folder=inputs,
    )


@contextmanager
def _on_s3(tmp: Path) -> Iterator[_Place]:
    home = tmp / "aws-home"
    home.mkdir(parents=True, exist_ok=True)
    with s3_server(nice=19) as s3:
        client = s3.client()
        client.create_bucket(Bucket=BUCKET)
        for i in range(MODELS):
            client.put_object(Bucket=BUCKET, Key=f"in/sklearn-{i}.json", Body=_body(i).encode())
        yield _Place(
            "S3 test server",
            lambda model: f"s3://{BUCKET}/in/{model}.json",
            ["--async-output-path", f"s3://{BUCKET}/out"],
            s3.environment(str(home)),
            s3,
        )


def _body(model: int) -> str:
    return json.dumps([[0.5 + model / 100]])


class _Sender:
    """Sends ``count`` asynchronous requests from :data:`SENDERS` connections (the package's
    closed-loop users, on an event loop in a thread of their own); each one's id and the time
    its 202 came back."""

    def __init__(self, server: servers.Server, place: _Place, count: int, prefix: str) -> None:
        self.server = server
        self.place = place
        self.count = count
        self.prefix = prefix
        self.accepted: dict[str, float] = {}
        self.refused: dict[int, int] = {}
        self.started = self.ended = 0.0
        self._thread = threading.Thread(target=self._send, name="async-sender", daemon=True)

    def start(self) -> _Sender:
        self.started = time.time()
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()
        self.ended = time.time()

    def _send(self) -> None:
        numbers = iter(range(self.count))

        def next_request(rng: random.Random) -> tuple[bytes, str] | None:
            n = next(numbers, None)
            if n is None:
                return None
            model = f"sklearn-{n % MODELS}"
            inference_id = f"{self.prefix}-{n}"
            headers = {
                "X-Amzn-SageMaker-InputLocation": self.place.input_of(model),
                "X-Amzn-SageMaker-Content-Type": "application/json",
                "X-Amzn-SageMaker-Inference-Id": inference_id,
            }
            path = f"/endpoints/{model}/async-invocations"
            data = users.request("POST", path, b"", headers, host=HOST, port=self.server.port)
            return data, inference_id

        def answered(inference_id: str, outcome: users.Outcome) -> None:
            if outcome.status == 202:
                self.accepted[inference_id] = time.time()
            else:
                self.refused[outcome.status] = self.refused.get(outcome.status, 0) + 1

        uvloop.run(
            users.closed_loop(
                self.server.url,
                SENDERS,
                next_request,
                answered,
                duration_s=ANSWER_LIMIT_S,
                max_requests=self.count,
                timeout_s=30.0,
            )
        )


def _alone(server: servers.Server, place: _Place, count: int, prefix: str) -> dict[str, Any]:
    """``count`` asynchronous requests with no real-time load: the CPU the frontend process
    and the backend processes (and the S3 server) spent per answered request, from the first
    send to the last answer (what an asynchronous request costs the real-time requests it runs
    beside)."""
    done_before = _done(server)
    before = cpu.tree_cpu(server.pid)
    s3_before = cpu.tree_cpu(place.s3.pid) if place.s3 else {}
    sender = _Sender(server, place, count, prefix).start()
    sender.join()
    # Looked at four times a second: each look renders /metrics (~1 ms of the frontend's CPU
    # with 100 models' series), which twenty looks a second over a slow drain (the S3 test
    # server answers ~50 a second) added to each request's figure.
    _wait_ended(server, done_before, len(sender.accepted), 0.25)
    after = cpu.tree_cpu(server.pid)
    s3_after = cpu.tree_cpu(place.s3.pid) if place.s3 else {}
    answered = sum(1 for state in _ends(server, sender.accepted).values() if state[0] == "done")
    used = cpu.cpu_percent(server.pid, before, after, 1.0)
    result = {
        "alone_answered": answered,
        "alone_frontend_us": 1e4 * used["main"] / max(1, answered),
        "alone_backends_us": 1e4 * used["children"] / max(1, answered),
    }
    if place.s3:
        s3_used = sum(s3_after.values()) - sum(s3_before.values())
        result["alone_s3_us"] = 1e6 * s3_used / max(1, answered)
    return result


def _wait_ended(server: servers.Server, done_before: float, count: int, poll_s: float) -> None:
    give_up = time.time() + ANSWER_LIMIT_S
    while _done(server) - done_before < count and time.time() < give_up:
        time.sleep(poll_s)


def _ends(server: servers.Server, ids: Iterable[str]) -> dict[str, tuple[str, float, float]]:
    """Each request's state, and its acceptance and end times, as the server's state call
    tells them."""
    client = Client(server.port)
    found = {}
    try:
        for inference_id in ids:
            status, body, _ = client.request("GET", f"/async-invocations/{inference_id}")
            if status == 200:
                described = json.loads(body)
                found[inference_id] = (
                    described["Status"],
                    float(described["AcceptedAt"]),
                    float(described.get("EndedAt") or 0.0),
                )
    finally:
        client.close()
    return found


def _done(server: servers.Server) -> float:
    client = Client(server.port)
    try:
        _, text, _ = client.request("GET", "/metrics")
    finally:
        client.close()
    for line in text.decode().splitlines():
        if line.startswith('mmserver_async_requests_total{status="done"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _PeakRss:
    """The largest resident set of one process, sampled every 20 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kb = proc_kb(pid, "status", "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, proc_kb(self.pid, "status", "VmRSS"))


def large_input(server: servers.Server, inputs: Path, size_mb: int, log: Log) -> dict[str, Any]:
    """One CSV input of ``size_mb`` MiB (rows of one value) through ``sklearn-0``: its time and
    the growth of the frontend's resident set meanwhile."""
    path = inputs / "large.csv"
    block = b"".join(b"%d.%03d\n" % (i % 10, i % 1000) for i in range(1 << 17))
    with open(path, "wb") as out:
        while out.tell() < size_mb << 20:
            out.write(block)
    client = Client(server.port, timeout=60)
    try:
        before_kb = proc_kb(server.pid, "status", "VmRSS")
        started = time.time()
        with _PeakRss(server.pid) as peak:
            status, _, _ = client.request(
                "POST",
                "/endpoints/sklearn-0/async-invocations",
                None,
                {
                    "X-Amzn-SageMaker-InputLocation": path.as_uri(),
                    "X-Amzn-SageMaker-Content-Type": "text/csv",
                    "X-Amzn-SageMaker-Inference-Id": "large-input",
                    "X-Amzn-SageMaker-InvocationTimeoutSeconds": "3600",
                },
            )
            if status != 202:
                raise RuntimeError(f"the large input was answered {status}")
            while True:
                _, body, _ = client.request("GET", "/async-invocations/large-input")
                described = json.loads(body)
                if described["Status"] not in ("queued", "running"):
                    break
                time.sleep(0.2)
        seconds = time.time() - started
    finally:
        client.close()
        path.unlink(missing_ok=True)
    result = {
        "input_mb": size_mb,
        "status": described["Status"],
        "seconds": seconds,
        "rss_before_mb": before_kb / 1024,
        "rss_peak_mb": peak.peak_kb / 1024,
        "growth_mb": (peak.peak_kb - before_kb) / 1024,
    }
    log(
        f"async large input: {size_mb} MiB {described['Status']} in {seconds:.1f} s; frontend "
        f"RSS {result['rss_before_mb']:.0f} MiB before, {result['rss_peak_mb']:.0f} MiB at "
        f"most (+{result['growth_mb']:.0f} MiB)"
    )
    return result


def run(
    model_store: Path,
    tmp: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    settings: Settings,
    requests: int,
    large_mb: int,
    log: Log,
) -> dict[str, Any]:
    section = _Section(model_store, out, extra, exe, settings, requests, log)
    raw = section.variant(tmp / "local", _local(tmp / "local"), large_mb)
    with _on_s3(tmp / "s3") as place:
        raw["s3"] = section.variant(tmp / "s3", place, 0)
    return raw


@dataclass
class _Section:
    """What every place's runs share: the store, the server's options, the settings."""

    model_store: Path
    out: Path
    extra: list[str]
    exe: Path | None
    settings: Settings
    requests: int
    log: Log

    def server(self, tmp: Path, place: _Place) -> servers.Server:
        tag = "s3" if place.s3 else "local"
        return servers.mmserver(
            self.model_store,
            tmp / "async-cache",
            self.out / f"async-server-{tag}.log",
            [
                *self.extra,
                "--state-dir",
                str(tmp / "async-state"),
                "--async-max-queued",
                str(self.requests + 1000),
                *place.server_args,
            ],
            self.exe,
            env=place.env,
        )

    def variant(self, tmp: Path, place: _Place, large_mb: int) -> dict[str, Any]:
        """The runs of one place: the real-time load alone and beside the asynchronous
        requests, then a fifth as many alone; then the large input (``large_mb`` MiB; 0:
        none, or a place without a local folder)."""
        runs: list[dict[str, Any]] = []
        with self.server(tmp, place) as server:
            self.log(f"async section ({place.name}): mmserver pid {server.pid} on {server.url}")
            client = Client(server.port)
            try:
                for i in range(MODELS):
                    client.predict(f"sklearn-{i}")
            finally:
                client.close()
            for r in range(self.settings.runs):
                load = _light(server, self.settings, r)
                alone = wrk.run(load, server.pid, self.settings.quiet_wait_s)
                self.log(describe_run(f"async run {r + 1}: real time alone", load, alone))
                done_before = _done(server)
                sender = _Sender(server, place, self.requests, f"run{r}")
                proc = wrk.start(load)
                sender.start()
                beside = wrk.finish(proc, load)
                sender.join()
                self.log(describe_run(f"async run {r + 1}: real time beside async", load, beside))
                _wait_ended(server, done_before, len(sender.accepted), 0.2)
                ends = [e for e in _ends(server, sender.accepted).values() if e[0] == "done"]
                latencies = [ended - accepted for _, accepted, ended in ends]
                last = max((ended for _, _, ended in ends), default=sender.started)
                result = {
                    "place": place.name,
                    "alone": alone.to_json(),
                    "beside": beside.to_json(),
                    "sent": self.requests,
                    "accepted": len(sender.accepted),
                    "refused": sender.refused,
                    "answered": len(latencies),
                    "accept_rps": len(sender.accepted) / max(1e-9, sender.ended - sender.started),
                    "answer_rps": len(latencies) / max(1e-9, last - sender.started),
                    "p50_s": _quantile(latencies, 0.50),
                    "p99_s": _quantile(latencies, 0.99),
                }
                result.update(_alone(server, place, max(100, self.requests // 5), f"alone{r}"))
                runs.append(result)
                self.log(
                    f"async run {r + 1} ({place.name}): {result['accepted']} accepted at "
                    f"{result['accept_rps']:.0f}/s, {result['answered']} answered at "
                    f"{result['answer_rps']:.0f}/s; accept to output p50 "
                    f"{result['p50_s'] or 0:.2f} s, p99 {result['p99_s'] or 0:.2f} s"
                )
            large = None
            if large_mb and place.folder is not None:
                large = large_input(server, place.folder, large_mb, self.log)
        return {"runs": runs, "large": large}


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def summary_lines(raw: dict[str, Any]) -> list[str]:
    """The section's lines of the table (medians over the runs) and its targets, for each
    place."""
    lines = _place_lines(raw["runs"], "local folders")
    large = raw.get("large")
    if large:
        lines.append(
            f"  one {large['input_mb']} MiB CSV input: {large['status']} in "
            f"{large['seconds']:.1f} s, frontend RSS +{large['growth_mb']:.0f} MiB"
        )
        lines.append(
            f"  {'PASS' if large['growth_mb'] <= 64 else 'MISS'}  frontend growth with the "
            "large input <= 64 MiB"
        )
    if raw.get("s3"):
        lines += _place_lines(raw["s3"]["runs"], "the S3 test server")
    return lines


def _place_lines(runs: list[dict[str, Any]], place: str) -> list[str]:
    alone = _median([r["alone"]["p99_ms"] for r in runs])
    beside = _median([r["beside"]["p99_ms"] for r in runs])

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "",
        f"async ({place}; {runs[0]['sent'] if runs else 0} requests over {MODELS} models "
        f"beside wrk -t1 -c{CONNECTIONS} real time over the same models)",
        f"  accepted/s {fmt(_median([r['accept_rps'] for r in runs]), '.0f')}   "
        f"answered/s {fmt(_median([r['answer_rps'] for r in runs]), '.0f')}   "
        f"accept to output p50 {fmt(_median([r['p50_s'] for r in runs]), '.2f')} s, "
        f"p99 {fmt(_median([r['p99_s'] for r in runs]), '.2f')} s   "
        f"answered {sum(r['answered'] for r in runs)} of {sum(r['accepted'] for r in runs)}",
        f"  real-time p99 alone {fmt(alone, '.2f')} ms, beside async {fmt(beside, '.2f')} ms; "
        f"real-time req/s alone {fmt(_median([r['alone']['rps'] for r in runs]), '.0f')}, "
        f"beside {fmt(_median([r['beside']['rps'] for r in runs]), '.0f')}",
    ]
    if runs and "alone_frontend_us" in runs[0]:
        s3 = (
            f", S3 server {fmt(_median([r['alone_s3_us'] for r in runs]), '.0f')} us"
            if "alone_s3_us" in runs[0]
            else ""
        )
        lines.append(
            f"  alone ({runs[0]['alone_answered']} requests, no real-time load): CPU per "
            f"request, frontend {fmt(_median([r['alone_frontend_us'] for r in runs]), '.0f')} us, "
            f"backends {fmt(_median([r['alone_backends_us'] for r in runs]), '.0f')} us{s3}"
        )
    if alone is not None and beside is not None:
        ratio = beside / alone if alone else float("inf")
        lines.append(
            f"  {'PASS' if ratio <= 1.5 else 'MISS'}  real-time p99 beside async <= 1.5 x "
            f"alone ({ratio:.2f} x)"
        )
        lines.append(f"  {'PASS' if beside <= 20 else 'MISS'}  real-time p99 beside async <= 20 ms")
    return lines
