"""Real scikit-learn models for the tests, made on the fly in a given folder or archive.

They are built by ``scripts/generate_store.py`` (imported here by path, so the product package
holds no example code): the tests use exactly the models the reference store holds.

- :func:`make_linear_model` — ``model.joblib`` of y = 2x + 1 (1 feature; predicts ≈ 2.0 at 0.5)
- :func:`make_linear_archive` — the same packed as a ``.tar.gz`` with ``model.joblib`` at its root
- :func:`make_store` — the reference store: ``sklearn-0.tar.gz`` ... plus the example folders
- :func:`make_classifier_dir` — iris LogisticRegression with ``option.method=predict_proba``
- :func:`make_pipeline_dir` — Pipeline(StandardScaler, Ridge) on 3 features
- :func:`make_custom_handler_dir` — ``model.py`` answering ``{"value", "doubled"}`` per row
- :func:`make_tuned_dir` — the linear model with its own ``serving.properties``
- :data:`tree_models` — ``scripts/tree_models.py``: tree ensembles of every family
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from mmserver.codecs.answers import encode_as, response_type, wants_csv
from mmserver.codecs.requests import Request, decode_as, make_request

_SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load_script(stem: str) -> ModuleType:
    name = f"mmserver_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SCRIPTS / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


generator = _load_script("generate_store")
#: ``scripts/tree_models.py``: tree ensembles of every family, written as each family stores them.
tree_models = _load_script("tree_models")

#: Names of the example folders :func:`make_store` writes besides the ``sklearn-N`` archives.
EXAMPLE_NAMES: tuple[str, ...] = tuple(generator.EXAMPLES)


def make_linear_model(folder: Path) -> Path:
    """Write ``folder/model.joblib`` (y = 2x + 1 + noise, one feature); returns ``folder``."""
    return generator.write_linear_dir(Path(folder))  # type: ignore[no-any-return]


def make_linear_archive(path: Path) -> Path:
    """Write the reference ``.tar.gz`` (``model.joblib`` at its root) at ``path``; returns it."""
    return generator.write_linear_archive(Path(path))  # type: ignore[no-any-return]


def make_linked_store(root: Path, count: int) -> Path:
    """A store folder at ``root`` with ``count`` reference archives ``sklearn-N.tar.gz``, hard
    links of one archive (quick to make, the same model under ``count`` names)."""
    root.mkdir()
    archive = make_linear_archive(root / "sklearn-0.tar.gz")
    for i in range(1, count):
        os.link(archive, root / f"sklearn-{i}.tar.gz")
    return root


def make_store(root: Path, count: int) -> Path:
    """Write the reference store into ``root``: ``count`` archives and the examples."""
    generator.generate(Path(root), count)
    return Path(root)


def make_classifier_dir(folder: Path) -> Path:
    """Iris LogisticRegression (4 features, 3 classes) with ``option.method=predict_proba``."""
    return generator.write_classifier_dir(Path(folder))  # type: ignore[no-any-return]


def make_pipeline_dir(folder: Path) -> Path:
    """Pipeline(StandardScaler, Ridge) on 3 features, y = x0 + 2 x1 - 3 x2."""
    return generator.write_pipeline_dir(Path(folder))  # type: ignore[no-any-return]


def make_custom_handler_dir(folder: Path) -> Path:
    """Linear model plus ``model.py`` with ``load`` and ``predict`` (rows of dicts)."""
    return generator.write_custom_handler_dir(Path(folder))  # type: ignore[no-any-return]


def make_tuned_dir(folder: Path) -> Path:
    """Linear model with serving.properties: batch_size=8, max_batch_delay=5, workers 1..2."""
    return generator.write_tuned_dir(Path(folder))  # type: ignore[no-any-return]


def rows(values: Any) -> Request:
    """A JSON request for ``values`` (rows of numbers), as the HTTP layer hands it to the
    WorkLoadManager."""
    return make_request(json.dumps(np.asarray(values, dtype=float).tolist()).encode(), None, None)


def outputs(answer: bytes) -> list[Any]:
    """The predictions of a JSON answer's body."""
    predictions: list[Any] = json.loads(answer)["predictions"]
    return predictions


def value(answer: bytes) -> float:
    """The first prediction of a JSON answer's body, as a number."""
    return float(np.ravel(np.asarray(outputs(answer)))[0])


def decode(body: bytes, content_type: str | None) -> np.ndarray:
    """A body decoded as the server does it: its content type checked, then the body decoded."""
    rows = decode_as(body, make_request(body, content_type, None)[1])
    assert isinstance(rows, np.ndarray)  # a model that says nothing of its inputs: numbers
    return rows


def encode(outputs: Any, accept: str | None) -> tuple[bytes, str]:
    """Outputs encoded as the server answers a request with this ``Accept``: (body, type)."""
    csv_answer = wants_csv(accept)
    return encode_as(outputs, csv_answer), response_type(csv_answer)
