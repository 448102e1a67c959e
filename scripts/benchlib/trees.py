"""The trees section: tree ensembles of four families through the server, each with its own
predict (``option.fast_path=false``) and with the predict paths mmserver chose at load.

Models (written by :func:`ensure` with ``scripts/tree_models.py``, 8 features): a
RandomForestRegressor of 300 trees of depth 14, a HistGradientBoostingRegressor of 100
iterations, an XGBoost booster of 300 trees (``model.json``) and a LightGBM booster of 300 trees
(``model.txt``). Per model and variant: the latency of one-row requests and of 32-row requests
(one client, sequential; medians), and the closed-loop req/s of one-row requests (wrk,
``concurrency`` connections; median of the runs).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchlib.loads import Log, Settings, describe_run
from benchlib.servers import Server
from mmserver.commands.loadtest import cpu, wrk
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

FAMILIES = ("forest", "histgb", "xgboost", "lightgbm")
VARIANTS = ("own", "chosen")
STAMP = ".bench-trees"
ONE_ROW_REQUESTS = 100
BATCH_REQUESTS = 20
BATCH_ROWS = 32


def model_name(family: str, variant: str) -> str:
    return f"bench-trees-{family}" + ("-own" if variant == "own" else "")


def stale_stamp(stamp: Path, section: str, packages: tuple[str, ...], extras: str) -> str | None:
    """The library versions a section's models are written with (scikit-learn's and
    ``packages``'), or ``None`` when ``stamp`` says the store holds them already; a missing
    package stops the bench saying to install ``extras``."""
    import sklearn

    versions = [sklearn.__version__]
    for package in packages:
        try:
            versions.append(__import__(package).__version__)
        except ImportError:
            raise SystemExit(
                f"the {section} section needs {package}: pip install -e '.[{extras}]'"
            ) from None
    text = " ".join(versions)
    return None if stamp.is_file() and stamp.read_text() == text else text


def ensure(store: Path) -> None:
    """Write the section's models into ``store`` unless these library versions did."""
    import tree_models

    stamp = store / STAMP
    versions = stale_stamp(stamp, "trees", ("xgboost", "lightgbm"), "xgboost,lightgbm")
    if versions is None:
        return
    from sklearn.ensemble import HistGradientBoostingRegressor

    X, y, _ = tree_models.data(5000)
    built = {
        "forest": tree_models.forest(300, 14),
        "histgb": HistGradientBoostingRegressor(max_iter=100).fit(X, y),
        "xgboost": tree_models.xgboost_booster(300),
        "lightgbm": tree_models.lightgbm_booster(300),
    }
    built["forest"].n_jobs = None  # one thread, as a served model usually runs
    for family, model in built.items():
        for variant in VARIANTS:
            folder = store / model_name(family, variant)
            if family == "xgboost":
                tree_models.write_xgboost(folder, model)
            elif family == "lightgbm":
                tree_models.write_lightgbm(folder, model)
            else:
                tree_models.write_pickle(folder, model)
            if variant == "own":
                (folder / "serving.properties").write_text("option.fast_path=false\n")
    stamp.write_text(versions)


def rows_body(rows: int) -> bytes:
    """A JSON body of ``rows`` rows of the models' features."""
    import tree_models

    X, _, _ = tree_models.data(rows, seed=7)
    return json.dumps(X.tolist()).encode()


def latencies(
    client: Client,
    model: str,
    body: bytes,
    count: int,
    path: str = "",
    headers: dict[str, str] = JSON_HEADERS,
) -> list[float]:
    """``count`` sequential requests' latencies (ms) of ``model`` (at ``path``, by default its
    DJL path)."""
    path = path or f"/predictions/{model}"
    out = []
    for _ in range(count):
        status, _, seconds = client.request("POST", path, body, headers)
        if status != 200:
            raise RuntimeError(f"POST {path} answered {status}")
        out.append(seconds * 1000)
    return out


#: The reference store's linear model, measured the same way: the server's own ceiling for
#: one-row requests, which no model's predict path can pass.
REFERENCE = "sklearn-0"


def closed_loop(
    server: Server, settings: Settings, log: Log, model: str, label: str, body: str
) -> float:
    """The median closed-loop req/s of one-row requests (``body``) to ``model``."""
    rps = []
    for r in range(settings.runs):
        load = wrk.Load(
            url=server.url,
            pattern="single",
            model=model,
            duration_s=settings.duration_s,
            connections=settings.concurrency,
            threads=settings.threads,
            api=settings.api,
            body=body,
            seed=r + 1,
        )
        result = wrk.run(load, server.pid, settings.quiet_wait_s)
        log(describe_run(label, load, result))
        rps.append(result.rps)
    return statistics.median(rps)


def run(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """Latencies and closed-loop req/s per model; each model's chosen paths as described; the
    reference model's closed-loop req/s."""
    one, batch = rows_body(1), rows_body(BATCH_ROWS)
    out: dict[str, Any] = {}
    client = Client(server.port, timeout=120.0)
    try:
        latencies(client, REFERENCE, b"[[0.5]]", 5)
        out[REFERENCE] = {
            "rps": closed_loop(server, settings, log, REFERENCE, "reference", "[[0.5]]")
        }
        for family in FAMILIES:
            for variant in VARIANTS:
                name = model_name(family, variant)
                latencies(client, name, one, 5)  # load, warm
                cpu.wait_quiet(settings.quiet_wait_s)
                singles = latencies(client, name, one, ONE_ROW_REQUESTS)
                batches = latencies(client, name, batch, BATCH_REQUESTS)
                described = client.describe(name) or {}
                rps = closed_loop(server, settings, log, name, f"{family}/{variant}", one.decode())
                out[name] = {
                    "one_row_ms": statistics.median(singles),
                    "one_row_p99_ms": sorted(singles)[int(0.99 * (len(singles) - 1))],
                    "batch_ms": statistics.median(batches),
                    "rps": rps,
                    "paths": described.get("predictPaths"),
                }
    finally:
        client.close()
    return out


def lines(section: dict[str, Any]) -> list[str]:
    """The section's table: own predict against the chosen paths, per family."""
    out = [
        "",
        f"Trees: one-row and {BATCH_ROWS}-row request latency (one client, medians) and "
        "closed-loop one-row req/s, own predict -> chosen paths",
    ]
    for family in FAMILIES:
        own, chosen = (section.get(model_name(family, v)) for v in VARIANTS)
        if not own or not chosen:
            continue
        routes = ", ".join(
            f"{r['fromRows']}-{r['toRows'] or ''} {r['path']}"
            for r in (chosen.get("paths") or {}).get("routes", [])
        )
        convert = (chosen.get("paths") or {}).get("conversionMillis")
        out.append(
            f"  {family:<9} 1 row {own['one_row_ms']:7.2f} -> {chosen['one_row_ms']:6.2f} ms"
            f"  {BATCH_ROWS} rows {own['batch_ms']:7.2f} -> {chosen['batch_ms']:6.2f} ms"
            f"  {own['rps']:7.0f} -> {chosen['rps']:7.0f} req/s "
            f"({chosen['rps'] / own['rps']:.1f} x)"
            f"  paths: {routes}; converted in {convert} ms"
        )
    reference = section.get(REFERENCE)
    if reference:
        out.append(
            f"  {REFERENCE} (the reference LinearRegression, the server's ceiling for "
            f"one-row requests): {reference['rps']:7.0f} req/s"
        )
    return out


def targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    """RandomForest-300 one-row req/s >= 20 x its own predict's; no family slower than its own
    predict at one row or at a full batch."""
    if not section:
        return []
    own, chosen = (section.get(model_name("forest", v)) for v in VARIANTS)
    rows: list[tuple[str, str, bool | None]] = []
    if own and chosen:
        # One client waiting for each answer (req/s = 1 / latency), and many connections, whose
        # one-row requests the server batches.
        ratio = own["one_row_ms"] / chosen["one_row_ms"]
        rows.append(
            (
                "trees: RandomForest-300 one-row req/s >= 20 x own predict, one client",
                f"{ratio:.1f} x",
                ratio >= 20,
            )
        )
        ratio = chosen["rps"] / own["rps"]
        reference = section.get(REFERENCE)
        ceiling = f" ({chosen['rps'] / reference['rps']:.0%} of {REFERENCE}'s)" if reference else ""
        rows.append(
            (
                "trees: RandomForest-300 one-row req/s >= 20 x own predict, closed loop",
                f"{ratio:.1f} x{ceiling}",
                ratio >= 20,
            )
        )
    slower = []
    for family in FAMILIES:
        o, c = (section.get(model_name(family, v)) for v in VARIANTS)
        routes = (c or {}).get("paths") or {}
        if {r["path"] for r in routes.get("routes", [])} == {"own"}:
            continue  # the chosen path is the own predict: the two differ only by noise
        if o and c:
            for key in ("one_row_ms", "batch_ms"):
                if c[key] > o[key] * 1.05:  # 5 %: the noise of a median of sequential requests
                    slower.append(f"{family} {key}")
    rows.append(
        (
            "trees: no family slower than its own predict (1 row, 32 rows)",
            ", ".join(slower) or "none slower",
            not slower,
        )
    )
    return rows
