"""Per-model environments in the real server (docs/operations.md, *Model environments*): a
forest pickled by scikit-learn 1.3.2 with a pinning requirements.txt answers what 1.3.2 answers,
its environment built while a neighbour keeps answering; two models asking for one set share
one build; a set the server meets builds nothing; a requirement that cannot be installed fails
its model only, naming the package; a restart reuses what was built; ``mmserver envs build``
builds ahead of time; ``on_version_skew=env`` serves a pickle without requirements in an
environment pinned to the version that made it.

The old models are made by scikit-learn 1.3.2 itself, in the side environment ``scripts/test``
builds (``tests/old-sklearn.txt``). The environments are built from the package index pip is
configured with, with uv's cache under the repository's ``.cache`` (a rebuild is quick). The
environment is built once for the module; the first test holds its build open at a find-links
page served on loopback, so the neighbour's answers come while it is surely building."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aiohttp import web

from mmserver.commands.procfs import free_port
from mmserver.envs.building import find_uv
from tests.e2e.server_process import ROOT, ServerProcess, descendants, metric_total
from tests.integration.test_version_skew import _old_python
from tests.models import make_linear_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: What scikit-learn 1.3.2 makes, and what it answers itself.
_MAKE = """
import json, sys
import joblib, numpy as np, sklearn
from sklearn.ensemble import RandomForestClassifier

rng = np.random.default_rng(0)
X = rng.normal(size=(300, 4))
y = (X[:, 0] + X[:, 1] + rng.normal(scale=0.8, size=300) > 0).astype(int)
forest = RandomForestClassifier(n_estimators=25, max_depth=6, random_state=0).fit(X, y)
joblib.dump(forest, sys.argv[1])
rows = rng.normal(size=(6, 4))
print(json.dumps({
    "version": sklearn.__version__,
    "rows": rows.tolist(),
    "predict_proba": forest.predict_proba(rows).tolist(),
}))
"""

PINS = "scikit-learn==1.3.2\nnumpy==1.26.4\n"
MISSING = "mmserver-no-such-package-here"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("envs")
    store = root / "store"
    for name in ("old-forest", "old-twin"):
        (store / name).mkdir(parents=True)
    made = subprocess.run(
        [_old_python(), "-c", _MAKE, str(store / "old-forest" / "model.joblib")],
        capture_output=True,
        text=True,
        check=True,
    )
    answers: dict[str, Any] = json.loads(made.stdout)
    assert answers["version"] == "1.3.2"
    (store / "old-forest" / "requirements.txt").write_text(f"# pinned\n{PINS}")
    (store / "old-twin" / "model.joblib").write_bytes(
        (store / "old-forest" / "model.joblib").read_bytes()
    )
    # The same set, spelled and ordered otherwise: one environment for both.
    (store / "old-twin" / "requirements.txt").write_text("NumPy == 1.26.4\nscikit_learn==1.3.2\n")
    for name in ("old-forest", "old-twin"):
        (store / name / "serving.properties").write_text("option.method=predict_proba\n")
    make_linear_model(store / "neighbour")
    make_linear_model(store / "met")
    (store / "met" / "requirements.txt").write_text("numpy\nscikit-learn>=1.0\njoblib\n")
    # The same set, asked for by a model the operator does not trust.
    shutil.copytree(store / "old-forest", store / "stranger")
    make_linear_model(store / "uninstallable")
    (store / "uninstallable" / "requirements.txt").write_text(f"{MISSING}==9.9.9\n")
    return store, answers


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("environments")


class Gate:
    """A find-links page on loopback that answers only once released: a build that reads it
    is held open until then."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.released = asyncio.Event()
        self.url = ""

    async def page(self, request: web.Request) -> web.Response:
        self.asked.set()
        await self.released.wait()
        return web.Response(
            text="<html><body></body></html>",
            content_type="text/html",
            headers={"Cache-Control": "no-store"},
        )


@pytest.fixture
async def gate() -> AsyncIterator[Gate]:
    held = Gate()
    app = web.Application()
    app.router.add_get("/links/", held.page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    held.url = f"http://127.0.0.1:{port}/links/"
    try:
        yield held
    finally:
        held.released.set()
        await runner.cleanup()


def _env(find_links: str = "") -> dict[str, str | None]:
    links = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS"), find_links]))
    return {
        "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR") or str(ROOT / ".cache" / "uv"),
        "PIP_FIND_LINKS": links or None,
    }


#: The models whose requirements the operator lets the server install (a package's install and
#: its import run its code): not ``stranger``, and ``met`` needs no install.
TRUSTED = ("--trusted-models", "old-forest,old-twin,uninstallable")


def _server(
    store: Path, env_dir: Path, log: Path, find_links: str = "", *more: str
) -> ServerProcess:
    args = ("--backend-processes", "1", "--heavy-processes", "0", "--env-dir", str(env_dir))
    return ServerProcess(store, log, *args, *TRUSTED, *more, env=_env(find_links))


async def _post(session: aiohttp.ClientSession, url: str, rows: Any) -> tuple[int, Any]:
    async with session.post(url, json=rows) as response:
        return response.status, json.loads(await response.read())


async def _describe(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with session.get(f"{url}/models/{name}") as response:
        assert response.status == 200
        described: dict[str, Any] = json.loads(await response.read())[0]["models"][0]
        return described


def _env_processes(server_pid: int, env_dir: Path) -> list[list[str]]:
    """The command lines of the server's processes run by an environment's interpreter."""
    found = []
    for pid in descendants(server_pid):
        try:
            cmdline = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if cmdline and cmdline[0].startswith(str(env_dir)):
            found.append(cmdline)
    return found


async def test_an_old_forest_in_its_environment_answers_as_its_version_while_others_serve(
    store: tuple[Path, dict[str, Any]], env_dir: Path, gate: Gate, tmp_path: Path
) -> None:
    folder, answers = store
    rows = answers["rows"]
    async with _server(folder, env_dir, tmp_path / "server.log", gate.url) as child:
        url = child.url
        async with aiohttp.ClientSession() as session:
            neighbour = f"{url}/predictions/neighbour"
            assert (await _post(session, neighbour, [[0.5]]))[0] == 200
            first = asyncio.ensure_future(_post(session, f"{url}/predictions/old-forest", rows))
            await gate.asked.wait()  # the build is reading the index: it is under way
            for _ in range(20):
                status, body = await _post(session, neighbour, [[0.5]])
                assert status == 200, body
            building = await _describe(session, url, "old-forest")
            assert building["environment"]["state"] == "building"
            assert not first.done()
            gate.released.set()
            status, body = await first
            assert status == 200, body
            assert body["predictions"] == answers["predict_proba"]  # 1.3.2's own, value for value

            described = await _describe(session, url, "old-forest")
            environment = described["environment"]
            assert environment["state"] == "ready"
            assert environment["requirements"] == ["numpy==1.26.4", "scikit-learn==1.3.2"]
            versions = environment["versions"]
            assert versions["scikit-learn"] == "1.3.2" and versions["numpy"] == "1.26.4"
            # Only the model's requirements and what every environment has: the backend side
            # of mmserver runs there without the frontend's libraries.
            for library in ("aiohttp", "pandas", "prometheus-client", "setproctitle"):
                assert library not in versions
            assert described["lane"] == f"env-{environment['id'][:8]}"
            assert "trainedWith" not in described  # read by the version that made it
            processes = _env_processes(child.pid, env_dir)
            assert processes, "no process runs the environment's interpreter"
            assert all("mmserver.backend.envfork" in " ".join(c) for c in processes)

            # The same set, spelled otherwise: the same environment, no second build.
            status, body = await _post(session, f"{url}/predictions/old-twin", rows)
            assert status == 200, body
            assert body["predictions"] == answers["predict_proba"]
            twin = await _describe(session, url, "old-twin")
            assert twin["environment"]["id"] == environment["id"]
            # The same set, asked for by a model no trusted_models pattern names: refused, its
            # packages' code run for it neither by an install nor in its environment.
            status, body = await _post(session, f"{url}/predictions/stranger", rows)
            assert status == 500, body
            assert "installing and importing them runs their code" in body["message"]
            assert "trusted_models=old-forest,old-twin,uninstallable" in body["message"]
            assert "environment" not in await _describe(session, url, "stranger")
            assert await metric_total(session, url, "mmserver_env_builds_total") == 1

            # A set the server's own environment meets: served there, nothing built.
            assert (await _post(session, f"{url}/predictions/met", [[0.5]]))[0] == 200
            assert "environment" not in await _describe(session, url, "met")
            assert await metric_total(session, url, "mmserver_env_builds_total") == 1

            # A requirement no index has: its model fails, naming it; the others serve.
            for _ in range(2):
                status, body = await _post(session, f"{url}/predictions/uninstallable", [[0.5]])
                assert status == 500
                assert body["message"].startswith(
                    f"model uninstallable failed to load: its requirements cannot be "
                    f"installed: {MISSING}==9.9.9: "
                ), body
                assert MISSING in body["message"].split(f"{MISSING}==9.9.9: ", 1)[1]
            assert await metric_total(session, url, "mmserver_env_build_failures_total") == 1
            failed = await _describe(session, url, "uninstallable")
            assert failed["environment"]["state"] == "failed"
            assert (await _post(session, neighbour, [[0.5]]))[0] == 200
            assert await metric_total(session, url, "mmserver_env_build_seconds_count") == 1
    # Its failure is logged once (each 500 answer has its own warning line, as any other's).
    log = (tmp_path / "server.log").read_text()
    assert log.count("ERROR mmserver.lifecycle.loading: model uninstallable failed to load") == 1


async def test_a_restart_reuses_the_environments_built(
    store: tuple[Path, dict[str, Any]], env_dir: Path, tmp_path: Path
) -> None:
    folder, answers = store
    async with _server(folder, env_dir, tmp_path / "server.log") as child:
        async with aiohttp.ClientSession() as session:
            url = f"{child.url}/predictions/old-forest"
            status, body = await _post(session, url, answers["rows"])
            assert status == 200, body
            assert body["predictions"] == answers["predict_proba"]
            assert await metric_total(session, child.url, "mmserver_env_builds_total") == 0
    assert "1 model environment(s) found in" in (tmp_path / "server.log").read_text()


async def test_envs_build_builds_a_stores_environments_ahead_of_time(
    store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    folder, answers = store
    ahead = tmp_path / "store"
    ahead.mkdir()
    for name in ("old-forest", "old-twin", "met", "neighbour"):
        shutil.copytree(folder / name, ahead / name)
    env_dir = tmp_path / "built"
    command = [sys.executable, "-m", "mmserver", "envs", "build", "--model-store", str(ahead)]
    environ = {**os.environ, **{k: v for k, v in _env().items() if v is not None}}
    done = await asyncio.to_thread(
        subprocess.run,
        [*command, "--env-dir", str(env_dir), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"4 model(s) in {ahead}: 1 environment(s) needed"
    assert lines[1].startswith("[1/1] ")
    assert lines[1].endswith(
        "(numpy==1.26.4, scikit-learn==1.3.2): building for old-forest, old-twin ..."
    )
    head = lines[1].split(": building")[0]
    tool = "uv" if find_uv() else "pip"
    assert lines[2].startswith(f"{head}: built with {tool} in ") and lines[2].endswith(" s")
    async with _server(ahead, env_dir, tmp_path / "server.log") as child:
        async with aiohttp.ClientSession() as session:
            for name in ("old-forest", "old-twin"):
                url = f"{child.url}/predictions/{name}"
                status, body = await _post(session, url, answers["rows"])
                assert status == 200, body
                assert body["predictions"] == answers["predict_proba"]
            assert await metric_total(session, child.url, "mmserver_env_builds_total") == 0


async def test_on_version_skew_env_pins_a_pickle_to_the_version_that_made_it(
    store: tuple[Path, dict[str, Any]], env_dir: Path, tmp_path: Path
) -> None:
    folder, answers = store
    plain = tmp_path / "store"
    (plain / "old-plain").mkdir(parents=True)
    shutil.copy(folder / "old-forest" / "model.joblib", plain / "old-plain" / "model.joblib")
    (plain / "old-plain" / "serving.properties").write_text("option.method=predict_proba\n")
    make_linear_model(plain / "neighbour")
    async with _server(
        plain, env_dir, tmp_path / "server.log", "", "--on-version-skew", "env"
    ) as child:
        async with aiohttp.ClientSession() as session:
            url = f"{child.url}/predictions/old-plain"
            status, body = await _post(session, url, answers["rows"])
            assert status == 200, body
            assert body["predictions"] == answers["predict_proba"]
            environment = (await _describe(session, child.url, "old-plain"))["environment"]
            assert environment["requirements"] == ["numpy<2", "scikit-learn==1.3.2"]
            assert environment["versions"]["scikit-learn"] == "1.3.2"
            # A model of the server's own version needs none.
            assert (await _post(session, f"{child.url}/predictions/neighbour", [[0.5]]))[0] == 200
            assert "environment" not in await _describe(session, child.url, "neighbour")
