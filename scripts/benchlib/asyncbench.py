"""The async section (``--only async``): asynchronous requests beside the reference real-time
load, on a server of its own (with a ``state_dir``).

The real-time load is the neighbour section's light one: wrk, one thread, 8 connections spread
evenly over ``sklearn-0`` … ``sklearn-99``. It runs twice per run: alone, and while
``--async-requests`` asynchronous requests (inputs in a local folder, one small JSON body per
model) are sent over the same 100 models by :data:`SENDERS` threads and answered into the
output folder. Measured: the asynchronous requests accepted per second (the 202s), answered per
second (from the first accept to the last output), the time from each one's 202 to its output
file (p50, p99), and the real-time p99 alone and beside them; then a fifth as many asynchronous
requests alone, for the CPU the frontend and the backends spend per request. Then one CSV input of
``--async-large-mb`` MiB through one model: its time and the growth of the frontend's resident
set meanwhile. Targets: the real-time p99 beside the asynchronous load at most 1.5 x alone, and
at most 20 ms; the frontend's growth with the large input at most 64 MiB.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from proctools import proc_kb

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run
from mmserver.loadtest import cpu, wrk
from mmserver.loadtest.client import Client

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


class _Sender:
    """Sends ``count`` asynchronous requests from :data:`SENDERS` threads; each one's id and
    the time its 202 came back."""

    def __init__(self, server: servers.Server, inputs: Path, count: int, prefix: str) -> None:
        self.server = server
        self.inputs = inputs
        self.count = count
        self.prefix = prefix
        self.accepted: dict[str, float] = {}
        self.refused: dict[int, int] = {}
        self.started = self.ended = 0.0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(SENDERS)
        ]

    def start(self) -> _Sender:
        self.started = time.time()
        for thread in self._threads:
            thread.start()
        return self

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self.ended = time.time()

    def _send(self, sender: int) -> None:
        client = Client(self.server.port)
        try:
            for n in range(sender, self.count, SENDERS):
                model = f"sklearn-{n % MODELS}"
                inference_id = f"{self.prefix}-{n}"
                status, _, _ = client.request(
                    "POST",
                    f"/endpoints/{model}/async-invocations",
                    None,
                    {
                        "X-Amzn-SageMaker-InputLocation": (self.inputs / f"{model}.json").as_uri(),
                        "X-Amzn-SageMaker-Content-Type": "application/json",
                        "X-Amzn-SageMaker-Inference-Id": inference_id,
                    },
                )
                with self._lock:
                    if status == 202:
                        self.accepted[inference_id] = time.time()
                    else:
                        self.refused[status] = self.refused.get(status, 0) + 1
        finally:
            client.close()


def _alone(
    server: servers.Server, inputs: Path, outputs: Path, count: int, prefix: str
) -> dict[str, Any]:
    """``count`` asynchronous requests with no real-time load: the CPU the frontend process
    and the backend processes spent per answered request, from the first send to the last
    answer (what an asynchronous request costs the real-time requests it runs beside)."""
    done_before = _done(server)
    before = cpu.tree_cpu(server.pid)
    sender = _Sender(server, inputs, count, prefix).start()
    sender.join()
    give_up = time.time() + ANSWER_LIMIT_S
    while _done(server) - done_before < len(sender.accepted) and time.time() < give_up:
        time.sleep(0.05)
    after = cpu.tree_cpu(server.pid)
    answered = sum(1 for i in sender.accepted if (outputs / f"{i}.out").exists())
    used = cpu.cpu_percent(server.pid, before, after, 1.0)
    return {
        "alone_answered": answered,
        "alone_frontend_us": 1e4 * used["main"] / max(1, answered),
        "alone_backends_us": 1e4 * used["children"] / max(1, answered),
    }


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
    inputs = tmp / "async-inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    for i in range(MODELS):
        (inputs / f"sklearn-{i}.json").write_text(json.dumps([[0.5 + i / 100]]))
    outputs = tmp / "async-outputs"
    server = servers.mmserver(
        model_store,
        tmp / "async-cache",
        out / "async-server.log",
        [
            *extra,
            "--state-dir",
            str(tmp / "async-state"),
            "--async-output-path",
            str(outputs),
            "--async-input-roots",
            str(inputs),
            "--async-max-queued",
            str(requests + 1000),
        ],
        exe,
    )
    runs: list[dict[str, Any]] = []
    with server:
        log(f"async section: mmserver pid {server.pid} on {server.url}")
        client = Client(server.port)
        try:
            for i in range(MODELS):
                client.predict(f"sklearn-{i}")
        finally:
            client.close()
        for r in range(settings.runs):
            load = _light(server, settings, r)
            alone = wrk.run(load, server.pid, settings.quiet_wait_s)
            log(describe_run(f"async run {r + 1}: real time alone", load, alone))
            done_before = _done(server)
            sender = _Sender(server, inputs, requests, f"run{r}")
            proc = wrk.start(load)
            sender.start()
            beside = wrk.finish(proc, load)
            sender.join()
            log(describe_run(f"async run {r + 1}: real time beside async", load, beside))
            give_up = time.time() + ANSWER_LIMIT_S
            while _done(server) - done_before < len(sender.accepted) and time.time() < give_up:
                time.sleep(0.2)
            latencies = []
            last = sender.started
            for inference_id, accepted in sender.accepted.items():
                path = outputs / f"{inference_id}.out"
                if path.exists():
                    written = path.stat().st_mtime
                    latencies.append(written - accepted)
                    last = max(last, written)
            result = {
                "alone": alone.to_json(),
                "beside": beside.to_json(),
                "sent": requests,
                "accepted": len(sender.accepted),
                "refused": sender.refused,
                "answered": len(latencies),
                "accept_rps": len(sender.accepted) / max(1e-9, sender.ended - sender.started),
                "answer_rps": len(latencies) / max(1e-9, last - sender.started),
                "p50_s": _quantile(latencies, 0.50),
                "p99_s": _quantile(latencies, 0.99),
            }
            result.update(_alone(server, inputs, outputs, max(100, requests // 5), f"alone{r}"))
            runs.append(result)
            log(
                f"async run {r + 1}: {result['accepted']} accepted at "
                f"{result['accept_rps']:.0f}/s, {result['answered']} answered at "
                f"{result['answer_rps']:.0f}/s; accept to output p50 "
                f"{result['p50_s'] or 0:.2f} s, p99 {result['p99_s'] or 0:.2f} s"
            )
        large = large_input(server, inputs, large_mb, log) if large_mb else None
    return {"runs": runs, "large": large}


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def summary_lines(raw: dict[str, Any]) -> list[str]:
    """The section's lines of the table (medians over the runs) and its two targets."""
    runs = raw["runs"]
    alone = _median([r["alone"]["p99_ms"] for r in runs])
    beside = _median([r["beside"]["p99_ms"] for r in runs])

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "",
        f"async (local folder; {runs[0]['sent'] if runs else 0} requests over {MODELS} models "
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
        lines.append(
            f"  alone ({runs[0]['alone_answered']} requests, no real-time load): CPU per "
            f"request, frontend {fmt(_median([r['alone_frontend_us'] for r in runs]), '.0f')} us, "
            f"backends {fmt(_median([r['alone_backends_us'] for r in runs]), '.0f')} us"
        )
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
    if alone is not None and beside is not None:
        ratio = beside / alone if alone else float("inf")
        lines.append(
            f"  {'PASS' if ratio <= 1.5 else 'MISS'}  real-time p99 beside async <= 1.5 x "
            f"alone ({ratio:.2f} x)"
        )
        lines.append(f"  {'PASS' if beside <= 20 else 'MISS'}  real-time p99 beside async <= 20 ms")
    return lines
