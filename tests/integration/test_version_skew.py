"""Models from other years (docs/models.md, *Models made by another version*): a pickle made by
another minor version of scikit-learn is refused by default naming both versions, served with
``on_version_skew=warn`` and its versions shown and counted; a classifier whose probabilities are
not probabilities, or whose own method fails on a plain row, never loads as a healthy model.

The old models are made by scikit-learn 1.3.2 itself, in the side environment ``scripts/test``
builds (``tests/old-sklearn.txt``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
import sklearn
from sklearn.linear_model import LinearRegression

from tests.integration.harness import Harness, Serve, describe, error_of
from tests.models import make_linear_model

#: What scikit-learn 1.3.2 makes, and what it answers itself.
_MAKE = """
import json, sys
import joblib, numpy as np, sklearn
from sklearn.ensemble import GradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

store = sys.argv[1]
rng = np.random.default_rng(0)
X = rng.normal(size=(200, 4))
y = (X[:, 0] + X[:, 1] > 0).astype(int)
rows = X[:3]
answers = {"version": sklearn.__version__, "rows": rows.tolist()}
for name, model in (
    ("old-forest", RandomForestClassifier(n_estimators=5, random_state=0)),
    ("old-boosting", GradientBoostingClassifier(n_estimators=5, random_state=0)),
    ("old-logistic", LogisticRegression()),
    ("old-pipeline", make_pipeline(StandardScaler(), LogisticRegression())),
):
    model.fit(X, y)
    joblib.dump(model, f"{store}/{name}/model.joblib")
    answers[name] = {
        "predict": model.predict(rows).tolist(),
        "predict_proba": model.predict_proba(rows).tolist(),
    }
print(json.dumps(answers))
"""


def _old_python() -> str:
    python = os.environ.get("MMSERVER_TEST_OLD_SKLEARN") or str(
        Path(__file__).resolve().parents[2] / ".venv-old-sklearn" / "bin" / "python"
    )
    if not Path(python).is_file():
        if os.environ.get("CI"):
            raise AssertionError(f"{python} is missing: scripts/test builds it")
        pytest.skip("no scikit-learn 1.3.2 environment: scripts/test builds it")
    return python


@pytest.fixture(scope="module")
def old_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store with three models pickled by scikit-learn 1.3.2 (and their own answers), a model
    of this version and one whose own predict fails on every row."""
    store = tmp_path_factory.mktemp("skew") / "store"
    for name in ("old-forest", "old-boosting", "old-logistic", "old-pipeline", "broken"):
        (store / name).mkdir(parents=True)
    made = subprocess.run(
        [_old_python(), "-c", _MAKE, str(store)], capture_output=True, text=True, check=True
    )
    answers: dict[str, Any] = json.loads(made.stdout)
    assert answers["version"] == "1.3.2"
    make_linear_model(store / "neighbour")
    broken = LinearRegression().fit(np.array([[0.0], [1.0]]), np.array([1.0, 3.0]))
    del broken.intercept_  # fitted, yet its predict fails whatever it is sent
    joblib.dump(broken, store / "broken" / "model.joblib")
    return store, answers


async def _post(harness: Harness, name: str, rows: list[list[float]]) -> tuple[int, Any]:
    response = await harness.post(f"/predictions/{name}", json.dumps(rows))
    if response.status == 200:
        return 200, await response.json()
    return response.status, await error_of(response)


def _metric(text: str, name: str, label: str = "") -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and label in line and not line.startswith("#")
    )


async def test_a_pickle_of_another_minor_version_is_refused_naming_both(
    serve: Serve, old_store: tuple[Path, dict[str, Any]]
) -> None:
    store, answers = old_store
    harness = await serve(model_store=str(store))
    rows = answers["rows"]
    ours = sklearn.__version__
    for name in ("old-forest", "old-logistic"):
        for _ in range(2):
            status, body = await _post(harness, name, rows)
            assert status == 500
            assert body["type"] == "MalformedModelException"
            assert body["message"].startswith(
                f"model {name} failed to load: model.joblib was pickled by scikit-learn 1.3.2 "
                f"and this server runs scikit-learn {ours}: "
            )
            assert "on_version_skew=warn" in body["message"]
        described = await describe(harness, name)
        assert described["status"] == "FAILED"
        assert "pickled by scikit-learn 1.3.2" in described["error"]
    # A pickle this version cannot read at all says which version made it.
    status, body = await _post(harness, "old-boosting", rows)
    assert status == 500
    assert "ModuleNotFoundError: No module named 'sklearn.ensemble._gb_losses'" in body["message"]
    assert (
        f"It was pickled by scikit-learn 1.3.2 and this server runs scikit-learn {ours}"
        in (body["message"])
    )
    # The neighbour answers; each refusal is counted by its reason (the second request found
    # the remembered failure, as it finds any failed load's until it is tried again).
    status, body = await _post(harness, "neighbour", [[1.0]])
    assert status == 200 and body["predictions"][0] == pytest.approx(3.0, abs=0.05)
    metrics = (await (await harness.client.get("/metrics")).read()).decode()
    assert _metric(metrics, "mmserver_model_load_failures_total", 'reason="version_skew"') == 2
    assert _metric(metrics, "mmserver_model_version_skew_loads_total") == 0


async def test_warn_serves_it_shows_its_versions_and_still_refuses_false_probabilities(
    serve: Serve, old_store: tuple[Path, dict[str, Any]]
) -> None:
    store, answers = old_store
    harness = await serve(model_store=str(store), on_version_skew="warn")
    rows = answers["rows"]
    # A logistic regression reads the same in both versions: served, its answers 1.3.2's own.
    status, body = await _post(harness, "old-logistic", rows)
    assert status == 200
    assert body["predictions"] == answers["old-logistic"]["predict"]
    described = await describe(harness, "old-logistic")
    assert described["status"] == "Healthy"
    assert described["trainedWith"] == {"scikit-learn": "1.3.2"}
    assert described["servedWith"] == {"scikit-learn": sklearn.__version__}
    ours = sklearn.__version__
    assert described["warnings"] == [
        f"InconsistentVersionWarning: model.joblib was pickled by scikit-learn 1.3.2 and is read "
        f"by {ours} (1 estimator(s): LogisticRegression)"
    ]
    # A pipeline's steps each warned: said once, with every estimator.
    status, body = await _post(harness, "old-pipeline", rows)
    assert status == 200
    assert body["predictions"] == answers["old-pipeline"]["predict"]
    assert (await describe(harness, "old-pipeline"))["warnings"] == [
        f"InconsistentVersionWarning: model.joblib was pickled by scikit-learn 1.3.2 and is read "
        f"by {ours} (3 estimator(s): StandardScaler, LogisticRegression, Pipeline)"
    ]
    metrics = (await (await harness.client.get("/metrics")).read()).decode()
    assert (
        _metric(metrics, "mmserver_model_version_skew_loads_total") == 2
    )  # the logistic regression and the pipeline
    said = f"made by scikit-learn 1.3.2, served by {sklearn.__version__}"
    listed = (await (await harness.client.get("/models")).json())["models"]
    rows = {row["modelName"]: row for row in listed}
    assert rows["old-logistic"]["versionSkew"] == said
    assert "versionSkew" not in rows["neighbour"]
    response = await harness.client.post("/v2/repository/index", json={"ready": True})
    index = {row["name"]: row for row in await response.json()}
    assert index["old-logistic"] == {
        "name": "old-logistic",
        "version": "1",
        "state": "READY",
        "reason": said,
    }
    # The forest reads back as "probabilities" outside [0, 1]: never served.
    status, body = await _post(harness, "old-forest", rows)
    assert status == 500
    assert body["message"].startswith(
        "model old-forest failed to load: its predict_proba does not answer probabilities "
        "(values from 0 to "
    )
    own = answers["old-forest"]["predict_proba"]
    assert all(0.0 <= p <= 1.0 for row in own for p in row)  # what 1.3.2 itself answers
    assert (await describe(harness, "old-forest"))["status"] == "FAILED"


async def test_a_model_whose_own_method_fails_on_a_plain_row_fails_its_load(
    serve: Serve, old_store: tuple[Path, dict[str, Any]]
) -> None:
    store, _ = old_store
    harness = await serve(model_store=str(store))
    status, body = await _post(harness, "broken", [[1.0]])
    assert status == 500
    assert body["message"].startswith(
        "model broken failed to load: its own predict fails on a row of plain values at load "
        "(AttributeError: 'LinearRegression' object has no attribute 'intercept_'); it is not "
        "served"
    )
    ready = await harness.client.get("/v2/models/broken/ready")
    assert ready.status != 200
    status, body = await _post(harness, "neighbour", [[1.0]])
    assert status == 200


def test_the_skew_option_is_checked() -> None:
    from mmserver.config.server import ServerConfig
    from mmserver.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"on_version_skew='envs'.*must be one of refuse, warn, env"
    ):
        ServerConfig(model_store=sys.prefix, on_version_skew="envs")
