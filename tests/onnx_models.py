"""ONNX models made from scikit-learn ones with skl2onnx, for the ONNX family's tests: each maker
writes ``model.onnx`` into a folder and returns the file, so that a test compares the server's
answers with ``onnxruntime.InferenceSession.run`` on the same input.

skl2onnx and onnxruntime are the ``test`` and ``onnx`` extras; without them the tests that use
these skip, except in CI, where they must run (:func:`require`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.tabular_models import CITIES

#: Four features, for the models fitted on arrays.
WIDTH = 4


def require() -> None:
    """Skip the calling module when onnxruntime or skl2onnx is missing (fail in CI)."""
    for package in ("onnxruntime", "skl2onnx"):
        if os.environ.get("CI"):
            __import__(package)  # CI installs every extra: a missing one is a failure
        else:
            pytest.importorskip(package, reason=f"the ONNX tests need {package}")


def rows(count: int = 64, seed: int = 0) -> np.ndarray:
    """``count`` rows of :data:`WIDTH` float64 features."""
    return np.random.default_rng(seed).normal(0, 1, (count, WIDTH))


def _write(folder: Path, onx: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(onx.SerializeToString())
    return path


def regressor(folder: Path, forest: bool = False, trees: int = 20) -> Path:
    """A LinearRegression (or a RandomForestRegressor of ``trees`` trees) on :func:`rows`."""
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.linear_model import LinearRegression

    X = rows(300)
    y = X @ np.array([1.5, -2.0, 0.5, 3.0]) + 0.25 + np.sin(X[:, 0])
    model: Any = (
        RandomForestRegressor(trees, max_depth=8, random_state=0) if forest else LinearRegression()
    )
    model.fit(X, y)
    return _write(folder, to_onnx(model, X[:1].astype(np.float32)))


def classifier(folder: Path, zipmap: bool = True) -> Path:
    """A LogisticRegression of three classes on :func:`rows`; its probabilities one map per
    row (``zipmap``, skl2onnx's default) or one tensor."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    X = rows(300)
    y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 0.5).astype(int)
    model = LogisticRegression().fit(X, y)
    options = None if zipmap else {"zipmap": False}
    return _write(folder, to_onnx(model, X[:1].astype(np.float32), options=options))


def customers(count: int = 200, seed: int = 0) -> pd.DataFrame:
    """A DataFrame of customers: a city (a string) and two numbers."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "city": rng.choice(CITIES, count),
            "age": rng.normal(40, 12, count).round(1),
            "income": rng.normal(300, 60, count).round(1),
        }
    )


def pipeline(folder: Path, zipmap: bool = False) -> Path:
    """``Pipeline(ColumnTransformer(OneHotEncoder on city, StandardScaler on age and income),
    LogisticRegression)`` fitted on :func:`customers`, converted with one input per column:
    ``city`` string ``[N, 1]``, ``age`` and ``income`` float ``[N, 1]``."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    frame = customers()
    target = ((frame["income"] > 300) ^ (frame["city"] == "nice")).astype(int)
    prep = ColumnTransformer(
        [
            ("city", OneHotEncoder(handle_unknown="ignore"), ["city"]),
            ("num", StandardScaler(), ["age", "income"]),
        ]
    )
    model = Pipeline([("prep", prep), ("model", LogisticRegression())]).fit(frame, target)
    types = [
        ("city", StringTensorType([None, 1])),
        ("age", FloatTensorType([None, 1])),
        ("income", FloatTensorType([None, 1])),
    ]
    options = None if zipmap else {"zipmap": False}
    return _write(folder, to_onnx(model, initial_types=types, options=options))


def session(path: Path) -> Any:
    """An onnxruntime session of ``path``: the reference the server's answers are held to."""
    import onnxruntime

    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def feeds(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """:func:`pipeline`'s inputs for the rows of ``frame``."""
    return {
        "city": frame[["city"]].to_numpy(dtype=object),
        "age": frame[["age"]].to_numpy(dtype=np.float32),
        "income": frame[["income"]].to_numpy(dtype=np.float32),
    }


def probabilities(answer: Any) -> np.ndarray:
    """onnxruntime's probabilities as a matrix (a ZipMap's maps, in class order)."""
    if isinstance(answer, np.ndarray):
        return answer
    return np.array([[row[c] for c in sorted(row)] for row in answer], dtype=np.float32)
