"""The envs section (opt-in, ``--only envs``): what a model's own environment costs. One
RandomForestRegressor of 100 trees of depth 10 on 8 features (``scripts/tree_models.py``),
pickled by the server's scikit-learn, in two folders of a store of the section's own:
``bench-main-forest`` as it is, and ``bench-env-forest`` with a ``requirements.txt`` pinning the
server's scikit-learn, NumPy and SciPy plus one small package the server lacks (``toolz``), so
that its environment is built and holds the same versions as the server's.

Measured, each with a server of its own and a fresh ``env_dir`` (one run each: a build is the
measurement), the time of the first request of ``bench-env-forest`` (its environment built, its
fork server and backend process started, the model loaded, one row answered):

- uv with an empty cache (``UV_CACHE_DIR`` fresh: every wheel downloaded from the index);
- uv with that cache warm (a machine that built such an environment before);
- pip (``--env-installer pip``: ``python -m venv``, then pip, its own cache as configured);
- the environment built already (a restart: the server finds it);

and, in that last server, the first request of ``bench-main-forest`` (the server's environment)
and the closed-loop req/s of one-row requests of each model (wrk, the bench's concurrency;
median of the runs), one after the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchlib import servers
from benchlib.loads import Log, Settings
from benchlib.trees import closed_loop, rows_body
from mmserver.commands.loadtest import cpu
from mmserver.commands.loadtest.client import JSON_HEADERS, Client

MAIN, ENV = "bench-main-forest", "bench-env-forest"
TREES, DEPTH = 100, 10
#: The cases of the first request of the model in its environment, in the order they run.
FIRST = ("uv, empty cache", "uv, warm cache", "pip", "built already")


def write_store(store: Path) -> None:
    """The section's two models."""
    import numpy
    import scipy
    import sklearn
    import tree_models

    model = tree_models.forest(TREES, DEPTH)
    model.n_jobs = None
    tree_models.write_pickle(store / MAIN, model)
    tree_models.write_pickle(store / ENV, model)
    (store / ENV / "requirements.txt").write_text(
        f"scikit-learn=={sklearn.__version__}\nnumpy=={numpy.__version__}\n"
        f"scipy=={scipy.__version__}\ntoolz\n"
    )


def _first(server: servers.Server, model: str) -> float:
    """Seconds of the first request of ``model`` (its load included)."""
    client = Client(server.port, timeout=1800.0)
    try:
        status, body, seconds = client.request(
            "POST", f"/predictions/{model}", rows_body(1), JSON_HEADERS
        )
    finally:
        client.close()
    if status != 200:
        raise RuntimeError(f"{model} answered {status}: {body[:300]!r}")
    return seconds


def run(
    reference: Path,
    tmp: Path,
    out: Path,
    extra: list[str],
    exe: Path | None,
    settings: Settings,
    log: Log,
) -> dict[str, Any]:
    store = tmp / "store"
    store.mkdir()
    write_store(store)
    uv_cache = tmp / "uv-cache"
    kept = tmp / "envs-kept"  # the warm-cache build, found by the last server
    dirs = {
        "uv, empty cache": tmp / "envs-uv-cold",
        "uv, warm cache": kept,
        "pip": tmp / "envs-pip",
        "built already": kept,
    }
    result: dict[str, Any] = {"first_request_s": {}}
    for case in FIRST:
        args = [*extra, "--env-dir", str(dirs[case])]
        if case == "pip":
            args += ["--env-installer", "pip"]
        log_path = out / f"envs-{case.replace(', ', '-').replace(' ', '-')}.log"
        server = servers.mmserver(
            store,
            tmp / f"cache-{len(result['first_request_s'])}",
            log_path,
            args,
            exe,
            env={"UV_CACHE_DIR": str(uv_cache)},
        )
        with server:
            cpu.wait_quiet(settings.quiet_wait_s)
            seconds = _first(server, ENV)
            result["first_request_s"][case] = seconds
            log(f"envs section: first request of {ENV} ({case}): {seconds:.2f} s")
            if case != "built already":
                continue
            result["first_request_s"]["main environment"] = _first(server, MAIN)
            one = rows_body(1).decode()
            result["rps"] = {
                label: closed_loop(server, settings, log, name, f"envs/{label}", one)
                for label, name in (("main environment", MAIN), ("own environment", ENV))
            }
    return result


def summary_lines(section: dict[str, Any]) -> list[str]:
    first = section["first_request_s"]
    lines = [
        "",
        f"Environments: a RandomForestRegressor ({TREES} trees, depth {DEPTH}) whose "
        "requirements.txt the server does not meet; its first request (environment built, "
        "processes started, model loaded):",
    ]
    lines += [f"  {case:<18} {seconds:8.2f} s" for case, seconds in first.items()]
    rps = section.get("rps", {})
    if rps:
        main, own = rps["main environment"], rps["own environment"]
        lines.append(
            f"  one-row req/s, same model: main environment {main:.0f}, own environment "
            f"{own:.0f} ({own / main:.2f} x)"
        )
    return lines
