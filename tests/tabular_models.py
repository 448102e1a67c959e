"""Models fitted on the inputs users have: DataFrames with named, string, categorical and missing
columns, and boosters trained with missing values. Each maker writes a model folder (or archive)
and returns the fitted model, so that a test compares the server's answers with the model's own
predict on the same DataFrame."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pandas as pd

CITIES = ["paris", "lyon", "nice"]
COLUMNS = ["city", "age", "income"]
#: Three customers to ask about, one with a missing age.
ROWS_OF_CUSTOMERS = pd.DataFrame(
    {
        "city": ["paris", "nice", "lyon"],
        "age": [31.0, np.nan, 52.5],
        "income": [250.0, 410.0, 300.0],
    }
)


def customers(rows: int = 300, seed: int = 0) -> pd.DataFrame:
    """A DataFrame of customers: a string column and two numeric ones with gaps."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "city": rng.choice(CITIES, rows),
            "age": rng.normal(40, 12, rows).round(1),
            "income": rng.normal(300, 60, rows).round(1),
        }
    )
    frame.loc[::7, "age"] = np.nan
    return frame


def make_pipeline_model(folder: Path) -> Any:
    """``Pipeline(ColumnTransformer(OneHotEncoder on city, imputed and scaled numbers),
    LogisticRegression)`` fitted on :func:`customers`; unknown cities are refused by its encoder
    (``handle_unknown='error'``)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    frame = customers()
    target = ((frame["income"] > 300) ^ (frame["city"] == "nice")).astype(int)
    numbers = Pipeline([("impute", SimpleImputer()), ("scale", StandardScaler())])
    prep = ColumnTransformer(
        [
            ("city", OneHotEncoder(handle_unknown="error"), ["city"]),
            ("num", numbers, ["age", "income"]),
        ]
    )
    model = Pipeline([("prep", prep), ("model", LogisticRegression())]).fit(frame, target)
    folder.mkdir(parents=True)
    joblib.dump(model, folder / "model.joblib")
    return model


def missing_rows(rows: int = 400, width: int = 4, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Rows of numbers with about a fifth missing, and a target that depends on the gaps."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (rows, width))
    x[rng.random(x.shape) < 0.2] = np.nan
    y = np.where(np.isnan(x[:, 0]), 1.0, (np.nan_to_num(x[:, 0]) > 0).astype(float))
    return x, y


def make_xgboost_archive(path: Path) -> Any:
    """An XGBoost booster trained with missing values, as SageMaker's XGBoost container writes
    it: ``xgboost-model`` in a ``.tar.gz``. Returns the booster."""
    import xgboost

    x, y = missing_rows()
    booster = xgboost.train(
        {"objective": "binary:logistic", "max_depth": 3, "nthread": 1},
        xgboost.DMatrix(x, label=y),
        num_boost_round=12,
    )
    raw = booster.save_raw("json")
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("xgboost-model")
        info.size = len(raw)
        archive.addfile(info, io.BytesIO(bytes(raw)))
    return booster


def make_hist_gradient_boosting(folder: Path) -> Any:
    """A HistGradientBoostingRegressor fitted on rows with missing values."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    x, y = missing_rows(seed=2)
    target = y + np.nan_to_num(x[:, 1])
    model = HistGradientBoostingRegressor(max_iter=20, random_state=0).fit(x, target)
    folder.mkdir(parents=True)
    joblib.dump(model, folder / "model.joblib")
    return model


def lightgbm_frame(rows: int = 300, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "color": pd.Categorical(rng.choice(["red", "green", "blue"], rows)),
            "size": rng.normal(10, 3, rows),
        }
    )


def make_lightgbm_categorical(folder: Path) -> Any:
    """A LightGBM classifier fitted on a DataFrame with a pandas categorical column."""
    import lightgbm

    frame = lightgbm_frame()
    target = ((frame["color"] == "red") | (frame["size"] > 12)).astype(int)
    model = lightgbm.LGBMClassifier(n_estimators=15, min_child_samples=5, verbose=-1)
    model.fit(frame, target)
    folder.mkdir(parents=True)
    joblib.dump(model, folder / "model.joblib")
    return model
