"""Tree ensembles of every family over real HTTP: answers equal the library's own predict, in
JSON, CSV and .npy; the verified fast paths are described and counted; fallbacks and a missing
optional package."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.ensemble import RandomForestRegressor

from tests.integration.harness import Harness, Serve, describe, error_of
from tests.models import tree_models

xgboost = pytest.importorskip("xgboost")
lightgbm = pytest.importorskip("lightgbm")

Reference = Callable[[np.ndarray], Any]


class Shifted(RandomForestRegressor):  # type: ignore[misc]
    """A forest whose ``predict`` adds one: converting its trees would answer without it."""

    def predict(self, X: Any) -> Any:
        return super().predict(X) + 1.0


@pytest.fixture(scope="module")
def tree_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Reference]]:
    """A store with a small model of every family, and each one's reference predict."""
    root = tmp_path_factory.mktemp("trees")
    refs: dict[str, Reference] = {}
    models = {
        **tree_models.sklearn_models(),
        **tree_models.xgboost_wrappers(),
        **tree_models.lightgbm_wrappers(),
    }
    for name, (model, method) in models.items():
        tree_models.write_sklearn(root / name, model, method)
        refs[name] = getattr(model, method)
    for kind in ("json", "ubj"):
        booster = tree_models.write_xgboost(
            root / f"xgb-{kind}", tree_models.xgboost_booster(objective="multi:softprob"), kind
        )
        refs[f"xgb-{kind}"] = lambda X, b=booster: b.predict(xgboost.DMatrix(X))
    sagemaker = tree_models.write_xgboost(
        root / "unpacked", tree_models.xgboost_booster(objective="binary:logistic"), "sagemaker"
    )
    tree_models.pack(root / "unpacked", root / "xgb-sagemaker.tar.gz")
    refs["xgb-sagemaker"] = lambda X: sagemaker.predict(xgboost.DMatrix(X))
    for objective in ("regression", "multiclass"):
        booster = tree_models.write_lightgbm(
            root / f"lgbm-{objective}", tree_models.lightgbm_booster(objective=objective)
        )
        refs[f"lgbm-{objective}"] = booster.predict
    forest = tree_models.write_sklearn(root / "no-fast-path", tree_models.forest(), "predict")
    (root / "no-fast-path" / "serving.properties").write_text("option.fast_path=false\n")
    refs["no-fast-path"] = forest.predict
    X, y, _ = tree_models.data()
    shifted = tree_models.write_sklearn(
        root / "shifted-forest", Shifted(10, max_depth=6, random_state=0).fit(X, y), "predict"
    )
    refs["shifted-forest"] = shifted.predict
    shutil.rmtree(root / "unpacked")
    return root, refs


@pytest.fixture
async def trees(serve: Serve, tree_store: tuple[Path, dict[str, Reference]]) -> Harness:
    # Shifted is a class of this module: its pickle loads with the operator's trusted_types.
    return await serve(
        model_store=str(tree_store[0]),
        metrics_model_label="all",
        trusted_types=f"{Shifted.__module__}.Shifted",
    )


def _rows(count: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, tree_models.FEATURES))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _same(got: Any, want: Any) -> None:
    want = np.asarray(want)
    got = np.asarray(got, dtype=want.dtype if want.dtype.kind in "iuf" else None)
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        assert np.allclose(got, want, rtol=1e-9, atol=1e-9 * float(np.max(np.abs(want))))
    else:
        assert got.tolist() == want.tolist()


FAMILIES = [
    ("forest", "sklearn", "numpy|treelite"),
    ("forest-classifier", "sklearn", "numpy|treelite"),
    ("forest-proba", "sklearn", "numpy|treelite"),
    ("extra-trees", "sklearn", "numpy|treelite"),
    ("gradient-boosting", "sklearn", "treelite"),
    ("gb-classifier-proba", "sklearn", "treelite"),
    ("histgb", "sklearn", "treelite"),
    ("histgb-classifier", "sklearn", "treelite"),
    ("isolation-forest", "sklearn", "treelite"),
    ("scaled-forest", "sklearn", "numpy|treelite"),
    ("xgb-regressor", "sklearn", None),
    ("xgb-classifier", "sklearn", None),
    ("xgb-classifier-proba", "sklearn", None),
    ("xgb-json", "xgboost", None),
    ("xgb-ubj", "xgboost", None),
    ("xgb-sagemaker", "xgboost", None),
    ("lgbm-regressor", "sklearn", None),
    ("lgbm-classifier-proba", "sklearn", None),
    # A LightGBM booster's own predict is its native one; treelite's softmax differs in the last
    # bits, so the multiclass one keeps its own.
    ("lgbm-regression", "lightgbm", ""),
    ("lgbm-multiclass", "lightgbm", "own"),
]


@pytest.mark.parametrize(("name", "family", "path"), FAMILIES, ids=[f[0] for f in FAMILIES])
async def test_every_family_answers_as_its_library_in_every_format(
    trees: Harness,
    tree_store: tuple[Path, dict[str, Reference]],
    name: str,
    family: str,
    path: str | None,
) -> None:
    reference = tree_store[1][name]
    one, many = _rows(1), _rows(7)
    response = await trees.post(f"/predictions/{name}", json.dumps(one.tolist()))
    assert response.status == 200, await response.text()
    _same((await response.json())["predictions"], reference(one))

    response = await trees.post(f"/predictions/{name}", _npy(many), "application/x-npy")
    assert response.status == 200, await response.text()
    _same((await response.json())["predictions"], reference(many))

    # The ad-tech invoke: CSV rows in, CSV out, on the SageMaker path.
    body = "\n".join(",".join(repr(v) for v in row) for row in many.tolist())
    response = await trees.post(
        "/invocations",
        body,
        "text/csv",
        Accept="text/csv",
        **{"X-Amzn-SageMaker-Target-Model": name},
    )
    assert response.status == 200, await response.text()
    table = [row for row in csv.reader(io.StringIO(await response.text())) if row]
    want = np.asarray(reference(many))
    got: Any = [[float(v) for v in row] if want.dtype.kind == "f" else row for row in table]
    _same(np.asarray(got).reshape(want.shape), want)

    described = await describe(trees, name)
    assert described["family"] == family
    routes = described["predictPaths"]["routes"]
    assert routes[0]["fromRows"] == 1 and routes[-1]["toRows"] is None
    used = {r["path"] for r in routes}
    measured = described["predictPaths"]["measuredMillis"]
    if path:
        # Each is several times faster than the own predict up to a full batch: one of them,
        # both verified, is chosen there (which one for which rows is for the timing to say).
        # Larger batches may go to the own predict: a small ensemble's costs about the same for
        # one row or a thousand.
        expected = set(path.split("|"))
        full = described["predictPaths"]["batchRows"]
        assert {r["path"] for r in routes if r["fromRows"] <= full} <= expected
        assert used <= expected | {"own"} and expected - {"own"} <= set(measured)
        assert all(m["large"] > 0 for m in measured.values())
    elif path == "":
        assert used <= {*measured, "own"}
    else:
        # A booster's native predict is verified; whether it beats the wrapper's own (which
        # calls it) by enough is for the timing to say.
        assert "native" in measured
        assert used <= set(measured)
    assert sum(described["predictPaths"]["batches"].values()) == 3


async def test_batches_are_counted_per_path(trees: Harness) -> None:
    for _ in range(3):
        response = await trees.post("/predictions/forest", json.dumps(_rows(1).tolist()))
        assert response.status == 200
    described = await describe(trees, "forest")
    one_row = described["predictPaths"]["routes"][0]["path"]
    assert one_row in ("numpy", "treelite")
    samples = await trees.samples()
    key = ("mmserver_model_path_batches_total", (("model", "forest"), ("path", one_row)))
    assert samples[key] == 3
    assert described["predictPaths"]["batches"] == {one_row: 3}
    measured = described["predictPaths"]["measuredMillis"]
    assert set(measured) == {"own", "numpy", "treelite"}
    assert measured["own"]["oneRow"] > 0 and measured["numpy"]["batch"] > 0
    assert measured["treelite"]["batch"] > 0
    assert described["predictPaths"]["conversionMillis"] > 0


async def _answers_as_its_own(
    trees: Harness, refs: dict[str, Reference], name: str
) -> dict[str, Any]:
    """Check one request's answer against the reference; the model's ``predictPaths``."""
    rows = _rows(3)
    response = await trees.post(f"/predictions/{name}", json.dumps(rows.tolist()))
    assert response.status == 200
    assert (await response.json())["predictions"] == refs[name](rows).tolist()
    described = await describe(trees, name)
    paths: dict[str, Any] = described["predictPaths"]
    return paths


async def test_the_fast_path_can_be_turned_off(
    trees: Harness, tree_store: tuple[Path, dict[str, Reference]]
) -> None:
    paths = await _answers_as_its_own(trees, tree_store[1], "no-fast-path")
    assert paths["routes"] == [{"fromRows": 1, "toRows": None, "path": "own"}]
    assert paths["rejected"] == {"all": "option.fast_path=false"}
    assert paths["batches"] == {"own": 1}


async def test_a_subclass_with_its_own_predict_keeps_it(
    trees: Harness, tree_store: tuple[Path, dict[str, Reference]]
) -> None:
    paths = await _answers_as_its_own(trees, tree_store[1], "shifted-forest")
    assert {r["path"] for r in paths["routes"]} == {"own"}
    assert paths["rejected"]["treelite"].startswith("differs on probe rows")


async def test_values_on_float32_split_edges_answer_as_scikit_learn(
    trees: Harness, tree_store: tuple[Path, dict[str, Reference]]
) -> None:
    """scikit-learn compares a feature's float32 value with a float64 threshold: a value just
    above a threshold in float64 can fall on it in float32 and go left. The answers follow."""
    import joblib

    model = joblib.load(tree_store[0] / "forest" / "model.joblib")
    tree = model.estimators_[0].tree_
    inner = tree.feature >= 0
    rows = np.zeros((int(inner.sum()), tree_models.FEATURES))
    flips = 0
    for i, (j, t) in enumerate(zip(tree.feature[inner], tree.threshold[inner], strict=True)):
        rows[i, j] = np.nextafter(t, np.inf)  # above the threshold in float64...
        flips += bool(np.float32(rows[i, j]) <= t)  # ...and on or below it in float32
    assert flips > 0
    response = await trees.post("/predictions/forest", json.dumps(rows.tolist()))
    assert response.status == 200
    assert (await response.json())["predictions"] == model.predict(rows).tolist()


async def test_a_missing_optional_package_fails_only_its_models(
    trees: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in [m for m in sys.modules if m == "xgboost" or m.startswith("xgboost.")]:
        monkeypatch.setitem(sys.modules, module, None)
    for name in ("xgb-json", "xgb-regressor"):
        response = await trees.post(f"/predictions/{name}", json.dumps(_rows(1).tolist()))
        assert response.status == 500
        message = (await error_of(response))["message"]
        assert "the xgboost package is not installed" in message
        assert "pip install 'mmserver[xgboost]'" in message
    for name in ("forest", "lgbm-regression"):
        response = await trees.post(f"/predictions/{name}", json.dumps(_rows(1).tolist()))
        assert response.status == 200, await response.text()
