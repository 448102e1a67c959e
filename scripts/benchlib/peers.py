"""Peers: other model servers measured beside mmserver on the same 1,000 models.

``mlserver``: MLServer 1.7.1 with its scikit-learn runtime, in a virtual environment of its own
(``~/.cache/mmserver-bench/mlserver-venv``, made on first use with pip: ``mlserver``,
``mlserver-sklearn``, ``uvloop<0.22`` and this scikit-learn version, so the models load without
version warnings). Its model repository holds ``sklearn-0`` … ``sklearn-999``, each the reference
store's ``model.joblib`` (hard links of one file) with a ``model-settings.json`` naming MLServer's
``SKLearnModel``; ``settings.json`` sets ``parallel_workers`` to 0 (inference in the server's own
process, its fastest setting for small models on two cores). It loads every model at start and
is called on the Open Inference Protocol path, ``POST /v2/models/NAME/infer``.

The tabular section runs a second MLServer of its own (:func:`mlserver_tabular`) whose
repository holds only that section's DataFrame pipelines, each with ``"content_type": "pd"`` in
its ``model-settings.json`` parameters: MLServer's pandas codec decodes requests into a
DataFrame (one input a column), which the scikit-learn runtime hands to the pipeline's
``predict``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import sklearn
from proctools import HOST, free_port

from benchlib.servers import Server
from benchlib.store import bench_cache

PEERS = ("mlserver",)
MLSERVER_VERSION = "1.7.1"


def ensure_mlserver_venv() -> Path:
    """The ``mlserver`` executable of its own virtual environment, made when missing."""
    venv = bench_cache() / "mlserver-venv"
    exe = venv / "bin" / "mlserver"
    stamp = venv / ".mmserver-bench"
    want = f"mlserver=={MLSERVER_VERSION} scikit-learn=={sklearn.__version__}\n"
    if exe.is_file() and stamp.is_file() and stamp.read_text() == want:
        return exe
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            f"mlserver=={MLSERVER_VERSION}",
            f"mlserver-sklearn=={MLSERVER_VERSION}",
            "uvloop<0.22",
            f"scikit-learn=={sklearn.__version__}",
        ],
        check=True,
        timeout=1800,
    )
    stamp.write_text(want)
    return exe


def mlserver_repository(store: Path, root: Path, port: int, count: int = 1000) -> Path:
    """Write MLServer's repository of ``count`` reference models into ``root``."""
    root.mkdir(parents=True)
    with tarfile.open(store / "sklearn-0.tar.gz") as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("model.joblib"))
        source = archive.extractfile(member)
        assert source is not None
        model = root / "model.joblib"
        model.write_bytes(source.read())
    for i in range(count):
        folder = root / f"sklearn-{i}"
        folder.mkdir()
        os.link(model, folder / "model.joblib")
        settings = {
            "name": f"sklearn-{i}",
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"uri": "./model.joblib"},
        }
        (folder / "model-settings.json").write_text(json.dumps(settings))
    model.unlink()
    _write_settings(root, port)
    return root


def _write_settings(root: Path, port: int) -> None:
    """MLServer's ``settings.json``: loopback, free ports, inference in its own process."""
    server = {
        "host": HOST,
        "http_port": port,
        "grpc_port": free_port(),
        "metrics_port": free_port(),
        "parallel_workers": 0,
        "debug": False,
    }
    (root / "settings.json").write_text(json.dumps(server))


def mlserver_tabular(store: Path, models: list[str], tmp: Path, log: Path) -> Server:
    """MLServer serving the store's folders ``models`` (each a ``model.joblib`` of a pipeline
    fitted on a DataFrame) with its pandas codec (started by the caller)."""
    exe = ensure_mlserver_venv()
    port = free_port()
    root = tmp / "mlserver-tabular-repository"
    root.mkdir(parents=True)
    for name in models:
        folder = root / name
        folder.mkdir()
        shutil.copyfile(store / name / "model.joblib", folder / "model.joblib")
        settings = {
            "name": name,
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"uri": "./model.joblib", "content_type": "pd"},
        }
        (folder / "model-settings.json").write_text(json.dumps(settings))
    _write_settings(root, port)
    return _mlserver_at(exe, root, port, log, tmp, "v2")


def mlserver(store: Path, tmp: Path, log: Path) -> Server:
    """MLServer serving the reference models (started by the caller)."""
    exe = ensure_mlserver_venv()
    port = free_port()
    repository = mlserver_repository(store, tmp / "mlserver-repository", port)
    return _mlserver_at(exe, repository, port, log, tmp, "mlserver")


def _mlserver_at(exe: Path, repository: Path, port: int, log: Path, tmp: Path, api: str) -> Server:
    """``mlserver start`` on a repository whose settings name ``port`` (and its gRPC port)."""
    settings = json.loads((repository / "settings.json").read_text())
    return Server(
        "mlserver",
        [str(exe), "start", str(repository)],
        port,
        log,
        cwd=tmp,
        health="/v2/health/ready",
        api=api,
        grpc_port=settings["grpc_port"],
    )
