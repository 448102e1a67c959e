"""The benchmark's model store: the 1,000-model reference store plus slower models.

The reference store comes from ``scripts/generate_store.py`` (it does nothing when the store is
current). The batching section adds ``bench-forest-b1`` and ``bench-forest-b32``: the same
RandomForestRegressor (100 trees, on the reference data y = 2x + 1 + noise), the first with
``batch_size=1``, the second with ``batch_size=32`` and ``max_batch_delay=5``. The neighbour
section adds ``bench-heavy-forest``: a RandomForestRegressor of 300 trees of depth 14 on 8
features, tens of milliseconds of CPU per predict call, and ``bench-large-forest``: one of 200
trees of depth 12 on the same features, served on the paths mmserver chooses at load, cheap for
one row and costly for a thousand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOREST_STAMP = ".bench-forest"
HEAVY_MODEL = "bench-heavy-forest"
HEAVY_FEATURES = 8
LARGE_MODEL = "bench-large-forest"

FOREST_PROPERTIES = {
    "bench-forest-b1": "batch_size=1\n",
    "bench-forest-b32": "batch_size=32\nmax_batch_delay=5\n",
}


def bench_cache() -> Path:
    """The folder the bench keeps what it builds between runs (stores, a peer's venv)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmserver-bench"


def default_store() -> Path:
    return bench_cache() / "store-1000"


def ensure_reference(store: Path, count: int = 1000) -> None:
    """Write the reference store into ``store`` unless it is already there."""
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "generate_store.py"),
            "--out",
            str(store),
            "--count",
            str(count),
        ],
        check=True,
        timeout=600,
    )


def ensure_forests(store: Path) -> None:
    """Write the two forest models into ``store`` unless this scikit-learn version did."""
    import joblib
    import numpy as np
    import sklearn
    from sklearn.ensemble import RandomForestRegressor

    stamp = store / FOREST_STAMP
    want = f"sklearn={sklearn.__version__}\n"
    if (
        stamp.is_file()
        and stamp.read_text() == want
        and all((store / name / "model.joblib").is_file() for name in FOREST_PROPERTIES)
    ):
        return
    rng = np.random.default_rng(42)
    x = rng.uniform(0.0, 1.0, size=(1000, 1))
    y = 2.0 * x[:, 0] + 1.0 + rng.normal(0.0, 0.05, size=1000)
    forest = RandomForestRegressor(n_estimators=100, random_state=42).fit(x, y)
    for name, properties in FOREST_PROPERTIES.items():
        folder = store / name
        folder.mkdir(parents=True, exist_ok=True)
        joblib.dump(forest, folder / "model.joblib")
        (folder / "serving.properties").write_text(properties)
    stamp.write_text(want)


def ensure_heavy(store: Path) -> None:
    """Write the neighbour section's heavy forest into ``store`` unless this scikit-learn
    version did."""
    _ensure_large(store)
    folder = store / HEAVY_MODEL
    folder.mkdir(parents=True, exist_ok=True)
    # Heavy by its own predict: the section needs a model that holds a backend for
    # milliseconds, not the ~0.2 ms the converted forest takes.
    (folder / "serving.properties").write_text("option.fast_path=false\n")
    write_forest(folder, FOREST_STAMP, HEAVY_FEATURES, rows=20000, trees=300, depth=14, seed=7)


def _ensure_large(store: Path) -> None:
    """Write the neighbour section's large-request model into ``store`` unless this
    scikit-learn version did: a forest whose one row costs little on its chosen path (about as
    much as a reference model's) and a thousand rows some milliseconds."""
    folder = store / LARGE_MODEL
    write_forest(folder, FOREST_STAMP, HEAVY_FEATURES, rows=5000, trees=200, depth=12, seed=11)


def write_forest(
    folder: Path, stamp_name: str, features: int, *, rows: int, trees: int, depth: int, seed: int
) -> None:
    """A RandomForestRegressor fitted on ``rows`` rows of ``features`` uniform features
    (y = sum of sin(3x) plus noise) as ``folder/model.joblib``, predicting in one thread as a
    served model usually does; kept while the stamp ``stamp_name`` says this scikit-learn
    version wrote it."""
    import joblib
    import numpy as np
    import sklearn
    from sklearn.ensemble import RandomForestRegressor

    stamp = folder / stamp_name
    want = f"sklearn={sklearn.__version__}\n"
    if stamp.is_file() and stamp.read_text() == want and (folder / "model.joblib").is_file():
        return
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=(rows, features))
    y = np.sin(3 * x).sum(axis=1) + rng.normal(0.0, 0.1, size=len(x))
    forest = RandomForestRegressor(
        n_estimators=trees, max_depth=depth, random_state=seed, n_jobs=-1
    ).fit(x, y)
    forest.n_jobs = None
    folder.mkdir(parents=True, exist_ok=True)
    joblib.dump(forest, folder / "model.joblib")
    stamp.write_text(want)
