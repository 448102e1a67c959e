"""The explain section (opt-in, ``--only explain``; needs ``pip install -e '.[explain,xgboost]'``):
one-row explanations beside one-row predictions of the same model, through HTTP (one client,
sequential; medians). Models (``scripts/tree_models.py``, 8 features): a RandomForestRegressor
of 200 trees of depth 10 (TreeSHAP by shap's TreeExplainer) and an XGBoost booster of 200 trees
(its own ``pred_contribs``). Each model's explanation is asked for through KServe's explain verb
and through SageMaker's ``X-Amzn-SageMaker-Enable-Explanations`` header.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchlib.loads import Log, Settings
from benchlib.servers import Server
from benchlib.trees import ONE_ROW_REQUESTS, latencies, rows_body, stale_stamp
from mmserver.commands.loadtest import cpu
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

MODELS = {"forest": "bench-explain-forest", "xgboost": "bench-explain-xgboost"}
STAMP = ".bench-explain"
TREES, DEPTH = 200, 10
#: Targets, ms: a forest's row explained, a booster's row explained (medians through HTTP).
TARGET_MS = {"forest": 20.0, "xgboost": 5.0}
CLARIFY_HEADERS = {**JSON_HEADERS, "X-Amzn-SageMaker-Enable-Explanations": "`true`"}


def ensure(store: Path) -> None:
    """Write the section's models into ``store`` unless these library versions did."""
    import tree_models

    stamp = store / STAMP
    versions = stale_stamp(stamp, "explain", ("shap", "xgboost"), "explain,xgboost")
    if versions is None:
        return
    forest = tree_models.forest(TREES, DEPTH)
    forest.n_jobs = None  # one thread, as a served model usually runs
    tree_models.write_pickle(store / MODELS["forest"], forest)
    tree_models.write_xgboost(store / MODELS["xgboost"], tree_models.xgboost_booster(TREES))
    stamp.write_text(versions)


def run(server: Server, settings: Settings, log: Log) -> dict[str, Any]:
    """Per model the median one-row latency: predicted, explained (KServe, SageMaker)."""
    one = rows_body(1)
    out: dict[str, Any] = {}
    client = Client(server.port, timeout=120.0)
    try:
        for label, name in MODELS.items():
            ways = {
                "predict_ms": (f"/predictions/{name}", JSON_HEADERS),
                "kserve_ms": (f"/v1/models/{name}:explain", JSON_HEADERS),
                "clarify_ms": (f"/models/{name}/invoke", CLARIFY_HEADERS),
            }
            for path, headers in ways.values():
                latencies(client, name, one, 5, path, headers)  # load, build the explainer, warm
            cpu.wait_quiet(settings.quiet_wait_s)
            out[label] = {
                key: statistics.median(
                    latencies(client, name, one, ONE_ROW_REQUESTS, path, headers)
                )
                for key, (path, headers) in ways.items()
            }
            out[label]["explanation"] = (client.describe(name) or {}).get("explanation")
            log(f"explain/{label}: {out[label]}")
    finally:
        client.close()
    return out


def lines(section: dict[str, Any]) -> list[str]:
    """The section's table: a row predicted against a row explained, per model."""
    out = [
        "",
        "Explain: one-row request latency (one client, medians), predicted -> explained "
        "(KServe's :explain; SageMaker's Enable-Explanations header)",
    ]
    for label in MODELS:
        row = section.get(label)
        if not row:
            continue
        method = (row.get("explanation") or {}).get("method")
        out.append(
            f"  {label:<8} {row['predict_ms']:6.2f} ms -> {row['kserve_ms']:6.2f} ms "
            f"(SageMaker {row['clarify_ms']:6.2f} ms)  {method}; target <= "
            f"{TARGET_MS[label]:.0f} ms"
        )
    return out
