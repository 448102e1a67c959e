"""The tabular section: a scikit-learn pipeline fitted on a pandas DataFrame, served by mmserver
and (with ``--peer mlserver``) by MLServer's scikit-learn runtime with its pandas codec.

The models (written by :func:`ensure` into the store, seeded, once per library versions):
``Pipeline([("prep", ColumnTransformer([("cat", OneHotEncoder(handle_unknown="ignore"),
["city", "device", "plan"]), ("num", Pipeline([("impute", SimpleImputer()), ("scale",
StandardScaler())]), ["x1", ..., "x7"])])), ("model", ...)])`` fitted on a DataFrame of
:data:`TRAIN_ROWS` rows, 10 columns (three of strings, seven of numbers with about 10 % NaN),
the model a LogisticRegression (``bench-tabular-logistic``) and a HistGradientBoostingClassifier
of 100 iterations (``bench-tabular-histgb``).

Two request forms, one record a request:

- ``records``: mmserver gets ``POST /predictions/NAME`` with ``[{"city": ..., "x1": ...}]``.
  MLServer's REST API has no such path (it takes only the Open Inference Protocol), so its
  figure for this form is its V2 request below, measured again next to mmserver's records run.
- ``v2 columns``: ``POST /v2/models/NAME/infer`` with one input per column and
  ``"parameters": {"content_type": "pd"}``. mmserver gets the form of the issue (shape ``[1]``,
  strings as BYTES); MLServer gets what its ``PandasCodec.encode_request`` writes for the same
  DataFrame (shape ``[1, 1]``, each BYTES input with ``"content_type": "str"``, which its string
  codec needs to hand the pipeline ``str`` rather than raw values).

Before any timing one request of each form goes to each server: its status and answer are
printed, and compared with the pipeline's own ``predict`` on the same DataFrame here. A form a
server does not answer with 200 is not timed on that server. Then, per model and form,
``runs`` closed-loop wrk runs (``concurrency`` connections, one request body), mmserver and
MLServer alternated (which goes first swaps from run to run); medians.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchlib.loads import Log, Settings, describe_run
from benchlib.servers import Server
from mmserver.commands.loadtest import wrk
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

MODELS = {"logistic": "bench-tabular-logistic", "histgb": "bench-tabular-histgb"}
FORMS = ("records", "v2 columns")
CATEGORICAL = ("city", "device", "plan")
NUMERIC = tuple(f"x{i}" for i in range(1, 8))
COLUMNS = CATEGORICAL + NUMERIC
CITIES = ("paris", "london", "berlin", "madrid", "rome", "lisbon", "vienna", "prague")
DEVICES = ("ios", "android", "web")
PLANS = ("free", "basic", "pro", "team")
TRAIN_ROWS = 5000
MISSING_SHARE = 0.1
SEED = 29
STAMP = ".bench-tabular"

#: The one record every request sends (no missing value: MLServer's FP64 inputs take no null).
ROW: dict[str, Any] = {
    "city": "paris",
    "device": "ios",
    "plan": "pro",
    "x1": 1.5,
    "x2": -0.3,
    "x3": 0.25,
    "x4": 2.0,
    "x5": -1.1,
    "x6": 0.7,
    "x7": 0.05,
}

#: The issue's targets on this 2-core machine.
RATIO_TARGET = 5.0
P99_TARGET_MS = 20.0


def ensure(store: Path) -> None:
    """Write the section's models into ``store`` unless these library versions did."""
    import joblib
    import numpy as np
    import pandas as pd
    import sklearn
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    want = f"sklearn={sklearn.__version__} pandas={pd.__version__} seed={SEED}\n"
    stamp = store / STAMP
    if (
        stamp.is_file()
        and stamp.read_text() == want
        and all((store / name / "model.joblib").is_file() for name in MODELS.values())
    ):
        return
    rng = np.random.default_rng(SEED)
    frame = pd.DataFrame(
        {
            "city": rng.choice(CITIES, TRAIN_ROWS),
            "device": rng.choice(DEVICES, TRAIN_ROWS),
            "plan": rng.choice(PLANS, TRAIN_ROWS),
            **{name: rng.normal(0.0, 1.0, TRAIN_ROWS) for name in NUMERIC},
        }
    )
    plan_effect = frame["plan"].map({"free": -1.0, "basic": 0.0, "pro": 0.8, "team": 1.2})
    device_effect = frame["device"].map({"ios": 0.4, "android": 0.0, "web": -0.3})
    logit = (
        plan_effect
        + device_effect
        + 0.9 * frame["x1"]
        - 0.6 * frame["x2"]
        + 0.4 * frame["x3"] * frame["x4"]
        + 0.3 * np.sin(3 * frame["x5"])
    )
    target = (rng.random(TRAIN_ROWS) < 1 / (1 + np.exp(-logit.to_numpy()))).astype(int)
    for name in NUMERIC:  # missing values, after the target was drawn from the true ones
        frame.loc[rng.random(TRAIN_ROWS) < MISSING_SHARE, name] = np.nan
    estimators = {
        "logistic": LogisticRegression(max_iter=1000),
        "histgb": HistGradientBoostingClassifier(max_iter=100, random_state=SEED),
    }
    for key, estimator in estimators.items():
        prep = ColumnTransformer(
            [
                ("cat", OneHotEncoder(handle_unknown="ignore"), list(CATEGORICAL)),
                (
                    "num",
                    Pipeline([("impute", SimpleImputer()), ("scale", StandardScaler())]),
                    list(NUMERIC),
                ),
            ]
        )
        pipeline = Pipeline([("prep", prep), ("model", estimator)]).fit(frame, target)
        folder = store / MODELS[key]
        folder.mkdir(parents=True, exist_ok=True)
        joblib.dump(pipeline, folder / "model.joblib")
    stamp.write_text(want)


def expected(store: Path, name: str) -> Any:
    """The pipeline's own ``predict`` on :data:`ROW` as a DataFrame, here."""
    import joblib
    import pandas as pd

    pipeline = joblib.load(store / name / "model.joblib")
    return pipeline.predict(pd.DataFrame([ROW]))[0].item()


def records_body() -> str:
    return json.dumps([ROW])


def v2_body() -> str:
    """The issue's V2 form: one input per column, shape [1], strings as BYTES."""
    inputs = [
        {
            "name": name,
            "datatype": "BYTES" if name in CATEGORICAL else "FP64",
            "shape": [1],
            "data": [ROW[name]],
        }
        for name in COLUMNS
    ]
    return json.dumps({"inputs": inputs, "parameters": {"content_type": "pd"}})


def mlserver_v2_body() -> str:
    """What MLServer's ``PandasCodec.encode_request(df, use_bytes=False)`` writes for
    :data:`ROW` (a DataFrame of object and float64 columns): shape [1, 1], and each BYTES input
    marked ``"content_type": "str"`` for its string codec."""
    inputs = []
    for name in COLUMNS:
        entry: dict[str, Any] = {
            "name": name,
            "shape": [1, 1],
            "datatype": "BYTES" if name in CATEGORICAL else "FP64",
        }
        if name in CATEGORICAL:
            entry["parameters"] = {"content_type": "str"}
        entry["data"] = [ROW[name]]
        inputs.append(entry)
    return json.dumps({"parameters": {"content_type": "pd"}, "inputs": inputs})


def request_of(server: str, form: str, model: str) -> tuple[str, str, str]:
    """(api, path, body) of one request of ``form`` to ``server`` (mmserver or mlserver)."""
    v2_path = f"/v2/models/{model}/infer"
    if server == "mlserver":
        return "v2", v2_path, mlserver_v2_body()
    if form == "records":
        return "djl", f"/predictions/{model}", records_body()
    return "v2", v2_path, v2_body()


def _prediction(server: str, form: str, answer: Any) -> Any:
    """The one prediction in an answer: the DJL path's list, or a V2 answer's first output."""
    if server == "mmserver" and form == "records":
        if isinstance(answer, dict) and "predictions" in answer:
            answer = answer["predictions"]
        while isinstance(answer, list) and answer:
            answer = answer[0]
        return answer
    data = answer["outputs"][0]["data"]
    while isinstance(data, list) and data:
        data = data[0]
    return data


def check(
    targets: dict[str, Server], store: Path, log: Log
) -> dict[str, dict[str, dict[str, Any]]]:
    """One request of each form to each server and model: status, answer, prediction, and
    whether it equals the pipeline's own predict here. Also (not timed) the MLServer codec's
    V2 form sent to mmserver, to see whether mmserver takes it as well."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key, model in MODELS.items():
        want = expected(store, model)
        log(f"tabular {key} ({model}): the pipeline's own predict here: {want!r}")
        out[key] = {"expected": {"prediction": want}}
        cases = [(name, form) for form in FORMS for name in targets]
        if "mmserver" in targets:
            cases.append(("mmserver", "mlserver's v2"))
        for name, form in cases:
            if form == "mlserver's v2":
                path, body = f"/v2/models/{model}/infer", mlserver_v2_body()
            else:
                _, path, body = request_of(name, form, model)
            client = Client(targets[name].port, timeout=60.0)
            try:
                status, data, seconds = client.request("POST", path, body.encode(), JSON_HEADERS)
            finally:
                client.close()
            text = data.decode(errors="replace")
            entry: dict[str, Any] = {
                "status": status,
                "path": path,
                "answer": text[:600],
                "ms": seconds * 1e3,
            }
            if status == 200:
                try:
                    entry["prediction"] = _prediction(name, form, json.loads(data))
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    entry["prediction"] = None
                    entry["unreadable"] = repr(exc)
                entry["matches"] = entry["prediction"] == want
            out[key][f"{name} {form}"] = entry
            log(f"  {name:<8} {form:<14} POST {path} -> {status}: {text[:300]}")
    return out


def run(
    server: Server,
    peer: Server | None,
    store: Path,
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    """The check, then ``settings.runs`` alternated closed-loop runs per model and form."""
    targets = {"mmserver": server} | ({peer.name: peer} if peer is not None else {})
    checked = check(targets, store, log)
    out: dict[str, Any] = {"check": checked, "loads": {}}
    for key in MODELS:
        out["loads"][key] = {form: {name: [] for name in targets} for form in FORMS}
    for r in range(settings.runs):
        log(f"tabular, run {r + 1}/{settings.runs}")
        for key, model in MODELS.items():
            for form in FORMS:
                order = list(targets.items())
                if r % 2:
                    order.reverse()
                for name, target in order:
                    if checked[key][f"{name} {form}"]["status"] != 200:
                        continue  # refused at the check: nothing to time
                    api, _, body = request_of(name, form, model)
                    load = wrk.Load(
                        url=target.url,
                        pattern="single",
                        model=model,
                        duration_s=settings.duration_s,
                        connections=settings.concurrency,
                        threads=settings.threads,
                        api=api,
                        seed=r + 1,
                        body=body,
                        raw_body=True,
                    )
                    result = wrk.run(load, target.pid, settings.quiet_wait_s)
                    out["loads"][key][form][name].append(result.to_json())
                    log(describe_run(name, load, result) + f"  ({key}, {form})")
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def lines(section: dict[str, Any]) -> list[str]:
    """The section's table: per model and form, each server's medians and mmserver / MLServer;
    then the check's answers."""
    out = [
        "",
        "Tabular: a DataFrame pipeline (one-hot city/device/plan, imputed and scaled x1..x7), "
        "one record a request,",
        "closed loop (latency in ms, medians over runs, errors summed). MLServer's REST API takes "
        "no records:",
        "its 'records' row is its V2 pandas-codec request, run beside mmserver's records run.",
        f"  {'model':<9}{'form':<12}{'server':<10}{'req/s':>8}{'p50':>8}{'p90':>8}{'p99':>8}"
        f"{'max':>8}  {'cpu % srv+ch/wrk/other':<22} errors",
    ]
    for key in MODELS:
        for form in FORMS:
            entry = section.get("loads", {}).get(key, {}).get(form, {})
            for name in ("mmserver", "mlserver"):
                r = entry.get(name)
                if not r:
                    continue
                cpu = r["cpu"]
                server, children, wrk_cpu, other = (
                    _fmt(cpu.get(k), ".0f") for k in ("server", "server_children", "wrk", "other")
                )
                usage = f"{server}+{children}/{wrk_cpu}/{other}"
                errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
                out.append(
                    f"  {key:<9}{form:<12}{name:<10}{_fmt(r['rps'], '.0f'):>8}"
                    f"{_fmt(r['p50_ms'], '.2f'):>8}{_fmt(r['p90_ms'], '.2f'):>8}"
                    f"{_fmt(r['p99_ms'], '.2f'):>8}{_fmt(r['max_ms'], '.1f'):>8}  {usage:<22} "
                    f"{errors}"
                )
            ratio = entry.get("ratio")
            if ratio is not None:
                out.append(f"  {'':<21}mmserver / mlserver: {ratio:.2f} x the requests per second")
    out.append("  single requests before the runs (status, prediction; expected = own predict):")
    for key, cases in section.get("check", {}).items():
        want = cases.get("expected", {}).get("prediction")
        for case, entry in cases.items():
            if case == "expected":
                continue
            if entry["status"] == 200:
                verdict = "equal" if entry.get("matches") else "DIFFERENT"
                what = f"{entry.get('prediction')!r} ({verdict} to {want!r})"
            else:
                what = entry["answer"][:200]
            out.append(f"    {key:<9}{case:<24} {entry['status']}  {what}")
    return out


def targets(section: dict[str, Any] | None) -> list[tuple[str, str, bool | None]]:
    """Per model and form: mmserver >= 5 x MLServer's req/s; mmserver's p99 <= 20 ms, 0 errors."""
    if not section:
        return []
    rows: list[tuple[str, str, bool | None]] = []
    for key in MODELS:
        for form in FORMS:
            entry = section.get("loads", {}).get(key, {}).get(form, {})
            server = entry.get("mmserver")
            checked = section.get("check", {}).get(key, {}).get(f"mmserver {form}", {})
            label = f"tabular {key} {form}:"
            if server is None:
                refused = f"not timed: answered {checked.get('status')}" if checked else "-"
                rows.append((f"{label} >= {RATIO_TARGET:g} x MLServer req/s", refused, False))
                rows.append((f"{label} p99 <= {P99_TARGET_MS:g} ms, 0 errors", refused, False))
                continue
            ratio = entry.get("ratio")
            peer = entry.get("mlserver")
            rows.append(
                (
                    f"{label} >= {RATIO_TARGET:g} x MLServer req/s",
                    f"{_fmt(ratio, '.2f')} x ({_fmt(server['rps'], '.0f')} vs "
                    f"{_fmt(peer['rps'] if peer else None, '.0f')} req/s)",
                    None if ratio is None else ratio >= RATIO_TARGET,
                )
            )
            p99 = server["p99_ms"]
            rows.append(
                (
                    f"{label} p99 <= {P99_TARGET_MS:g} ms, 0 errors",
                    f"{_fmt(p99, '.1f')} ms, {server['error_count']} errors",
                    p99 is not None and p99 <= P99_TARGET_MS and server["error_count"] == 0,
                )
            )
    return rows
