"""The tenants section (``--only tenants``): what tenants cost the hot path, and what a flooding
tenant costs its neighbour, on servers of its own over the reference store.

Two servers run side by side: one without tenants, one with :data:`TENANTS` (``--tenants``).
Each run, in an order that rotates from run to run:

- ``without tenants``: wrk's hot pattern (closed loop, ``--concurrency`` connections) on the
  server without tenants;
- ``with tenants``: the same on the server with tenants, every request with the bearer token
  of a tenant whose pattern is ``*`` (its token looked up, its model name matched);
- ``neighbour alone``: tenant ``beta`` alone, :data:`NEIGHBOUR_CONNECTIONS` connections on its
  model ``sklearn-1``;
- ``neighbour beside flood``: the same while tenant ``acme`` floods ``sklearn-0`` with
  :data:`FLOOD_CONNECTIONS` connections, far over its rate of :data:`FLOOD_RATE` requests per
  second (answered 429 past it).

Targets: hot throughput with tenants >= 0.9 x without; the neighbour's p99 beside the flood
<= 1.5 x alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run, rotated
from mmserver.commands.loadtest import cpu, wrk
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

CASES = ("without tenants", "with tenants", "neighbour alone", "neighbour beside flood")
FLOOD_RATE = 200
FLOOD_CONNECTIONS = 16
NEIGHBOUR_CONNECTIONS = 8
TOKENS = {"all": "tok-bench-all", "acme": "tok-bench-acme", "beta": "tok-bench-beta"}
TENANTS = f"""\
tenants:
  all:
    models: ["*"]
    tokens: ["{TOKENS["all"]}"]
  acme:
    models: ["sklearn-0"]
    tokens: ["{TOKENS["acme"]}"]
    requests_per_second: {FLOOD_RATE}
  beta:
    models: ["sklearn-1"]
    tokens: ["{TOKENS["beta"]}"]
"""


def warm(server: servers.Server, token: str | None) -> None:
    """One request to each of the store's 1,000 models (with ``token``): all of them loaded."""
    client = Client(server.port)
    headers = dict(JSON_HEADERS)
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        for i in range(1000):
            status, body, _ = client.request(
                "POST", f"/predictions/sklearn-{i}", b"[[0.5]]", headers
            )
            if status != 200:
                raise RuntimeError(f"sklearn-{i} answered {status}: {body[:200]!r}")
    finally:
        client.close()


def _load(server: servers.Server, settings: Settings, run: int, **fields: Any) -> wrk.Load:
    base: dict[str, Any] = {
        "url": server.url,
        "pattern": "hot",
        "duration_s": settings.duration_s,
        "connections": settings.concurrency,
        "threads": settings.threads,
        "seed": run + 1,
    }
    base.update(fields)
    return wrk.Load(**base)


#: The one model of each tenant the section loads.
_MODEL = {"acme": "sklearn-0", "beta": "sklearn-1"}


def _single(
    server: servers.Server,
    settings: Settings,
    run: int,
    tenant: str,
    connections: int,
    longer_s: float = 0.0,
) -> wrk.Load:
    """``tenant``'s load on its model, with its token, ``longer_s`` past the section's time."""
    return _load(
        server,
        settings,
        run,
        pattern="single",
        model=_MODEL[tenant],
        connections=connections,
        duration_s=settings.duration_s + longer_s,
        authorization=f"Bearer {TOKENS[tenant]}",
    )


def _beside_flood(load: wrk.Load, flood: wrk.Load, pid: int, quiet_s: float) -> wrk.WrkResult:
    """``load`` measured while ``flood`` runs: the machine quiet first, then the flood started,
    then ``load`` (the flood, longer, ends after it)."""
    cpu.wait_quiet(quiet_s)
    flooding = wrk.start(flood)
    try:
        return wrk.run(load, pid)
    finally:
        wrk.finish(flooding, flood)


def run(
    reference: Path,
    tmp: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    tenants_file = tmp / "tenants.yaml"
    tenants_file.write_text(TENANTS)
    plain = servers.mmserver(reference, tmp / "plain-cache", out / "tenants-plain.log", extra, exe)
    tenanted = servers.mmserver(
        reference,
        tmp / "tenants-cache",
        out / "tenants-server.log",
        [*extra, "--tenants", str(tenants_file)],
        exe,
    )
    runs: list[dict[str, Any]] = []
    with plain, tenanted:
        log(f"tenants section: mmserver pid {plain.pid} on {plain.url} (no tenants)")
        log(f"tenants section: mmserver pid {tenanted.pid} on {tenanted.url} (tenants)")
        warm(plain, None)
        warm(tenanted, TOKENS["all"])
        for r in range(settings.runs):
            result: dict[str, Any] = {}
            for case in rotated(CASES, r):
                if case == "without tenants":
                    load = _load(plain, settings, r)
                    measured = wrk.run(load, plain.pid, settings.quiet_wait_s)
                elif case == "with tenants":
                    load = _load(tenanted, settings, r, authorization=f"Bearer {TOKENS['all']}")
                    measured = wrk.run(load, tenanted.pid, settings.quiet_wait_s)
                else:
                    load = _single(tenanted, settings, r, "beta", NEIGHBOUR_CONNECTIONS)
                    if case == "neighbour alone":
                        measured = wrk.run(load, tenanted.pid, settings.quiet_wait_s)
                    else:
                        flood = _single(tenanted, settings, r, "acme", FLOOD_CONNECTIONS, 2.0)
                        measured = _beside_flood(load, flood, tenanted.pid, settings.quiet_wait_s)
                log(describe_run(f"tenants run {r + 1}: {case}", load, measured))
                result[case] = measured.to_json()
            runs.append(result)
    return {"runs": runs}


def summary_lines(section: dict[str, Any]) -> list[str]:
    """The section's lines of the table: medians over runs, the ratios of each run's pair."""
    runs = section["runs"]

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    hot = median([r["with tenants"]["rps"] / r["without tenants"]["rps"] for r in runs])
    p99 = median(
        [r["neighbour beside flood"]["p99_ms"] / r["neighbour alone"]["p99_ms"] for r in runs]
    )
    lines = ["", "Tenants (medians over runs; ratios: median of each run's pair)"]
    for case in CASES:
        rps = median([r[case]["rps"] for r in runs])
        p50 = median([r[case]["p50_ms"] for r in runs])
        p99_ms = median([r[case]["p99_ms"] for r in runs])
        errors = sum(sum(r[case].get("errors", {}).values()) for r in runs)
        lines.append(
            f"  {case:24s} {rps:8.0f} req/s  p50 {p50:6.2f}  p99 {p99_ms:7.2f} ms  errors {errors}"
        )
    verdict = "PASS" if hot >= 0.9 else "FAIL"
    lines.append(f"  {verdict}  hot req/s with tenants >= 0.9 x without: {hot:.2f} x")
    lines.append(
        f"  {'PASS' if p99 <= 1.5 else 'FAIL'}  neighbour p99 beside a flooding tenant <= 1.5 x "
        f"alone: {p99:.2f} x"
    )
    return lines
