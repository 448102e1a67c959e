"""Tree-ensemble models of every family mmserver serves, written into model folders.

Used by the tests and by the ``trees`` section of ``scripts/bench``. Each ``write_*`` function
trains a model on a fixed synthetic data set (``FEATURES`` columns), writes it as the family
stores it, and returns the fitted object, whose own predict is the reference answer:

- scikit-learn (``model.joblib``): forests, extra-trees, gradient boosting, histogram gradient
  boosting, isolation forest, a StandardScaler → forest pipeline;
- XGBoost: ``model.json``, ``model.ubj``, the SageMaker container's ``xgboost-model``, and the
  pickled ``XGBRegressor``/``XGBClassifier`` wrappers;
- LightGBM: ``model.txt``, and the pickled ``LGBMRegressor``/``LGBMClassifier`` wrappers;
- ONNX: a scikit-learn model converted by skl2onnx, ``model.onnx`` (:func:`write_onnx`).
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import joblib
import numpy as np

FEATURES = 8


def data(rows: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows, a regression target, and a three-class target."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, FEATURES))
    y = 2.0 * X[:, 0] + np.sin(3.0 * X[:, 1]) + X[:, 2] * X[:, 3] + rng.normal(0, 0.1, rows)
    classes = (X[:, 0] + X[:, 2] > 0).astype(int) + (X[:, 3] > 0.8).astype(int)
    return X, y, classes


def _folder(folder: Path, properties: str | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if properties is not None:
        (folder / "serving.properties").write_text(properties)
    return folder


def write_pickle(folder: Path, model: Any, properties: str | None = None) -> Any:
    """``model`` as ``folder/model.joblib`` (with ``serving.properties`` if given)."""
    joblib.dump(model, _folder(folder, properties) / "model.joblib")
    return model


def forest(trees: int = 20, depth: int | None = 8, seed: int = 0) -> Any:
    from sklearn.ensemble import RandomForestRegressor

    X, y, _ = data()
    return RandomForestRegressor(trees, max_depth=depth, random_state=seed).fit(X, y)


def sklearn_models(small: bool = True) -> dict[str, tuple[Any, str]]:
    """name -> (fitted scikit-learn model, method) of every scikit-learn tree family."""
    from sklearn import ensemble as e
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, y, c = data()
    labels = np.array(["low", "mid", "high"])[c]
    n = 20 if small else 100
    return {
        "forest": (forest(n), "predict"),
        "forest-classifier": (
            e.RandomForestClassifier(n, max_depth=8, random_state=0).fit(X, labels),
            "predict",
        ),
        "forest-proba": (
            e.RandomForestClassifier(n, max_depth=8, random_state=0).fit(X, labels),
            "predict_proba",
        ),
        "extra-trees": (e.ExtraTreesRegressor(n, max_depth=8, random_state=0).fit(X, y), "predict"),
        "gradient-boosting": (e.GradientBoostingRegressor(n_estimators=n).fit(X, y), "predict"),
        "gb-classifier-proba": (
            e.GradientBoostingClassifier(n_estimators=n).fit(X, c),
            "predict_proba",
        ),
        "histgb": (e.HistGradientBoostingRegressor(max_iter=n).fit(X, y), "predict"),
        "histgb-classifier": (
            e.HistGradientBoostingClassifier(max_iter=n).fit(X, labels),
            "predict",
        ),
        "isolation-forest": (e.IsolationForest(n_estimators=n, random_state=0).fit(X), "predict"),
        "scaled-forest": (
            make_pipeline(StandardScaler(), e.ExtraTreesRegressor(n, random_state=0)).fit(X, y),
            "predict",
        ),
    }


def write_sklearn(folder: Path, model: Any, method: str) -> Any:
    props = None if method == "predict" else f"option.method={method}\n"
    return write_pickle(folder, model, props)


def xgboost_booster(trees: int = 20, objective: str = "reg:squarederror") -> Any:
    import xgboost

    X, y, c = data()
    target = (
        c
        if objective.startswith("multi")
        else ((c > 0).astype(int) if objective.startswith("binary") else y)
    )
    params: dict[str, Any] = {"objective": objective, "max_depth": 5, "nthread": 1}
    if objective.startswith("multi"):
        params["num_class"] = 3
    return xgboost.train(params, xgboost.DMatrix(X, label=target), num_boost_round=trees)


def write_xgboost(folder: Path, booster: Any, kind: str = "json") -> Any:
    """``kind``: ``json`` (model.json), ``ubj`` (model.ubj) or ``sagemaker``
    (``xgboost-model`` in UBJSON, as the SageMaker XGBoost container writes it)."""
    folder = _folder(folder)
    if kind == "sagemaker":
        (folder / "xgboost-model").write_bytes(bytes(booster.save_raw("ubj")))
    else:
        booster.save_model(str(folder / f"model.{kind}"))
    return booster


def xgboost_wrappers(trees: int = 20) -> dict[str, tuple[Any, str]]:
    import xgboost

    X, y, c = data()
    return {
        "xgb-regressor": (
            xgboost.XGBRegressor(n_estimators=trees, max_depth=5).fit(X, y),
            "predict",
        ),
        "xgb-classifier": (
            xgboost.XGBClassifier(n_estimators=trees, max_depth=4).fit(X, c),
            "predict",
        ),
        "xgb-classifier-proba": (
            xgboost.XGBClassifier(n_estimators=trees, max_depth=4).fit(X, c),
            "predict_proba",
        ),
    }


def lightgbm_booster(trees: int = 20, objective: str = "regression") -> Any:
    import lightgbm

    X, y, c = data()
    params: dict[str, Any] = {"objective": objective, "verbose": -1, "num_threads": 1}
    target = y
    if objective == "multiclass":
        params["num_class"] = 3
        target = c
    return lightgbm.train(params, lightgbm.Dataset(X, label=target), num_boost_round=trees)


def write_lightgbm(folder: Path, booster: Any) -> Any:
    booster.save_model(str(_folder(folder) / "model.txt"))
    return booster


def write_onnx(folder: Path, model: Any) -> Any:
    """``model``, a fitted scikit-learn estimator of :data:`FEATURES` features, converted by
    skl2onnx (float32 input ``X``) as ``folder/model.onnx``; returns ``model``."""
    from skl2onnx import to_onnx

    X, _, _ = data(1)
    graph = to_onnx(model, X.astype(np.float32))
    (_folder(folder) / "model.onnx").write_bytes(graph.SerializeToString())
    return model


def lightgbm_wrappers(trees: int = 20) -> dict[str, tuple[Any, str]]:
    import lightgbm

    X, y, c = data()
    return {
        "lgbm-regressor": (
            lightgbm.LGBMRegressor(n_estimators=trees, verbose=-1).fit(X, y),
            "predict",
        ),
        "lgbm-classifier-proba": (
            lightgbm.LGBMClassifier(n_estimators=trees, verbose=-1).fit(X, c),
            "predict_proba",
        ),
    }


def pack(folder: Path, archive: Path) -> Path:
    """``folder``'s files at the root of ``archive`` (a ``.tar.gz``), as SageMaker packs them."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(Path(folder).iterdir()):
            tar.add(path, arcname=path.name)
    return archive
