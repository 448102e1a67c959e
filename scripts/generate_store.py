#!/usr/bin/env python3
"""Write the reference model store.

``sklearn-0.tar.gz`` ... ``sklearn-{N-1}.tar.gz``: copies of one LinearRegression trained on
``y = 2x + 1 + noise`` (one feature), saved with joblib and packed as ``model.tar.gz`` with
``model.joblib`` at its root, as in the DJL/SageMaker multi-model walkthrough. Plus a few richer
examples as folders: a classifier answering ``predict_proba``, a Pipeline, a custom handler and a
model with its own ``serving.properties``.

Models are trained here, on the machine that serves them, so they load without version warnings.
A stamp file ``.generated`` records the scikit-learn version and count; a second run with the
same ones does nothing.

Usage: scripts/generate_store.py [--out DIR] [--count N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"

if (
    __name__ == "__main__"
    and importlib.util.find_spec("sklearn") is None
    and _VENV_PYTHON.is_file()
):
    # Run directly with a Python that lacks scikit-learn: use the repository's .venv instead.
    os.execv(_VENV_PYTHON, [str(_VENV_PYTHON), *sys.argv])

import joblib  # noqa: E402
import numpy as np  # noqa: E402
import sklearn  # noqa: E402
from sklearn.datasets import load_iris  # noqa: E402
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge  # noqa: E402
from sklearn.pipeline import Pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

STAMP = ".generated"
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


EXAMPLES = {
    "iris-classifier": write_classifier_dir,
    "pipeline-scaler": write_pipeline_dir,
    "custom-handler": write_custom_handler_dir,
    "tuned-linear": write_tuned_dir,
}


def _stamp_text(count: int) -> str:
    return f"sklearn={sklearn.__version__}\ncount={count}\n"


def is_current(out: Path, count: int) -> bool:
    """Whether ``out`` already holds this store, written by this scikit-learn version."""
    try:
        if (out / STAMP).read_text() != _stamp_text(count):
            return False
    except OSError:
        return False
    return all((out / f"sklearn-{i}.tar.gz").is_file() for i in range(count)) and all(
        (out / name / "model.joblib").is_file() for name in EXAMPLES
    )


def generate(out: Path, count: int) -> None:
    """Write the reference store into ``out`` (``count`` archives and the examples)."""
    out = Path(out)
    if is_current(out, count):
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".generate-") as tmp:
        archive = write_linear_archive(Path(tmp) / "model.tar.gz")
        for i in range(count):
            # Copies, not links: replacing one archive must not change the others.
            target = out / f"sklearn-{i}.tar.gz"
            partial = Path(tmp) / target.name
            shutil.copyfile(archive, partial)
            partial.replace(target)
        for name, write in EXAMPLES.items():
            staging = write(Path(tmp) / name)
            shutil.rmtree(out / name, ignore_errors=True)
            staging.replace(out / name)
    (out / STAMP).write_text(_stamp_text(count))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("model_store"), help="store directory")
    parser.add_argument("--count", type=int, default=1000, help="number of sklearn-N archives")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error("--count must not be negative")
    start = time.perf_counter()
    if is_current(args.out, args.count):
        print(f"{args.out}: up to date ({args.count} models, scikit-learn {sklearn.__version__})")
        return 0
    generate(args.out, args.count)
    elapsed = time.perf_counter() - start
    print(
        f"{args.out}: wrote {args.count} archives and {len(EXAMPLES)} examples in {elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
