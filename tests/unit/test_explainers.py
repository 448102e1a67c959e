"""Each explanation method against an independent reference, on real models loaded as the server
loads them: XGBoost's and LightGBM's own contributions, shap's TreeExplainer on a scikit-learn
forest (equal to 1e-6), the linear method's coefficients, one-hot columns summed back, and
additivity (base + attributions = the model's output) on every model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import (
    GradientBoostingClassifier,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.neighbors import KNeighborsRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from mmserver.codecs.explanations import ATTRIBUTIONS, KERNEL, LINEAR, TREE, Attributions
from mmserver.config.server import ModelConfig
from mmserver.errors import InvalidInput
from mmserver.execution.predictor import EstimatorPredictor, load_predictor
from tests.models import tree_models

shap = pytest.importorskip("shap")
xgboost = pytest.importorskip("xgboost")
lightgbm = pytest.importorskip("lightgbm")

X, Y, CLASSES = tree_models.data(rows=400)
ROWS = X[:5]


def loaded(folder: Path, model: Any, properties: str | None = None) -> EstimatorPredictor:
    tree_models.write_pickle(folder, model, properties)
    predictor = load_predictor(folder, ModelConfig())
    assert isinstance(predictor, EstimatorPredictor)
    return predictor


def explained(predictor: EstimatorPredictor, rows: Any) -> Attributions:
    attributions = predictor.output(ATTRIBUTIONS, rows)
    assert isinstance(attributions, Attributions)
    return attributions


def assert_adds_up(attributions: Attributions, output: Any) -> None:
    total = attributions.base + attributions.values.sum(axis=-1)
    np.testing.assert_allclose(total, np.asarray(output).reshape(total.shape), atol=1e-6)


def test_forest_is_shaps_tree_explainer(tmp_path: Path) -> None:
    forest = RandomForestClassifier(n_estimators=30, max_depth=6, random_state=0).fit(X, CLASSES)
    predictor = loaded(tmp_path / "forest", forest)
    assert predictor.describe()["explanation"] == {"method": TREE, "exact": True}
    attributions = explained(predictor, ROWS)
    reference = shap.TreeExplainer(forest).shap_values(ROWS)  # (rows, columns, classes)
    np.testing.assert_allclose(attributions.values, reference.transpose(0, 2, 1), atol=1e-6)
    assert attributions.outputs == ("0", "1", "2")
    assert attributions.explained == "probability"
    assert_adds_up(attributions, forest.predict_proba(ROWS))


def test_a_forest_its_predict_paths_let_go_is_read_again_for_its_explanation(
    tmp_path: Path,
) -> None:
    forest = RandomForestRegressor(n_estimators=20, max_depth=5, random_state=0).fit(X, Y)
    reads: list[int] = []

    def reload() -> Any:
        reads.append(1)
        return forest

    predictor = EstimatorPredictor(forest, "predict", "forest", reload=reload)
    predictor.model = None  # as when its predict paths answer without it
    attributions = explained(predictor, ROWS)
    assert reads == [1]  # read once, for the explainer
    reference = shap.TreeExplainer(forest).shap_values(ROWS)
    np.testing.assert_allclose(attributions.values[:, 0, :], reference, atol=1e-6)
    assert_adds_up(attributions, forest.predict(ROWS))
    explained(predictor, ROWS)
    assert reads == [1]


def test_boosters_are_their_own_contributions(tmp_path: Path) -> None:
    booster = tree_models.write_xgboost(
        tmp_path / "xgb", tree_models.xgboost_booster(objective="multi:softprob")
    )
    predictor = load_predictor(tmp_path / "xgb", ModelConfig())
    attributions = explained(predictor, ROWS)  # type: ignore[arg-type]
    own = booster.predict(xgboost.DMatrix(ROWS), pred_contribs=True)
    np.testing.assert_allclose(attributions.values, own[:, :, :-1], atol=1e-6)
    assert_adds_up(attributions, booster.predict(xgboost.DMatrix(ROWS), output_margin=True))
    lgbm = tree_models.write_lightgbm(tmp_path / "lgbm", tree_models.lightgbm_booster())
    predictor = load_predictor(tmp_path / "lgbm", ModelConfig())
    attributions = explained(predictor, ROWS)  # type: ignore[arg-type]
    own = lgbm.predict(ROWS, pred_contrib=True)
    np.testing.assert_allclose(attributions.values[:, 0, :], own[:, :-1], atol=1e-6)
    assert_adds_up(attributions, lgbm.predict(ROWS, raw_score=True))


def test_gradient_boosting_margin_adds_up(tmp_path: Path) -> None:
    model = GradientBoostingClassifier(n_estimators=20, random_state=0).fit(X, CLASSES > 0)
    attributions = explained(loaded(tmp_path / "gb", model), ROWS)
    assert attributions.explained == "margin" and attributions.outputs is None
    assert_adds_up(attributions, model.decision_function(ROWS))


def test_linear_behind_a_scaler_needs_no_background(tmp_path: Path) -> None:
    model = make_pipeline(StandardScaler(), Ridge()).fit(X, Y)
    predictor = loaded(tmp_path / "ridge", model)
    assert predictor.describe()["explanation"] == {"method": LINEAR, "exact": True}
    attributions = explained(predictor, ROWS)
    scaler, ridge = model[0], model[-1]
    expected = ridge.coef_ * (ROWS - scaler.mean_) / scaler.scale_
    np.testing.assert_allclose(attributions.values[:, 0, :], expected, atol=1e-9)
    assert_adds_up(attributions, model.predict(ROWS))


def test_linear_alone_takes_its_background_mean(tmp_path: Path) -> None:
    model = LinearRegression().fit(X, Y)
    folder = tmp_path / "linear"
    tree_models.write_pickle(folder, model)
    assert load_predictor(folder, ModelConfig()).describe()["explanation"]["method"] == "none"
    np.savetxt(folder / "explain_background.csv", X[:50], delimiter=",")
    attributions = explained(load_predictor(folder, ModelConfig()), ROWS)  # type: ignore[arg-type]
    np.testing.assert_allclose(
        attributions.values[:, 0, :], model.coef_ * (ROWS - X[:50].mean(axis=0)), atol=1e-9
    )
    assert_adds_up(attributions, model.predict(ROWS))


def test_one_hot_columns_are_summed_back(tmp_path: Path) -> None:
    frame = pd.DataFrame({"city": np.array(["paris", "lyon", "nice"])[CLASSES], "x": X[:, 0]})
    front = ColumnTransformer(
        [("city", OneHotEncoder(sparse_output=False), ["city"]), ("x", StandardScaler(), ["x"])]
    )
    model = make_pipeline(front, RandomForestClassifier(n_estimators=10, random_state=0))
    model.fit(frame, CLASSES)
    predictor = loaded(tmp_path / "cities", model)
    rows = frame.iloc[:4]
    table = predictor.inputs
    from mmserver.codecs.requests import decode_as

    body = rows.to_json(orient="records").encode()
    attributions = explained(predictor, decode_as(body, "application/json", table))
    assert attributions.columns == ("city", "x")
    per_encoded = shap.TreeExplainer(model[-1]).shap_values(model[0].transform(rows))
    city = per_encoded[:, :3, :].sum(axis=1)  # the three one-hot columns of city
    np.testing.assert_allclose(attributions.values[:, :, 0], city, atol=1e-6)
    assert_adds_up(attributions, model.predict_proba(rows))


def test_kernel_against_a_background_is_approximate(tmp_path: Path) -> None:
    model = KNeighborsRegressor().fit(X, Y)
    folder = tmp_path / "knn"
    tree_models.write_pickle(folder, model, "option.explain_samples=64\n")
    np.savetxt(folder / "explain_background.csv", X[:20], delimiter=",")
    predictor = load_predictor(folder, ModelConfig(explain_samples=64))
    described = predictor.describe()["explanation"]  # type: ignore[attr-defined]
    assert described == {"method": KERNEL, "exact": False, "samples": 64}
    attributions = explained(predictor, ROWS[:2])  # type: ignore[arg-type]
    assert not attributions.exact
    # Kernel SHAP's efficiency constraint: the sum is the output's distance from the base.
    assert_adds_up(attributions, model.predict(ROWS[:2]))


def test_no_method_and_no_background_names_what_is_missing(tmp_path: Path) -> None:
    predictor = loaded(tmp_path / "knn", KNeighborsRegressor().fit(X, Y))
    with pytest.raises(InvalidInput, match=r"no background sample \(explain_background\.csv"):
        predictor.output(ATTRIBUTIONS, ROWS)
