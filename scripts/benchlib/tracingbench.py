"""The tracing section (``--only tracing``): what OpenTelemetry traces cost the hot path, on
servers of its own over the reference store.

Three servers run side by side, configured by the standard ``OTEL_*`` variables only: one
without traces, one sampling 1 % of its requests (``parentbased_traceidratio``, ``0.01``) and
one sampling every request (``parentbased_always_on``). Both traced servers export OTLP over
HTTP to a sink in this process (:class:`Sink`: it reads each export and answers 200, as a
collector would). Each run, in an order that rotates from run to run, wrk's hot pattern
(closed loop, ``--concurrency`` connections) on each server.

Target: hot throughput at 1 % >= 0.9 x without traces; every request sampled, the cost quoted.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from statistics import median
from typing import Any

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run, rotated
from benchlib.tenantsbench import warm
from mmserver.commands.loadtest import wrk

#: The cases, and the sampler of each (``None``: no traces).
SAMPLERS: dict[str, tuple[str, str] | None] = {
    "off": None,
    "1 %": ("parentbased_traceidratio", "0.01"),
    "100 %": ("parentbased_always_on", ""),
}


class _Export(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.exports += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


class Sink:
    """An OTLP/HTTP endpoint on a free loopback port that reads each export and drops it."""

    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Export)
        self._server.exports = 0  # type: ignore[attr-defined]
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def exports(self) -> int:
        return int(self._server.exports)  # type: ignore[attr-defined]

    def __enter__(self) -> Sink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _env(sink: Sink, sampler: tuple[str, str]) -> dict[str, str]:
    name, arg = sampler
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.endpoint,
        "OTEL_SERVICE_NAME": "mmserver-bench",
        "OTEL_TRACES_SAMPLER": name,
    }
    if arg:
        env["OTEL_TRACES_SAMPLER_ARG"] = arg
    return env


def run(
    reference: Path,
    tmp: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with Sink() as sink:
        made = {
            case: servers.mmserver(
                reference,
                tmp / f"cache-{index}",
                out / f"tracing-{index}.log",
                extra,
                exe,
                env=None if sampler is None else _env(sink, sampler),
            )
            for index, (case, sampler) in enumerate(SAMPLERS.items())
        }
        with made["off"], made["1 %"], made["100 %"]:
            for case, server in made.items():
                log(f"tracing section: mmserver pid {server.pid} on {server.url} (traces {case})")
                warm(server, None)
            for r in range(settings.runs):
                result: dict[str, Any] = {}
                for case in rotated(list(SAMPLERS), r):
                    server = made[case]
                    load = wrk.Load(
                        url=server.url,
                        pattern="hot",
                        duration_s=settings.duration_s,
                        connections=settings.concurrency,
                        threads=settings.threads,
                        seed=r + 1,
                    )
                    measured = wrk.run(load, server.pid, settings.quiet_wait_s)
                    log(describe_run(f"tracing run {r + 1}: traces {case}", load, measured))
                    result[case] = measured.to_json()
                runs.append(result)
        log(f"tracing section: the sink took {sink.exports} exports")
    return {"runs": runs, "exports": sink.exports}


def summary_lines(section: dict[str, Any]) -> list[str]:
    """The section's lines of the table: medians over runs, the ratios of each run's pair."""
    runs = section["runs"]
    lines = ["", "Tracing (hot pattern; medians over runs; ratios: median of each run's pair)"]
    ratios = {}
    for case in SAMPLERS:
        ratios[case] = median(r[case]["rps"] / r["off"]["rps"] for r in runs)
        rps = median(r[case]["rps"] for r in runs)
        p99 = median(r[case]["p99_ms"] for r in runs)
        errors = sum(sum(r[case].get("errors", {}).values()) for r in runs)
        lines.append(
            f"  traces {case:6s} {rps:8.0f} req/s  {ratios[case]:.2f} x off  p99 {p99:7.2f} ms"
            f"  errors {errors}"
        )
    one = ratios["1 %"]
    lines.append(
        f"  {'PASS' if one >= 0.9 else 'FAIL'}  hot req/s at 1 % >= 0.9 x off: {one:.2f} x"
    )
    lines.append(f"  every request sampled: {ratios['100 %']:.2f} x off")
    return lines
