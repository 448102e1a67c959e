"""The example models: what ``mmserver example-store DIR`` writes, and the richer entries of the
reference store (``scripts/generate_store.py``).

Each is a folder a user's own model can copy:

- ``iris-classifier``: a LogisticRegression on iris (4 features, 3 classes) answering
  ``predict_proba`` (``option.method`` in its ``serving.properties``);
- ``customer-churn``: a scikit-learn Pipeline fitted on a pandas DataFrame with string columns
  and missing values (OneHotEncoder, SimpleImputer, StandardScaler, LogisticRegression); it
  takes JSON records, ``[{"plan": "pro", "region": "eu", "tenure_months": 3,
  "monthly_spend": null}]``, and answers churn probabilities;
- ``pipeline-scaler``: a Pipeline (StandardScaler, Ridge) on 3 features, y = x0 + 2 x1 - 3 x2;
- ``custom-handler``: a ``model.py`` with ``load`` and ``predict`` beside its ``model.joblib``;
- ``tuned-linear``: y = 2x + 1 with its own ``serving.properties`` (batching and workers).

Models are trained where they are written (iris ships with scikit-learn; the rest is
generated from a fixed seed), so they load without version warnings and nothing is downloaded.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import joblib
import numpy as np
import pandas as pd
from sklearn.compose import ColumnTransformer
from sklearn.datasets import load_iris
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

SEED = 42

CUSTOM_HANDLER = '''\
"""Custom handler: the linear model's prediction, rounded, and twice that, per row."""

from pathlib import Path

import joblib


def load(model_dir, properties):
    return joblib.load(Path(model_dir) / "model.joblib")


def predict(model, batch):
    digits = 4
    return [
        {"value": round(float(y), digits), "doubled": round(2 * float(y), digits)}
        for y in model.predict(batch)
    ]
'''

TUNED_PROPERTIES = """\
# A model tuned by its own serving.properties (DJL's keys and units).
engine=Python
batch_size=8
max_batch_delay=5
minWorkers=1
maxWorkers=2
job_queue_size=100
"""


def train_linear() -> LinearRegression:
    """The reference model: y = 2x + 1 + noise, 1,000 points with x uniform in [0, 1]."""
    rng = np.random.default_rng(SEED)
    x = rng.uniform(0.0, 1.0, size=(1000, 1))
    y = 2.0 * x[:, 0] + 1.0 + rng.normal(0.0, 0.05, size=1000)
    return LinearRegression().fit(x, y)


def write_linear_dir(folder: Path) -> Path:
    """``folder/model.joblib`` holding the reference model; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    joblib.dump(train_linear(), folder / "model.joblib")
    return folder


def pack(folder: Path, archive: Path) -> Path:
    """Pack the files of ``folder`` at the root of the ``.tar.gz`` ``archive``."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return archive


def write_linear_archive(archive: Path) -> Path:
    """The reference ``model.tar.gz`` (``model.joblib`` at its root), at ``archive``."""
    with tempfile.TemporaryDirectory() as tmp:
        return pack(write_linear_dir(Path(tmp)), archive)


def write_classifier_dir(folder: Path) -> Path:
    """A LogisticRegression on iris (4 features, 3 classes) answering ``predict_proba``."""
    folder.mkdir(parents=True, exist_ok=True)
    x, y = load_iris(return_X_y=True)
    joblib.dump(LogisticRegression(max_iter=1000).fit(x, y), folder / "model.joblib")
    (folder / "serving.properties").write_text("option.method=predict_proba\n")
    return folder


def write_pipeline_dir(folder: Path) -> Path:
    """A Pipeline (StandardScaler, Ridge) on 3 features: y = x0 + 2 x1 - 3 x2."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(500, 3))
    y = x @ np.array([1.0, 2.0, -3.0]) + rng.normal(0.0, 0.01, size=500)
    pipeline = Pipeline([("scale", StandardScaler()), ("ridge", Ridge(alpha=1e-3))]).fit(x, y)
    joblib.dump(pipeline, folder / "model.joblib")
    return folder


def write_custom_handler_dir(folder: Path) -> Path:
    """The reference model with a ``model.py`` answering ``{"value", "doubled"}`` per row."""
    write_linear_dir(folder)
    (folder / "model.py").write_text(CUSTOM_HANDLER)
    return folder


def write_tuned_dir(folder: Path) -> Path:
    """The reference model with its own ``serving.properties``."""
    write_linear_dir(folder)
    (folder / "serving.properties").write_text(TUNED_PROPERTIES)
    return folder


CHURN_PLANS = ("basic", "pro", "team")
CHURN_REGIONS = ("eu", "us", "apac")


def churn_frame(rows: int, seed: int = SEED) -> pd.DataFrame:
    """Customers: a plan and a region (strings), months as a customer and monthly spend
    (numbers, about a tenth of them missing)."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "plan": rng.choice(CHURN_PLANS, rows),
            "region": rng.choice(CHURN_REGIONS, rows),
            "tenure_months": rng.integers(1, 60, rows).astype(float),
            "monthly_spend": rng.gamma(2.0, 30.0, rows).round(2),
        }
    )
    for column in ("tenure_months", "monthly_spend"):
        frame.loc[rng.random(rows) < 0.1, column] = np.nan
    return frame


def write_churn_dir(folder: Path) -> Path:
    """A DataFrame pipeline answering churn probabilities: new customers on the basic plan who
    spend little leave most."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = churn_frame(2000)
    rng = np.random.default_rng(SEED + 1)
    score = (
        1.5 * (frame["plan"] == "basic")
        - 1.0 * (frame["plan"] == "team")
        - 0.05 * frame["tenure_months"].fillna(30.0)
        - 0.01 * frame["monthly_spend"].fillna(60.0)
        + 1.5
    )
    churned = (rng.random(len(frame)) < 1 / (1 + np.exp(-score))).astype(int)
    pipeline = Pipeline(
        [
            (
                "prepare",
                ColumnTransformer(
                    [
                        ("categories", OneHotEncoder(handle_unknown="ignore"), ["plan", "region"]),
                        (
                            "numbers",
                            Pipeline([("impute", SimpleImputer()), ("scale", StandardScaler())]),
                            ["tenure_months", "monthly_spend"],
                        ),
                    ]
                ),
            ),
            ("model", LogisticRegression(max_iter=1000)),
        ]
    ).fit(frame, churned)
    joblib.dump(pipeline, folder / "model.joblib")
    (folder / "serving.properties").write_text("option.method=predict_proba\n")
    return folder


#: The examples by name, each the function that writes its folder.
EXAMPLES: dict[str, Callable[[Path], Path]] = {
    "iris-classifier": write_classifier_dir,
    "customer-churn": write_churn_dir,
    "pipeline-scaler": write_pipeline_dir,
    "custom-handler": write_custom_handler_dir,
    "tuned-linear": write_tuned_dir,
}


def write_examples(out: Path) -> list[str]:
    """Write every example into the store ``out`` (made if needed), each folder replaced whole;
    the other entries of ``out`` are left as they are. Returns the names written."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".examples-") as tmp:
        for name, write in EXAMPLES.items():
            staging = write(Path(tmp) / name)
            shutil.rmtree(out / name, ignore_errors=True)
            staging.replace(out / name)
    return list(EXAMPLES)
