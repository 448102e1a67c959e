"""Tree ensembles served by the real server with real backend processes: a random forest on its
verified fast path, an XGBoost booster and a LightGBM booster in their own formats, each
answering as its library does, with the path each backend process chose described and counted."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from tests.e2e.server_process import ServerProcess
from tests.models import tree_models

xgboost = pytest.importorskip("xgboost")
pytest.importorskip("lightgbm")

pytestmark = pytest.mark.e2e


async def _post(
    session: aiohttp.ClientSession, url: str, body: str, content_type: str, **headers: str
) -> tuple[int, str]:
    async with session.post(
        url, data=body, headers={"Content-Type": content_type, **headers}
    ) as response:
        return response.status, await response.text()


async def test_tree_families_answer_as_their_libraries_from_backend_processes(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    forest = tree_models.write_sklearn(store / "forest", tree_models.forest(40, 10), "predict")
    booster = tree_models.write_xgboost(store / "xgb", tree_models.xgboost_booster(), "json")
    lgbm = tree_models.write_lightgbm(store / "lgbm", tree_models.lightgbm_booster())
    X, _, _ = tree_models.data(9, seed=3)
    references = {
        "forest": forest.predict(X),
        "xgb": booster.predict(xgboost.DMatrix(X)),
        "lgbm": lgbm.predict(X),
    }
    async with (
        ServerProcess(
            store,
            tmp_path / "server.log",
            "--backend-processes",
            "2",
            "--metrics-model-label",
            "all",
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        # Concurrent first requests: each model loads in a backend process and answers there.
        answers = await asyncio.gather(
            *(
                _post(
                    session,
                    f"{server.url}/predictions/{name}",
                    json.dumps(X.tolist()),
                    "application/json",
                )
                for name in references
            )
        )
        for (status, text), (name, want) in zip(answers, references.items(), strict=True):
            assert status == 200, text
            got = np.asarray(json.loads(text)["predictions"])
            assert np.allclose(got, want, rtol=1e-9, atol=0), name
        # The forest's chosen path gives its own answers exactly, one row at a time too.
        for row in X[:3]:
            status, text = await _post(
                session,
                f"{server.url}/predictions/forest",
                json.dumps([row.tolist()]),
                "application/json",
            )
            assert status == 200, text
            assert json.loads(text)["predictions"] == forest.predict(row[None, :]).tolist()

        # The SageMaker CSV invoke, on the XGBoost booster.
        body = "\n".join(",".join(repr(v) for v in row) for row in X.tolist())
        status, text = await _post(
            session,
            f"{server.url}/invocations",
            body,
            "text/csv",
            Accept="text/csv",
            **{"X-Amzn-SageMaker-Target-Model": "xgb"},
        )
        assert status == 200, text
        got = np.asarray([float(r[0]) for r in csv.reader(io.StringIO(text)) if r])
        assert np.allclose(got, references["xgb"], rtol=1e-6, atol=0)

        async with session.get(f"{server.url}/models/forest") as response:
            [workflow] = await response.json()  # DJL's describe: one workflow, one model
        [model] = workflow["models"]
        paths: dict[str, Any] = model["predictPaths"]
        full = paths["batchRows"]
        small = {route["path"] for route in paths["routes"] if route["fromRows"] <= full}
        assert small and small <= {"numpy", "treelite"}  # larger batches: maybe its own
        assert {"numpy", "treelite", "own"} <= set(paths["measuredMillis"])
        assert sum(paths["batches"].values()) == 4
        async with session.get(f"{server.url}/metrics") as response:
            text = await response.text()
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mmserver_model_path_batches_total{") and 'model="forest"' in line
        )
        assert counted == 4
