"""The scale section: a store of ``--models`` copies of the reference archive (100,000 by default).

It runs two servers of its own, one after the other, on that store (fresh archive caches):

1. **listing and loading** (``--max-loaded-models`` above ``--scale-loaded``): the time from
   starting the process to its first ``/ping`` answer; then every page of ``GET /models``
   (100 names a page, ``next_page_token``), each timed, the first one included (it waits for
   the store's first scan); then ``--scale-loaded`` distinct cold models requested once each by
   ``--scale-clients`` connections (one client thread): loads/s and the requests' p50/p99;
   the frontend's RSS before and after (KB per loaded model); then ``GET /metrics`` five times:
   size and median time; with ``--baseline-exe``, the same cold loads on that build, in
   ``--runs`` pairs of fresh servers, the order alternated (:func:`compare_cold`);
2. **churn** (``--max-loaded-models`` ``--churn-cap``, well below the store): wrk's ``cycle``
   pattern (every request to the next model of a cycle over the whole store, so every request
   is a load and, past the cap, an eviction) in periods of ``--churn-period`` seconds until
   ``--churn-loads`` loads have been counted (the server's ``mmserver_model_loads_total``) or
   ``--churn-seconds`` have passed; the frontend's RSS after each period. Growth is read from
   the first period that ends past :data:`CHURN_SETTLED` loads to the end (a run that ends
   before has no verdict: its growth includes what a server fills once, e.g. the memory of
   10,000 models' measured costs). One ``GET /models`` comes first, so the store index holds
   every name before the churn begins.

Targets (issue: 100,000 models behind one port): ready <= 5 s; a page <= 20 ms (median) at any
offset; >= 500 loads/s and p99 <= 50 ms with 16 clients; with 20,000 loaded a scrape <= 5 MB and
<= 100 ms and a frontend <= 10 KB per loaded model; frontend growth <= 2 MiB after the first
100,000 loads of the churn.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import uvloop
from proctools import HOST, proc_kb, tree_memory

from benchlib import probes, servers, store
from benchlib.loads import Log
from mmserver.commands.loadtest import cpu, users, wrk
from mmserver.commands.loadtest.client import BODY, JSON_HEADERS, Client

PAGE = 100
SCRAPES = 5
COLD_TIMEOUT_S = 600.0
#: Loads after which the churn's frontend growth is read (the issue's "after the first 100,000").
CHURN_SETTLED = 100_000


@dataclass(frozen=True)
class ScaleSettings:
    models: int = 100_000
    clients: int = 16
    loaded: int = 20_000
    churn_loads: int = 1_000_000
    churn_cap: int = 1_000
    churn_seconds: float = 1800.0
    churn_period: float = 20.0
    threads: int = 2
    #: Pairs of cold-load runs against a ``--baseline-exe`` build.
    runs: int = 1


def store_path(models: int) -> Path:
    return store.bench_cache() / f"store-{models}"


def _rss_kb(pid: int) -> int:
    return proc_kb(pid, "status", "VmRSS")


def _start(server: servers.Server) -> float:
    """Start ``server``; seconds from starting the process to its first ``/ping`` answer (the
    poll's 0.1 s resolution included)."""
    started = time.perf_counter()
    server.start()
    return time.perf_counter() - started


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def pages(server: servers.Server) -> dict[str, Any]:
    """Every page of ``GET /models``, in order: each one's time and the names seen."""
    client = Client(server.port)
    times: list[float] = []
    names = 0
    token: str | None = None
    try:
        while True:
            path = f"/models?limit={PAGE}"
            if token is not None:
                path += f"&next_page_token={quote(token)}"
            status, data, seconds = client.request("GET", path)
            if status != 200:
                raise RuntimeError(f"GET {path}: {status} {data[:200]!r}")
            times.append(seconds * 1e3)
            listed = json.loads(data)
            names += len(listed["models"])
            token = listed.get("nextPageToken")
            if not token:
                break
    finally:
        client.close()
    rest = times[1:] or times
    return {
        "pages": len(times),
        "names": names,
        "first_ms": times[0],
        "median_ms": statistics.median(rest),
        "p99_ms": _percentile(rest, 0.99),
        "max_ms": max(rest),
        # The median of each tenth of the listing: a page deep in the store costs as much as
        # the first.
        "by_tenth_ms": [
            statistics.median(rest[i * len(rest) // 10 : (i + 1) * len(rest) // 10] or rest)
            for i in range(10)
        ],
    }


def cold_loads(server: servers.Server, names: list[str], clients: int) -> dict[str, Any]:
    """Request each of ``names`` once (all unloaded), ``clients`` connections at a time, from one
    thread's event loop (the package's closed-loop users on uvloop: a client far lighter than
    threads of ``http.client``, so the server gets the cores)."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    failed: list[str] = []
    todo: Iterator[str] = iter(names)

    def next_request(rng: random.Random) -> tuple[bytes, str] | None:
        name = next(todo, None)
        if name is None:
            return None
        path = f"/predictions/{name}"
        return users.request("POST", path, BODY, JSON_HEADERS, host=HOST, port=server.port), name

    def answered(name: str, outcome: users.Outcome) -> None:
        if outcome.error:
            failed.append(f"{name}: {outcome.error}")
            return
        latencies.append(outcome.seconds * 1e3)
        statuses[str(outcome.status)] = statuses.get(str(outcome.status), 0) + 1

    started = time.perf_counter()
    uvloop.run(
        users.closed_loop(
            server.url,
            clients,
            next_request,
            answered,
            duration_s=COLD_TIMEOUT_S,
            max_requests=len(names),
            timeout_s=COLD_TIMEOUT_S,
        )
    )
    elapsed = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"cold loads failed ({len(failed)}), e.g. {', '.join(failed[:3])}")
    if len(latencies) < len(names):
        raise RuntimeError(f"cold loads not answered within {COLD_TIMEOUT_S:.0f} s")
    return {
        "models": len(names),
        "clients": clients,
        "seconds": elapsed,
        "loads_per_s": len(names) / elapsed,
        "p50_ms": _percentile(latencies, 0.5),
        "p99_ms": _percentile(latencies, 0.99),
        "max_ms": max(latencies),
        "statuses": statuses,
    }


#: The name (``/proc/PID/comm``) of mmserver's unpacking processes
#: (``mmserver.store.unpacking.PROCESS_NAME``).
UNPACKING_PROCESS = "mmserver-unpack"


def cpu_per_load(
    root: int, before: dict[int, float], after: dict[int, float], loads: int
) -> dict[str, float]:
    """CPU milliseconds per load between two :func:`cpu.tree_cpu` readings of the server
    ``root``, by kind of process: the frontend, the backends (with the idle fork server), the
    unpacking processes, and all of them. Read while the processes still run."""
    used = {"frontend": 0.0, "backends": 0.0, "unpacking": 0.0}
    for pid, seconds in after.items():
        if pid == root:
            kind = "frontend"
        else:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = ""
            kind = "unpacking" if comm == UNPACKING_PROCESS else "backends"
        used[kind] += seconds - before.get(pid, 0.0)
    per_load = {kind: 1e3 * seconds / max(1, loads) for kind, seconds in used.items()}
    per_load["all"] = sum(per_load.values())
    return per_load


def scrape(server: servers.Server) -> dict[str, Any]:
    """:data:`SCRAPES` scrapes: the size and the median and longest time."""
    scrapes = [probes.scrape(server) for _ in range(SCRAPES)]
    if any(each["status"] != 200 for each in scrapes):
        raise RuntimeError(f"GET /metrics: {[each['status'] for each in scrapes]}")
    times = [each["ms"] for each in scrapes]
    return {
        "bytes": scrapes[-1]["bytes"],
        "median_ms": statistics.median(times),
        "max_ms": max(times),
    }


def loads_counted(server: servers.Server) -> int:
    """The server's ``mmserver_model_loads_total``."""
    return int(probes.scrape(server)["model_loads"] or 0)


def churn(server: servers.Server, settings: ScaleSettings, log: Log) -> dict[str, Any]:
    """Loads and evictions in periods of wrk's ``cycle`` pattern; RSS of the frontend after
    each period."""
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    offset, requests, errors = 0, 0, 0
    while True:
        load = wrk.Load(
            url=server.url,
            pattern="cycle",
            duration_s=settings.churn_period,
            connections=settings.clients,
            threads=settings.threads,
            models=settings.models,
            start=offset,
        )
        result = wrk.run(load, server.pid)
        offset += result.requests
        requests += result.requests
        errors += result.error_count
        loads = loads_counted(server)
        samples.append(
            {
                "seconds": time.monotonic() - started,
                "loads": loads,
                "rss_kb": _rss_kb(server.pid),
                "rps": result.rps,
                "p99_ms": result.p99_ms,
                "errors": result.errors,
            }
        )
        log(
            f"scale: churn {loads:,} loads in {samples[-1]['seconds']:.0f} s, "
            f"{result.rps:.0f} req/s, frontend RSS {samples[-1]['rss_kb'] / 1024:.1f} MiB, "
            f"errors {result.errors or 0}"
        )
        if loads >= settings.churn_loads or time.monotonic() - started >= settings.churn_seconds:
            break
    settled = next((s for s in samples[:-1] if s["loads"] >= CHURN_SETTLED), None)
    first = settled or samples[0]
    return {
        "cap": settings.churn_cap,
        "requests": requests,
        "errors": errors,
        "loads": samples[-1]["loads"],
        "seconds": samples[-1]["seconds"],
        "loads_per_s": samples[-1]["loads"] / samples[-1]["seconds"],
        "samples": samples,
        "settled": settled is not None,
        "from_loads": first["loads"],
        "growth_mib": (samples[-1]["rss_kb"] - first["rss_kb"]) / 1024,
    }


def run(
    settings: ScaleSettings,
    cache: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    log: Log,
    baseline: Path | None = None,
) -> dict[str, Any]:
    model_store = store_path(settings.models)
    log(f"scale: store of {settings.models:,} models in {model_store}")
    store.ensure_reference(model_store, settings.models)
    result: dict[str, Any] = {"settings": settings.__dict__}
    loaded = min(settings.loaded, settings.models)
    server = servers.mmserver(
        model_store,
        cache / "scale-cache",
        out / "scale-server.log",
        ["--max-loaded-models", str(loaded + 100), *extra],
        exe,
    )
    try:
        result["ready_s"] = _start(server)
        log(f"scale: ready in {result['ready_s']:.2f} s")
        result["pages"] = pages(server)
        log(
            f"scale: {result['pages']['pages']:,} pages of GET /models, first "
            f"{result['pages']['first_ms']:.0f} ms, median {result['pages']['median_ms']:.1f} ms"
        )
        before = _rss_kb(server.pid)
        names = [f"sklearn-{i}" for i in range(settings.models)]
        random.Random(1).shuffle(names)
        cpu_before = cpu.tree_cpu(server.pid)
        result["cold"] = cold_loads(server, names[:loaded], settings.clients)
        result["cold"]["cpu_ms_per_load"] = cpu_per_load(
            server.pid, cpu_before, cpu.tree_cpu(server.pid), loaded
        )
        cpu.wait_quiet(10.0)  # the loads' last work done before the RSS is read
        after = _rss_kb(server.pid)
        result["frontend"] = {
            "before_kb": before,
            "after_kb": after,
            "kb_per_model": (after - before) / loaded,
        }
        result["backends_rss_mb"] = sum(p.rss_kb for p in tree_memory(server.pid)[1:]) / 1024
        log(
            f"scale: {loaded:,} cold loads at {result['cold']['loads_per_s']:.0f}/s, p99 "
            f"{result['cold']['p99_ms']:.0f} ms; frontend "
            f"{result['frontend']['kb_per_model']:.1f} KB per loaded model"
        )
        result["scrape"] = scrape(server)
    finally:
        server.stop()
    if baseline is not None:
        runs = ColdRuns(model_store, names[:loaded], settings, cache, out, extra)
        compare_cold(result, runs, exe, baseline)
        log(
            f"scale: the baseline's {loaded:,} cold loads at "
            f"{result['baseline_cold']['loads_per_s']:.0f}/s: mmserver "
            f"{result['cold_vs_baseline']:.2f}x (median of {len(result['cold_pairs'])} pairs)"
        )
    if settings.churn_loads > 0:
        server = servers.mmserver(
            model_store,
            cache / "churn-cache",
            out / "churn-server.log",
            ["--max-loaded-models", str(settings.churn_cap), *extra],
            exe,
        )
        try:
            _start(server)
            # One listing first, as an operator's would: the store index then holds every name
            # from the start, and what grows after the first loads is not the index filling.
            client = Client(server.port)
            try:
                client.request("GET", "/models?limit=1")
            finally:
                client.close()
            result["churn"] = churn(server, settings, log)
        finally:
            server.stop()
    return result


@dataclass(frozen=True)
class ColdRuns:
    """The cold loads of ``names`` on fresh servers of a build, on the store, as the first
    run's (its options ``extra``; caches under ``cache``, logs in ``out``)."""

    model_store: Path
    names: list[str]
    settings: ScaleSettings
    cache: Path
    out: Path
    extra: list[str]

    def run(self, exe: Path | None, label: str, pair: int) -> dict[str, Any]:
        """The cold loads on a fresh server of the build ``exe`` (``None``: this one), after
        the same start and listing as the first run's."""
        server = servers.mmserver(
            self.model_store,
            self.cache / f"{label}-cold-{pair}",
            self.out / f"{label}-cold-{pair}-server.log",
            ["--max-loaded-models", str(len(self.names) + 100), *self.extra],
            exe,
        )
        try:
            _start(server)
            pages(server)
            cpu_before = cpu.tree_cpu(server.pid)
            result = cold_loads(server, self.names, self.settings.clients)
            result["cpu_ms_per_load"] = cpu_per_load(
                server.pid, cpu_before, cpu.tree_cpu(server.pid), len(self.names)
            )
            return result
        finally:
            server.stop()


def compare_cold(result: dict[str, Any], runs: ColdRuns, exe: Path | None, baseline: Path) -> None:
    """The same cold loads on the ``--baseline-exe`` build, in pairs with mmserver's: the first
    pair is the run above and the baseline after it; each further pair (``--runs``) starts
    fresh servers of both, the baseline first in every other pair (a run leaves the file system
    writing back its cache). ``cold_vs_baseline`` is the median of the pairs' ratios;
    ``baseline_cold`` the baseline's median run."""
    mine: list[dict[str, Any]] = [result["cold"]]
    theirs: list[dict[str, Any]] = []
    for pair in range(runs.settings.runs):
        order = [("baseline", baseline), ("mmserver", exe)]
        if pair % 2 == 0:
            order.reverse()
        for label, built in order:
            if pair == 0 and label == "mmserver":
                continue  # the run above
            (theirs if label == "baseline" else mine).append(runs.run(built, label, pair))
    ratios = [m["loads_per_s"] / t["loads_per_s"] for m, t in zip(mine, theirs, strict=True)]
    result["cold_pairs"] = [
        {"mmserver": m["loads_per_s"], "baseline": t["loads_per_s"], "ratio": r}
        for m, t, r in zip(mine, theirs, ratios, strict=True)
    ]
    result["cold_vs_baseline"] = statistics.median(ratios)
    result["baseline_cold"] = _median_run(theirs)
    result["cold_median"] = _median_run(mine)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median loads per second, with the median CPU per load of every run."""
    ranked = sorted(runs, key=lambda r: r["loads_per_s"])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    spent = [r["cpu_ms_per_load"] for r in runs if r.get("cpu_ms_per_load")]
    if spent:
        chosen["cpu_ms_per_load"] = {k: statistics.median(c[k] for c in spent) for k in spent[0]}
    return chosen


def lines(section: dict[str, Any]) -> list[str]:
    s = section["settings"]
    out = ["", f"Scale: a store of {s['models']:,} copies of the reference archive"]
    if "ready_s" in section:
        p = section["pages"]
        out.append(f"  start to ready: {section['ready_s']:.2f} s")
        out.append(
            f"  GET /models: {p['pages']:,} pages of {PAGE} ({p['names']:,} names); first "
            f"{p['first_ms']:.0f} ms (the store's first scan), then median {p['median_ms']:.2f}"
            f", p99 {p['p99_ms']:.2f}, max {p['max_ms']:.1f} ms; median by tenth of the store: "
            + " ".join(f"{v:.2f}" for v in p["by_tenth_ms"])
        )
        c = section["cold"]
        out.append(
            f"  cold loads: {c['models']:,} distinct models, {c['clients']} clients: "
            f"{c['loads_per_s']:.0f} loads/s, p50 {c['p50_ms']:.1f} p99 {c['p99_ms']:.1f} "
            f"max {c['max_ms']:.0f} ms, statuses {c['statuses']}"
        )
        b = section.get("baseline_cold")
        cpu = c.get("cpu_ms_per_load")
        if b:
            m = section.get("cold_median", c)
            pairs = section.get("cold_pairs", [])
            out.append(
                f"  against the baseline build, {len(pairs)} pair(s) of fresh servers, medians: "
                f"mmserver {m['loads_per_s']:.0f} loads/s (p99 {m['p99_ms']:.1f} ms), baseline "
                f"{b['loads_per_s']:.0f} loads/s (p99 {b['p99_ms']:.1f} ms): mmserver "
                f"{section['cold_vs_baseline']:.2f}x (pairs "
                + ", ".join(f"{p['ratio']:.2f}" for p in pairs)
                + ")"
            )
            cpu = m.get("cpu_ms_per_load", cpu)
            bc = b.get("cpu_ms_per_load")
            if bc:
                out.append(
                    f"  the baseline's CPU per cold load: frontend {bc['frontend']:.2f}, "
                    f"backends {bc['backends']:.2f}, unpacking {bc['unpacking']:.2f}, all "
                    f"{bc['all']:.2f} ms"
                )
        if cpu:
            out.append(
                f"  CPU per cold load: frontend {cpu['frontend']:.2f}, backends "
                f"{cpu['backends']:.2f}, unpacking {cpu['unpacking']:.2f}, all "
                f"{cpu['all']:.2f} ms"
            )
        f = section["frontend"]
        out.append(
            f"  frontend RSS {f['before_kb'] / 1024:.0f} -> {f['after_kb'] / 1024:.0f} MiB with "
            f"{c['models']:,} loaded ({f['kb_per_model']:.1f} KB each); backends "
            f"{section['backends_rss_mb']:.0f} MiB"
        )
        sc = section["scrape"]
        out.append(
            f"  GET /metrics with {c['models']:,} loaded: {sc['bytes'] / 1e6:.2f} MB, median "
            f"{sc['median_ms']:.0f} ms (max {sc['max_ms']:.0f})"
        )
    ch = section.get("churn")
    if ch:
        out.append(
            f"  churn (--max-loaded-models {ch['cap']:,}): {ch['loads']:,} loads in "
            f"{ch['seconds']:.0f} s ({ch['loads_per_s']:.0f}/s), {ch['errors']} errors; frontend "
            f"RSS " + " ".join(f"{x['rss_kb'] / 1024:.1f}" for x in ch["samples"]) + " MiB"
        )
    return out


def targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    if not section or "ready_s" not in section:
        return []
    p, c, f, sc = section["pages"], section["cold"], section["frontend"], section["scrape"]
    n, loaded = section["settings"]["models"], c["models"]
    worst_page = max(p["by_tenth_ms"])
    rows: list[tuple[str, str, bool | None]] = [
        (
            f"scale: {n:,} models, start to ready <= 5 s",
            f"{section['ready_s']:.2f} s",
            section["ready_s"] <= 5,
        ),
        (
            "scale: a GET /models page <= 20 ms (median) at any offset",
            f"{worst_page:.2f} ms (worst tenth)",
            worst_page <= 20,
        ),
        (
            f"scale: {c['clients']} clients on cold models >= 500 loads/s",
            f"{c['loads_per_s']:.0f}/s",
            c["loads_per_s"] >= 500,
        ),
        ("scale: cold loads p99 <= 50 ms", f"{c['p99_ms']:.1f} ms", c["p99_ms"] <= 50),
        (
            f"scale: {loaded:,} loaded, scrape <= 5 MB and <= 100 ms",
            f"{sc['bytes'] / 1e6:.2f} MB, {sc['median_ms']:.0f} ms",
            sc["bytes"] <= 5e6 and sc["median_ms"] <= 100,
        ),
        (
            f"scale: {loaded:,} loaded, frontend <= 10 KB per loaded model",
            f"{f['kb_per_model']:.1f} KB",
            f["kb_per_model"] <= 10,
        ),
    ]
    ch = section.get("churn")
    if ch:
        settled = ch.get("settled", True)  # results written before the key existed had settled
        shown = f"{ch['growth_mib']:+.1f} MiB over loads {ch['from_loads']:,}..{ch['loads']:,}"
        rows.append(
            (
                f"scale: churn, frontend growth <= 2 MiB after the first {CHURN_SETTLED:,} loads",
                shown if settled else f"{shown} (ended before {CHURN_SETTLED:,}: no verdict)",
                ch["growth_mib"] <= 2 if settled else None,
            )
        )
    return rows
