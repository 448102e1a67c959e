"""The onnx section (opt-in, ``--only onnx``; needs ``pip install -e '.[onnx,test]'``): one
RandomForestRegressor of 100 trees of depth 10 on 8 features (``scripts/tree_models.py``),
served twice, pickled (``bench-onnx-forest-pickle``: mmserver's verified paths) and converted
by skl2onnx (``bench-onnx-forest``: onnxruntime on one thread). Per model, as the trees section
measures: the latency of one-row and 32-row requests (one client, sequential; medians) and the
closed-loop req/s of one-row requests (wrk, ``concurrency`` connections; median of the runs).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchlib.loads import Log, Settings
from benchlib.servers import Server
from benchlib.trees import (
    BATCH_REQUESTS,
    BATCH_ROWS,
    ONE_ROW_REQUESTS,
    closed_loop,
    latencies,
    rows_body,
    stale_stamp,
)
from mmserver.commands.loadtest import cpu
from mmserver.commands.loadtest.client import Client

#: The two forms of the forest: label -> model name.
MODELS = {"pickle": "bench-onnx-forest-pickle", "onnx": "bench-onnx-forest"}
STAMP = ".bench-onnx"
TREES, DEPTH = 100, 10


def ensure(store: Path) -> None:
    """Write the section's models into ``store`` unless these library versions did."""
    import tree_models

    stamp = store / STAMP
    versions = stale_stamp(stamp, "onnx", ("skl2onnx", "onnxruntime"), "onnx,test")
    if versions is None:
        return
    forest = tree_models.forest(TREES, DEPTH)
    forest.n_jobs = None  # one thread, as a served model usually runs
    tree_models.write_pickle(store / MODELS["pickle"], forest)
    tree_models.write_onnx(store / MODELS["onnx"], forest)
    stamp.write_text(versions)


def run(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """Latencies and closed-loop req/s of each form, and the pickle's chosen paths."""
    one, batch = rows_body(1), rows_body(BATCH_ROWS)
    out: dict[str, Any] = {}
    client = Client(server.port, timeout=120.0)
    try:
        for label, name in MODELS.items():
            latencies(client, name, one, 5)  # load, warm
            cpu.wait_quiet(settings.quiet_wait_s)
            singles = latencies(client, name, one, ONE_ROW_REQUESTS)
            batches = latencies(client, name, batch, BATCH_REQUESTS)
            described = client.describe(name) or {}
            out[label] = {
                "one_row_ms": statistics.median(singles),
                "batch_ms": statistics.median(batches),
                "rps": closed_loop(server, settings, log, name, f"onnx/{label}", one.decode()),
                "paths": described.get("predictPaths"),
            }
    finally:
        client.close()
    return out


def lines(section: dict[str, Any]) -> list[str]:
    """The section's table: the pickled forest against its ONNX conversion."""
    out = [
        "",
        f"ONNX: a RandomForestRegressor ({TREES} trees, depth {DEPTH}) pickled (mmserver's "
        f"chosen paths) and as ONNX (onnxruntime, one thread); one-row and {BATCH_ROWS}-row "
        "request latency (one client, medians), closed-loop one-row req/s",
    ]
    for label in MODELS:
        row = section.get(label)
        if not row:
            continue
        routes = ", ".join(
            f"{r['fromRows']}-{r['toRows'] or ''} {r['path']}"
            for r in (row.get("paths") or {}).get("routes", [])
        )
        out.append(
            f"  {label:<7} 1 row {row['one_row_ms']:6.2f} ms  {BATCH_ROWS} rows "
            f"{row['batch_ms']:6.2f} ms  {row['rps']:7.0f} req/s  paths: {routes}"
        )
    return out
