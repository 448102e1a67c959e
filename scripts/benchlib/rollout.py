"""The rollout section (``--only rollout``): the reference hot pattern with the hot model's
versions rolled out, on servers of its own.

The store is the reference one with ``sklearn-0`` made a model with three versions (each the
reference archive: ``sklearn-0/1.tar.gz`` ... ``3.tar.gz``, version 3 the default), written into
the section's temporary folder. wrk's hot pattern (90 % of requests to ``sklearn-0``, closed
loop, ``--concurrency`` connections) runs per run, in an order that rotates from run to run:

- ``base``: no canary, no shadow;
- ``canary``: version 2 takes 10 % of ``sklearn-0``'s requests (``set-canary?percent=10``);
- ``shadow``: every ``sklearn-0`` request also runs on version 1 after its answer
  (``set-shadow?percent=100``);

- ``capture``: on a second server running beside the first, with ``--capture-path`` (a local
  folder) and ``option.capture_percent=100`` for ``sklearn-0``, every ``sklearn-0`` request and
  answer captured (in the same rotation as the other cases, so a machine that grows busier or
  quieter during the section does not pass for the capture's cost).

Targets: the canary costs at most 5 % of the base's throughput, the capture
at most 10 %, and the primary's p99 with the shadow at most 1.5 x the base's.

Then, with no load, the time from a ``set-default`` call to the first request answered by the
new version (told by the Open Inference Protocol answer's ``model_version``): to a version
already loaded (warm), and to one that is not (the call loads it first).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run, rotated
from mmserver.commands.loadtest import wrk
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

HOT = "sklearn-0"
CASES = ("base", "canary", "shadow", "capture")
V2_BODY = json.dumps(
    {"inputs": [{"name": "input-0", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]}
).encode()
#: Requests sent after a switch before giving up on seeing the new version answer.
SWITCH_TRIES = 1000


def make_store(reference: Path, folder: Path) -> Path:
    """The reference store with ``sklearn-0`` as a model of three versions."""
    folder.mkdir(parents=True)
    for archive in reference.glob("sklearn-*.tar.gz"):
        if archive.name != f"{HOT}.tar.gz":
            shutil.copy(archive, folder / archive.name)
    hot = folder / HOT
    hot.mkdir()
    for version in (1, 2, 3):
        shutil.copy(reference / f"{HOT}.tar.gz", hot / f"{version}.tar.gz")
    (hot / "serving.properties").write_text("option.capture_percent=100\n")
    return folder


def _call(client: Client, method: str, path: str) -> None:
    status, body, _ = client.request(method, path)
    if status != 200:
        raise RuntimeError(f"{method} {path} answered {status}: {body[:200]!r}")


def _set_case(client: Client, case: str) -> None:
    _call(client, "PUT", f"/models/{HOT}/2/set-canary?percent={10 if case == 'canary' else 0}")
    _call(client, "PUT", f"/models/{HOT}/1/set-shadow?percent={100 if case == 'shadow' else 0}")


def _hot(server: servers.Server, settings: Settings, run: int) -> wrk.Load:
    return wrk.Load(
        url=server.url,
        pattern="hot",
        duration_s=settings.duration_s,
        connections=settings.concurrency,
        threads=settings.threads,
        seed=run + 1,
    )


def _warm(client: Client) -> None:
    for i in range(1000):
        client.predict(f"sklearn-{i}")
    for version in (1, 2, 3):
        client.predict(f"{HOT}/{version}")


def _comparisons(client: Client) -> dict[str, float]:
    """``mmserver_shadow_comparisons_total`` of the hot model, by result."""
    _, text, _ = client.request("GET", "/metrics")
    counts = {}
    for line in text.decode().splitlines():
        if line.startswith("mmserver_shadow_comparisons_total{") and f'model="{HOT}"' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = float(line.rsplit(" ", 1)[1])
    return counts


def _answered_by(client: Client) -> str:
    status, body, _ = client.request("POST", f"/v2/models/{HOT}/infer", V2_BODY, JSON_HEADERS)
    if status != 200:
        raise RuntimeError(f"V2 inference answered {status}: {body[:200]!r}")
    return str(json.loads(body)["model_version"])


def _switch(client: Client, version: int) -> dict[str, float]:
    """Seconds from a set-default call to the first answer by ``version``, and the call's."""
    started = time.perf_counter()
    _call(client, "PUT", f"/models/{HOT}/{version}/set-default")
    called = time.perf_counter()
    for _ in range(SWITCH_TRIES):
        if _answered_by(client) == str(version):
            break
    else:
        raise RuntimeError(f"version {version} never answered after the switch")
    return {"call_s": called - started, "first_answer_s": time.perf_counter() - started}


def switch_times(server: servers.Server) -> dict[str, dict[str, float]]:
    """The warm and the cold switch, each back to version 3 after."""
    client = Client(server.port, timeout=120)
    try:
        client.predict(f"{HOT}/1")  # loaded: the warm switch
        warm = _switch(client, 1)
        _call(client, "PUT", f"/models/{HOT}/3/set-default")
        _call(client, "DELETE", f"/models/{HOT}/2")  # not loaded: the cold switch
        cold = _switch(client, 2)
        _call(client, "PUT", f"/models/{HOT}/3/set-default")
    finally:
        client.close()
    return {"warm": warm, "cold": cold}


def run(
    reference: Path,
    tmp: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    model_store = make_store(reference, tmp / "rollout-store")
    runs: list[dict[str, Any]] = []
    server = servers.mmserver(
        model_store, tmp / "rollout-cache", out / "rollout-server.log", extra, exe
    )
    captured = tmp / "rollout-captured"
    capturing = servers.mmserver(
        model_store,
        tmp / "rollout-capture-cache",
        out / "rollout-capture-server.log",
        [*extra, "--capture-path", str(captured)],
        exe,
    )
    with server, capturing:
        log(f"rollout section: mmserver pid {server.pid} on {server.url}")
        log(f"rollout section: capturing mmserver pid {capturing.pid} on {capturing.url}")
        client = Client(server.port)
        capture_client = Client(capturing.port)
        try:
            _warm(client)
            _warm(capture_client)
            for r in range(settings.runs):
                result: dict[str, Any] = {}
                for case in rotated(CASES, r):
                    target = capturing if case == "capture" else server
                    if case != "capture":
                        _set_case(client, case)
                    load = _hot(target, settings, r)
                    before = _comparisons(client)
                    measured = wrk.run(load, target.pid, settings.quiet_wait_s)
                    log(describe_run(f"rollout run {r + 1}: {case}", load, measured))
                    result[case] = measured.to_json()
                    if case == "shadow":
                        after = _comparisons(client)
                        result["shadow_runs"] = {
                            k: after[k] - before.get(k, 0.0) for k in sorted(after)
                        }
                        log(f"rollout run {r + 1}: shadow comparisons {result['shadow_runs']}")
                runs.append(result)
            _set_case(client, "base")
        finally:
            client.close()
            capture_client.close()
        switches = switch_times(server)
        log(
            "rollout switch: warm {:.1f} ms, cold {:.1f} ms to the first answer".format(
                switches["warm"]["first_answer_s"] * 1000, switches["cold"]["first_answer_s"] * 1000
            )
        )
    lines = sum(1 for path in captured.rglob("*.jsonl") for _ in path.open())
    return {"runs": runs, "switch": switches, "captured_records": lines}


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _frontend_us(measured: dict[str, Any]) -> float:
    """Microseconds of the server's main process's CPU per answered request in a run."""
    rps = float(measured["rps"])
    return float(measured["cpu"].get("server", 0.0)) / 100 / rps * 1e6 if rps else 0.0


def summary_lines(raw: dict[str, Any]) -> list[str]:
    """The section's lines of the table (medians over the runs) and its three targets."""
    runs = raw["runs"]
    cases = CASES
    rps = {c: _median([r[c]["rps"] for r in runs if c in r]) for c in cases}
    p99 = {c: _median([r[c]["p99_ms"] for r in runs if c in r]) for c in cases}
    lines = ["", f"rollout (hot pattern, {HOT} with 3 versions; medians of {len(runs)} run(s))"]
    for case in cases:
        if rps[case] is not None and p99[case] is not None:
            lines.append(f"  {case:<8} {rps[case]:8.0f} req/s  p99 {p99[case]:7.2f} ms")
    base_rps, base_p99 = rps["base"], p99["base"]
    if base_rps and base_p99:
        for case, limit in (("canary", 0.05), ("capture", 0.10)):
            value = rps[case]
            if value is not None:
                cost = 1 - value / base_rps
                verdict = "PASS" if cost <= limit else "MISS"
                lines.append(
                    f"  {verdict}  {case} costs <= {limit:.0%} of the base's req/s ({cost:+.1%})"
                )
        spent = {c: _median([_frontend_us(r[c]) for r in runs if c in r]) for c in cases}
        if spent["base"] is not None and spent["capture"] is not None:
            lines.append(
                f"  the frontend's CPU a request: capture {spent['capture']:.1f} us, "
                f"base {spent['base']:.1f} us"
            )
        shadow = p99["shadow"]
        if shadow is not None:
            ratio = shadow / base_p99
            verdict = "PASS" if ratio <= 1.5 else "MISS"
            lines.append(
                f"  {verdict}  p99 with a 100 % shadow <= 1.5 x the base's ({ratio:.2f} x)"
            )
    compared = [r["shadow_runs"] for r in runs if "shadow_runs" in r]
    if compared:
        total = {k: sum(c.get(k, 0.0) for c in compared) for k in sorted(set().union(*compared))}
        shown = ", ".join(f"{k} {v:.0f}" for k, v in total.items())
        lines.append(f"  shadow runs during the shadow case: {shown}")
    switch = raw["switch"]
    lines.append(
        "  set-default to the first answer by the new version: warm "
        f"{switch['warm']['first_answer_s'] * 1000:.1f} ms, cold (loaded by the call) "
        f"{switch['cold']['first_answer_s'] * 1000:.1f} ms; captured records "
        f"{raw['captured_records']}"
    )
    return lines
