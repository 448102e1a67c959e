"""Medians over runs, the targets with PASS/MISS, and the table, JSON and PNG written out."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchlib import explainbench, onnxbench, scale, tabular, trees
from benchlib.neighbour import (
    COLD_LOADS,
    LANE_MOVES,
    LARGE_CONNECTIONS,
    LARGE_ROWS,
    LOAD_CLIENTS,
)

PATTERNS = ("hot", "uniform", "zipf")
P99_TARGET_MS = 20.0
HOLD_SHARE = 0.98  # an open-loop run holds its rate when it answers this share of it


def median(values: Iterable[float | None]) -> float | None:
    """The median, or None when there is no value or any value is None (a missed measure)."""
    items = list(values)
    if not items or any(v is None for v in items):
        return None
    return float(statistics.median(v for v in items if v is not None))


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of wrk results over runs; errors summed over runs."""
    errors: dict[str, int] = {}
    for run in runs:
        for key, n in run["errors"].items():
            errors[key] = errors.get(key, 0) + n
    keys = ("rps", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "offered_rps")
    out: dict[str, Any] = {k: median(r[k] for r in runs) for k in keys}
    # A run whose schedule slipped (no bound) counts as an infinite p99 in the median.
    bounds = [math.inf if r["p99_bound_ms"] is None else r["p99_bound_ms"] for r in runs]
    out["p99_bound_ms"] = median(bounds) if runs else None
    out["late_share"] = max((r["late"] / r["sent"] for r in runs if r["sent"]), default=0.0)
    out["errors"] = errors
    out["error_count"] = sum(errors.values())
    # The slowest request of any run (the median of the runs' maxima is in max_ms).
    out["worst_ms"] = max((r["max_ms"] for r in runs), default=None)
    cpu_keys = {k for r in runs for k in r.get("cpu", {})}
    out["cpu"] = {k: median(r.get("cpu", {}).get(k, 0.0) for r in runs) for k in cpu_keys}
    out["runs"] = len(runs)
    return out


def _summarize_moves(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The lane moves beside the large requests: the most of one model in one run, against
    what one a minute allows in the longest run; every run's moves; the large model's lane in
    each run and the median CPU of one of its requests."""
    costs = [r["request_ms"] for r in runs]
    return {
        "max_per_model": max((max(r["moves"].values(), default=0) for r in runs), default=0),
        "allowed": max((math.ceil(r["seconds"] / 60) for r in runs), default=1),
        "moves": [r["moves"] for r in runs],
        "lanes": [r["lane"] for r in runs],
        "request_ms": median(costs) if all(c is not None for c in costs) else None,
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The medians of every section present in ``raw``."""
    out: dict[str, Any] = {"floor": raw.get("floor", "aiohttp")}
    for section in ("closed", "open"):
        if section not in raw:
            continue
        out[section] = {}
        for pattern in PATTERNS:
            if pattern not in raw[section]:
                continue
            entry: dict[str, Any] = {
                name: summarize_runs(runs)
                for name, runs in raw[section][pattern].items()
                if name != "polled" and runs
            }
            server, floor = entry.get("mmserver"), entry.get("floor")
            if server and floor and server["rps"] and floor["rps"]:
                entry["ratio"] = server["rps"] / floor["rps"]
            for name in set(raw[section][pattern]) - {"mmserver", "floor", "polled"}:
                peer = entry.get(name)
                if peer is None:
                    continue
                if server and server["rps"] and peer["rps"]:
                    entry.setdefault("peer_ratio", {})[name] = server["rps"] / peer["rps"]
            resets = [p for p in raw[section][pattern].get("polled", []) if p["reset"]]
            if resets:
                entry["to_max_ms"] = median(p["to_max_ms"] for p in resets)
                entry["to_max_polled_ms"] = median(p["to_max_polled_ms"] for p in resets)
                entry["max_workers"] = resets[0]["max_workers"]
            out[section][pattern] = entry
        if section == "open":
            out["open"]["rate"] = raw["open"]["rate"]
    if "cold" in raw:
        out["cold"] = {
            k: median(r[k] for r in raw["cold"])
            for k in ("cold_median_ms", "warm_median_ms", "extra_ms")
        }
        out["cold"]["errors"] = sum(r["errors"] for r in raw["cold"])
    if "memory" in raw:
        out["memory"] = {k: raw["memory"][k] for k in ("rss_mb", "pss_mb")}
    info: dict[str, str] = {}
    if "load_all" in raw:
        loaded = raw["load_all"]
        info["loading 1,000 models (4 clients)"] = (
            f"{loaded['seconds']:.1f} s, statuses {loaded['statuses']}"
        )
    if "memory" in raw:
        info["memory by process (RSS/PSS MB)"] = ", ".join(
            f"{p['name']} {p['pid']}: {p['rss_kb'] * 1024 / 1e6:.0f}/{p['pss_kb'] * 1024 / 1e6:.0f}"
            for p in raw["memory"]["processes"]
        )
    if "scrape" in raw:
        sc = raw["scrape"]
        info["GET /metrics with every model loaded"] = (
            f"{sc['ms']:.0f} ms, {sc['bytes'] / 1e6:.1f} MB, status {sc['status']}"
        )
    if info:
        out["info"] = info
    if "neighbour" in raw:
        section = raw["neighbour"]
        out["neighbour"] = {
            k: summarize_runs(v)
            for k, v in section.items()
            if v and k not in (COLD_LOADS, LANE_MOVES)
        }
        if section.get(COLD_LOADS):
            out["neighbour"][COLD_LOADS] = {
                "loads_per_s": median(r["loads_per_s"] for r in section[COLD_LOADS]),
                "errors": sum(r["errors"] for r in section[COLD_LOADS]),
            }
        if section.get(LANE_MOVES):
            out["neighbour"][LANE_MOVES] = _summarize_moves(section[LANE_MOVES])
    if "trees" in raw:
        out["trees"] = raw["trees"]
    if "onnx" in raw:
        out["onnx"] = raw["onnx"]
    if "explain" in raw:
        out["explain"] = raw["explain"]
    if "tabular" in raw:
        out["tabular"] = _summarize_tabular(raw["tabular"])
    if "scale" in raw:
        out["scale"] = raw["scale"]
    if "batching" in raw:
        out["batching"] = {k: summarize_runs(v) for k, v in raw["batching"].items()}
        b1, b32 = out["batching"].get("batch 1"), out["batching"].get("batch 32")
        if b1 and b32 and b1["rps"]:
            out["batching"]["ratio"] = b32["rps"] / b1["rps"]
    return out


def _summarize_tabular(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians per model, form and server; mmserver / MLServer req/s; the check as it was."""
    loads: dict[str, Any] = {}
    for key, forms in raw.get("loads", {}).items():
        loads[key] = {}
        for form, by_server in forms.items():
            entry: dict[str, Any] = {
                name: summarize_runs(runs) for name, runs in by_server.items() if runs
            }
            server, peer = entry.get("mmserver"), entry.get("mlserver")
            if server and peer and server["rps"] and peer["rps"]:
                entry["ratio"] = server["rps"] / peer["rps"]
            loads[key][form] = entry
    return {"loads": loads, "check": raw.get("check", {})}


def _fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{unit}"


#: The closed loop's targets, as a share of each floor's requests a second.
FLOOR_TARGETS = {
    "aiohttp": (("hot", 0.75), ("uniform", 0.6)),
    "raw": (("hot", 0.35), ("uniform", 0.3)),
}


def targets(summary: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, passed) for each target of the issue; passed None when not measured."""
    rows: list[tuple[str, str, bool | None]] = []
    closed = summary.get("closed", {})
    # What the closed loop should reach of each floor: aiohttp's web server answering a fixed
    # body, or the raw floor (an asyncio.Protocol on httptools); none of an earlier build.
    shares = FLOOR_TARGETS.get(summary.get("floor", "aiohttp"), ())
    for pattern, share in shares:
        ratio = closed.get(pattern, {}).get("ratio")
        rows.append(
            (
                f"closed {pattern}: >= {share} x floor req/s",
                _fmt(ratio, ".2f", " x"),
                None if ratio is None else ratio >= share,
            )
        )
    for pattern in PATTERNS:
        server = closed.get(pattern, {}).get("mmserver")
        if server is None:
            rows.append((f"closed {pattern}: p99 <= 20 ms, 0 errors", "-", None))
            continue
        p99, errors = server["p99_ms"], server["error_count"]
        rows.append(
            (
                f"closed {pattern}: p99 <= 20 ms, 0 errors",
                f"{_fmt(p99, '.1f', ' ms')}, {errors} errors",
                p99 is not None and p99 <= P99_TARGET_MS and errors == 0,
            )
        )
    opened = summary.get("open", {})
    for pattern in PATTERNS:
        server = opened.get(pattern, {}).get("mmserver")
        label = f"open {pattern}: holds {_fmt(opened.get('rate'), '.0f')} req/s, p99 <= 20 ms"
        if server is None:
            rows.append((label, "-", None))
            continue
        held = server["rps"] is not None and server["rps"] >= HOLD_SHARE * server["offered_rps"]
        bound = server["p99_bound_ms"]
        if bound is not None and not math.isfinite(bound):
            bound = None
        rows.append(
            (
                label,
                f"{_fmt(server['rps'], '.0f')} req/s, p99 {_fmt(server['p99_ms'], '.1f')} "
                f"(<= {_fmt(bound, '.1f')}) ms, {server['error_count']} errors",
                held
                and bound is not None
                and bound <= P99_TARGET_MS
                and server["error_count"] == 0,
            )
        )
    cold = summary.get("cold", {})
    extra = cold.get("extra_ms")
    rows.append(
        (
            "cold first request <= warm + 5 ms (median)",
            f"+{_fmt(extra, '.1f', ' ms')} ({_fmt(cold.get('cold_median_ms'), '.1f')} vs "
            f"{_fmt(cold.get('warm_median_ms'), '.2f')} ms)"
            if cold
            else "-",
            None if not cold else extra is not None and extra <= 5.0,
        )
    )
    mem = summary.get("memory")
    rows.append(
        (
            # The processes' PSS add up to the memory they occupy; their RSS add up to more,
            # counting each page the fork server shares with the backends once per process.
            "resident memory (PSS sum), 1,000 models loaded <= 400 MB",
            f"PSS {mem['pss_mb']:.0f} MB (RSS sum {mem['rss_mb']:.0f} MB)" if mem else "-",
            None if not mem else mem["pss_mb"] <= 400,
        )
    )
    rows += _neighbour_targets(summary.get("neighbour"))
    rows += trees.targets(summary.get("trees"))
    rows += tabular.targets(summary.get("tabular"))
    rows += scale.targets(summary.get("scale"))
    hot = closed.get("hot", {})
    if "to_max_ms" in hot:
        to_max = hot["to_max_ms"]
        rows.append(
            (
                f"burst to maxWorkers ({hot['max_workers']}) <= 200 ms",
                f"{_fmt(to_max, '.0f', ' ms')} (polled: {_fmt(hot['to_max_polled_ms'], '.0f')} ms)",
                to_max is not None and to_max <= 200,
            )
        )
    else:
        rows.append(("burst to maxWorkers <= 200 ms", "-", None))
    return rows


#: The heavy model beside saturating light traffic: at least this share of its throughput alone,
#: and no request slower than this (issue 34: a floor for every model, not idle priority).
HEAVY_SHARE_TARGET = 0.25
HEAVY_MAX_TARGET_MS = 1000.0


def _neighbour_targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    """Light models beside a saturating heavy one: p99 within 2 x (and 20 ms) of theirs alone,
    throughput at least 60 % of theirs alone; the heavy model beside them: at least
    :data:`HEAVY_SHARE_TARGET` of its throughput alone, no request past
    :data:`HEAVY_MAX_TARGET_MS` in any run."""
    p99_label = "neighbour: light p99 beside heavy <= 2 x alone, <= 20 ms"
    rps_label = "neighbour: light req/s beside heavy >= 60 % of alone"
    alone = (section or {}).get("light alone")
    beside = (section or {}).get("light beside heavy")
    rows = _heavy_targets(section) + _large_targets(section)
    if not alone or not beside:
        return [(p99_label, "-", None), (rps_label, "-", None), *rows]
    p99_alone, p99_beside = alone["p99_ms"], beside["p99_ms"]
    p99_ok = (
        p99_alone is not None
        and p99_beside is not None
        and p99_beside <= 2 * p99_alone
        and p99_beside <= P99_TARGET_MS
    )
    share = beside["rps"] / alone["rps"] if alone["rps"] and beside["rps"] else None
    errors = alone["error_count"] + beside["error_count"]
    loop = (section or {}).get("light beside idle loop")
    p99_loop = loop["p99_ms"] if loop else None
    floor = (
        f"; beside an idle-priority loop {_fmt(p99_loop / p99_alone, '.2f', ' x')}"
        if p99_loop and p99_alone
        else ""
    )
    return [
        (
            p99_label,
            f"{_fmt(p99_beside, '.1f')} vs {_fmt(p99_alone, '.1f')} ms "
            f"({_fmt(p99_beside / p99_alone if p99_alone and p99_beside else None, '.2f', ' x')}"
            f"{floor})",
            p99_ok and errors == 0,
        ),
        (
            rps_label,
            f"{_fmt(beside['rps'], '.0f')} vs {_fmt(alone['rps'], '.0f')} req/s "
            f"({_fmt(None if share is None else 100 * share, '.0f', ' %')})",
            None if share is None else share >= 0.6 and errors == 0,
        ),
        *rows,
    ]


def _large_targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    """Light models beside a flood of large requests: p99 within 2 x of theirs alone; no model
    moved between the lanes more than once a minute meanwhile (issue 49)."""
    p99_label = f"neighbour: light p99 beside {LARGE_ROWS:,}-row requests <= 2 x alone"
    moves_label = "neighbour: lane moves beside the large requests <= 1 per model a minute"
    alone = (section or {}).get("light alone")
    beside = (section or {}).get("light beside large requests")
    moves = (section or {}).get(LANE_MOVES)
    rows: list[tuple[str, str, bool | None]] = []
    if not alone or not beside:
        rows.append((p99_label, "-", None))
    else:
        p99_alone, p99_beside = alone["p99_ms"], beside["p99_ms"]
        ratio = p99_beside / p99_alone if p99_alone and p99_beside else None
        errors = alone["error_count"] + beside["error_count"]
        rows.append(
            (
                p99_label,
                f"{_fmt(p99_beside, '.1f')} vs {_fmt(p99_alone, '.1f')} ms "
                f"({_fmt(ratio, '.2f', ' x')})",
                None if ratio is None else ratio <= 2 and errors == 0,
            )
        )
    if not moves:
        rows.append((moves_label, "-", None))
    else:
        rows.append(
            (
                moves_label,
                f"at most {moves['max_per_model']} of one model in a run "
                f"(allowed {moves['allowed']}); large model: {', '.join(map(str, moves['lanes']))}",
                moves["max_per_model"] <= moves["allowed"],
            )
        )
    return rows


def heavy_share(section: dict[str, Any]) -> float | None:
    """The heavy model's throughput beside the light models as a share of its throughput
    alone (medians of the runs), or None when either is missing."""
    alone, beside = section.get("heavy alone"), section.get("heavy beside light")
    if not alone or not beside or not alone["rps"] or beside["rps"] is None:
        return None
    return float(beside["rps"] / alone["rps"])


def _heavy_targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    share_label = (
        f"neighbour: heavy req/s beside light >= {100 * HEAVY_SHARE_TARGET:.0f} % of alone"
    )
    max_label = f"neighbour: heavy requests beside light all <= {HEAVY_MAX_TARGET_MS:.0f} ms"
    beside = (section or {}).get("heavy beside light")
    alone = (section or {}).get("heavy alone")
    if not beside or not alone:
        return [(share_label, "-", None), (max_label, "-", None)]
    share = heavy_share(section or {})
    errors = beside["error_count"]
    worst = beside["worst_ms"]
    return [
        (
            share_label,
            f"{_fmt(beside['rps'], '.0f')} vs {_fmt(alone['rps'], '.0f')} req/s "
            f"({_fmt(None if share is None else 100 * share, '.0f', ' %')})",
            None if share is None else share >= HEAVY_SHARE_TARGET and errors == 0,
        ),
        (
            max_label,
            f"slowest {_fmt(worst, '.0f', ' ms')}, p99 {_fmt(beside['p99_ms'], '.0f', ' ms')}"
            f" (alone: p99 {_fmt(alone['p99_ms'], '.0f', ' ms')}), errors {errors}",
            None if worst is None else worst <= HEAVY_MAX_TARGET_MS and errors == 0,
        ),
    ]


def _cpu(cpu: dict[str, float | None]) -> str:
    def pct(key: str) -> str:
        return _fmt(cpu.get(key), ".0f")

    return f"{pct('server')}+{pct('server_children')}/{pct('wrk')}/{pct('other')}"


def _other_cpu(summary: dict[str, Any]) -> float | None:
    """Median CPU use of everything but the benchmark's processes over the load runs."""
    values = [
        entry[name]["cpu"]["other"]
        for section in ("closed", "open")
        for entry in summary.get(section, {}).values()
        if isinstance(entry, dict)
        for name in ("mmserver", "floor")
        if name in entry and entry[name]["cpu"].get("other") is not None
    ]
    values += [
        result["cpu"]["other"]
        for forms in summary.get("tabular", {}).get("loads", {}).values()
        for entry in forms.values()
        for name, result in entry.items()
        if name != "ratio" and result["cpu"].get("other") is not None
    ]
    return statistics.median(values) if values else None


def _load_table(title: str, section: dict[str, Any]) -> list[str]:
    lines = [
        title,
        f"  {'pattern':<9}{'server':<10}{'req/s':>9}{'x floor':>9}{'p50':>8}{'p90':>8}"
        f"{'p99':>8}{'max':>8}  {'cpu % srv+ch/wrk/other':<22} errors",
    ]
    for pattern in PATTERNS:
        entry = section.get(pattern)
        if not entry:
            continue
        peers = sorted(entry.get("peer_ratio", {}))
        floor_rps = (entry.get("floor") or {}).get("rps")
        for name in ("mmserver", "floor", *peers):
            r = entry.get(name)
            if not r:
                continue
            if name == "mmserver":
                ratio = _fmt(entry.get("ratio"), ".2f")
            elif name == "floor":
                ratio = "1.00"
            else:
                ratio = _fmt(r["rps"] / floor_rps if floor_rps and r["rps"] else None, ".2f")
            errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
            lines.append(
                f"  {pattern if name == 'mmserver' else '':<9}{name:<10}"
                f"{_fmt(r['rps'], '.0f'):>9}{ratio:>9}{_fmt(r['p50_ms'], '.2f'):>8}"
                f"{_fmt(r['p90_ms'], '.2f'):>8}{_fmt(r['p99_ms'], '.2f'):>8}"
                f"{_fmt(r['max_ms'], '.1f'):>8}  {_cpu(r['cpu']):<22} {errors}"
            )
        for name in peers:
            lines.append(
                f"  {'':<9}mmserver / {name}: {_fmt(entry['peer_ratio'][name], '.2f', ' x')} "
                "the requests per second"
            )
    return lines


def table(summary: dict[str, Any], header: list[str]) -> str:
    lines = list(header)
    if "closed" in summary:
        lines += [
            "",
            "Closed loop (latency in ms, medians over runs, errors summed; cpu: % of one core used",
            "by the server process + its children (backends) / wrk / anything else on the machine)",
        ]
        lines += _load_table("", summary["closed"])[1:]
    if "open" in summary:
        lines += [
            "",
            f"Open loop at {summary['open']['rate']:.0f} req/s offered (p99 is wrk's, from the "
            "send; a target's bound adds sends made late by busy connections)",
        ]
        lines += _load_table("", summary["open"])[1:]
    if "batching" in summary:
        b = summary["batching"]
        lines += ["", "Batching: RandomForestRegressor (100 trees), same closed-loop load"]
        for label in ("batch 1", "batch 32"):
            if label in b:
                r = b[label]
                lines.append(
                    f"  {label:<10}{_fmt(r['rps'], '.0f'):>8} req/s  p50 {_fmt(r['p50_ms'], '.1f')}"
                    f"  p99 {_fmt(r['p99_ms'], '.1f')} ms  errors {r['error_count']}"
                )
        lines.append(f"  batch 32 / batch 1 throughput: {_fmt(b.get('ratio'), '.2f', ' x')}")
    if "neighbour" in summary:
        lines += [
            "",
            "Neighbour: light models (8 connections over 100 reference models) alone and beside "
            "a heavy",
            "forest (300 trees, depth 14) saturated by 8 connections of its own; the heavy "
            "forest alone;",
            "the light models beside cold loads, and beside a busy loop at idle CPU priority "
            "outside the server;",
            f"the light models beside {LARGE_CONNECTIONS} connections sending {LARGE_ROWS:,}-row "
            "requests to one forest",
        ]
        cases = ("light alone", "light beside heavy", "heavy beside light", "heavy alone")
        large = ("light beside large requests", "large beside light")
        for label in (*cases, *large, "light beside loads", "light beside idle loop"):
            r = summary["neighbour"].get(label)
            if r:
                errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
                lines.append(
                    f"  {label:<22}{_fmt(r['rps'], '.0f'):>8} req/s  p50 "
                    f"{_fmt(r['p50_ms'], '.2f'):>6}  p99 {_fmt(r['p99_ms'], '.2f'):>7} ms  "
                    f"cpu {_cpu(r['cpu'])}  errors {errors}"
                )
                if label == "heavy beside light":
                    share = heavy_share(summary["neighbour"])
                    lines.append(
                        f"  {'':<22}{_fmt(None if share is None else 100 * share, '.0f', ' %'):>8}"
                        f" of the heavy model alone; slowest request "
                        f"{_fmt(r['worst_ms'], '.0f', ' ms')}"
                    )
        moves = summary["neighbour"].get(LANE_MOVES)
        if moves:
            lines.append(
                f"  (beside the large requests: lane moves by run {moves['moves']}; the large "
                f"model's lane {moves['lanes']}, a request {_fmt(moves['request_ms'], '.1f')} ms "
                "of CPU)"
            )
        loads = summary["neighbour"].get(COLD_LOADS)
        if loads:
            lines.append(
                f"  (beside the light models: {loads['loads_per_s']:.0f} cold loads/s from "
                f"{LOAD_CLIENTS} connections, {loads['errors']} errors)"
            )
    if "trees" in summary:
        lines += trees.lines(summary["trees"])
    if "onnx" in summary:
        lines += onnxbench.lines(summary["onnx"])
    if "explain" in summary:
        lines += explainbench.lines(summary["explain"])
    if "tabular" in summary:
        lines += tabular.lines(summary["tabular"])
    if "scale" in summary:
        lines += scale.lines(summary["scale"])
    info = summary.get("info", {})
    if info:
        lines += ["", "Also measured"]
        lines += [f"  {key}: {value}" for key, value in info.items()]
    other = _other_cpu(summary)
    if other is not None and other > 10:
        lines += [
            "",
            f"WARNING: other programs kept the machine {other:.0f} % of a core busy during the "
            "load runs (median);",
            "the figures are disturbed: run again on a quiet machine.",
        ]
    lines += ["", "Targets"]
    for name, measured, passed in targets(summary):
        if passed is None and measured == "-":
            continue  # a section this run did not measure
        verdict = "n/a" if passed is None else "PASS" if passed else "MISS"
        lines.append(f"  {verdict:<5} {name:<58} {measured}")
    return "\n".join(lines) + "\n"


def write_json(path: Path, data: dict[str, Any]) -> None:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    path.write_text(json.dumps(clean(data), indent=1) + "\n")


def plot(path: Path, raw: dict[str, Any], summary: dict[str, Any]) -> bool:
    """Probe latency and the hot model's workers over time (first run of each pattern), and
    throughput against the floor. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if "closed" not in raw:
        return True  # nothing of the closed loop to draw (e.g. --only scale): no bench.png
    fig, (lat_ax, work_ax, bar_ax) = plt.subplots(3, 1, figsize=(10, 11))
    for pattern in PATTERNS:
        polled = raw.get("closed", {}).get(pattern, {}).get("polled", [])
        if not polled:
            continue
        samples = polled[0]["samples"]
        t = [s["t"] for s in samples]
        probe = [math.nan if s["probe_ms"] is None else s["probe_ms"] for s in samples]
        lat_ax.plot(t, probe, ".-", ms=3, lw=0.7, label=pattern)
        work_ax.step(t, [s["workers"] for s in samples], where="post", label=pattern)
    lat_ax.set(
        title="Probe request to sklearn-0 every 50 ms during the closed-loop runs",
        xlabel="s since the run started",
        ylabel="latency (ms)",
        yscale="log",
    )
    lat_ax.axhline(P99_TARGET_MS, color="grey", ls="--", lw=0.8)
    work_ax.set(
        title="Workers of sklearn-0 (the hot run starts it from minWorkers)",
        xlabel="s since the run started",
        ylabel="workers",
    )
    work_ax.yaxis.get_major_locator().set_params(integer=True)
    names, server_rps, floor_rps = [], [], []
    for section in ("closed",):
        for pattern in PATTERNS:
            entry = summary.get(section, {}).get(pattern, {})
            if "mmserver" in entry:
                names.append(f"{section} loop\n{pattern}")
                server_rps.append(entry["mmserver"]["rps"] or 0)
                floor_rps.append(entry.get("floor", {}).get("rps") or 0)
    xs = range(len(names))
    bar_ax.bar([x - 0.2 for x in xs], server_rps, 0.4, label="mmserver")
    bar_ax.bar([x + 0.2 for x in xs], floor_rps, 0.4, label="HTTP floor")
    bar_ax.set_xticks(list(xs), names)
    bar_ax.set(title="Closed-loop throughput (medians)", ylabel="req/s")
    for ax in (lat_ax, work_ax, bar_ax):
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
