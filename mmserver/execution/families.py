"""Model families: which file of a model folder holds the model, and how to load it.

Runs inside the backend processes. Three families, told apart by their files unless ``engine``
(or ``option.model_file``) in ``serving.properties`` says:

- ``sklearn`` (``engine=Python`` or ``sklearn``): a pickle, ``model.joblib``, ``model.pkl`` or a
  single ``*.joblib``/``*.pkl``, loaded with joblib. It may hold any estimator or pipeline,
  including XGBoost's and LightGBM's scikit-learn wrappers, or a bare booster;
- ``xgboost`` (``engine=XGBoost``): XGBoost's own format, ``xgboost-model`` (the file of the
  SageMaker XGBoost container's ``model.tar.gz``: JSON, UBJSON or a pickle), ``model.json`` /
  ``model.ubj``, or a single ``*.ubj`` or XGBoost ``*.json``;
- ``lightgbm`` (``engine=LightGBM``): LightGBM's text format, ``model.txt`` or a single ``*.txt``
  that starts with LightGBM's ``tree`` header.

A bare booster is wrapped in :class:`XGBoostBooster` or :class:`LightGBMBooster`, whose
``predict`` is the library's own. XGBoost and LightGBM are optional extras: a model that needs
one that is not installed fails its load with a message saying what to install.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import joblib
import numpy as np

from mmserver.config.server import ModelConfig
from mmserver.errors import ModelLoadError

log = logging.getLogger(__name__)

SKLEARN, XGBOOST, LIGHTGBM = "sklearn", "xgboost", "lightgbm"
PICKLES = ("model.joblib", "model.pkl")
_EXTRAS = {XGBOOST: "xgboost", LIGHTGBM: "lightgbm"}
_HEAD = 4096


@dataclass(frozen=True)
class ModelFile:
    """The file holding a model and the family that reads it."""

    family: str
    path: Path


def reason(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def missing_extra(package: str) -> str:
    return (
        f"the {package} package is not installed; install it with "
        f"pip install 'mmserver[{package}]' (or pip install {package})"
    )


def find_model_file(
    model_dir: Path, config: ModelConfig, name: str | None = None
) -> ModelFile | None:
    """The model's file: ``option.model_file`` if given, else the first family (in the order
    sklearn, xgboost, lightgbm, or only ``engine``'s) with a file in the folder. Errors name the
    model ``name`` (by default the folder's name)."""
    name = model_dir.name if name is None else name
    engine = (config.engine or "").lower()
    wanted = (
        (engine,)
        if engine in (XGBOOST, LIGHTGBM)
        else ((SKLEARN,) if engine else (SKLEARN, XGBOOST, LIGHTGBM))
    )
    if config.model_file is not None:
        path = inside(model_dir, config.model_file, "option.model_file", name)
        if not path.is_file():
            raise ModelLoadError(
                f"model {name}: option.model_file={config.model_file!r} does not exist",
                model=name,
            )
        family = wanted[0] if engine else _family_of(path)
        return ModelFile(family, path)
    for family in wanted:
        candidate = _FINDERS[family](model_dir)
        if candidate is not None:
            return ModelFile(family, candidate)
    return None


def inside(model_dir: Path, relative: str, key: str, name: str) -> Path:
    """``model_dir / relative``, refused unless it stays inside the folder (``key`` is the
    property that named it; ``name`` the model)."""
    parts = Path(relative)
    if parts.is_absolute() or ".." in parts.parts or not parts.parts:
        raise ModelLoadError(
            f"model {name}: {key}={relative!r} must be a file inside the model folder",
            model=name,
        )
    return model_dir / parts


def _family_of(path: Path) -> str:
    if path.name == "xgboost-model" or path.suffix == ".ubj" or _is_xgboost_json(path):
        return XGBOOST
    if _is_lightgbm_text(path):
        return LIGHTGBM
    return SKLEARN


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(_HEAD)
    except OSError:
        return b""


def _is_xgboost_json(path: Path) -> bool:
    return path.suffix == ".json" and b'"learner"' in _head(path)


def _is_lightgbm_text(path: Path) -> bool:
    return _head(path).split(b"\n", 1)[0].strip() == b"tree"


def _single(files: list[Path]) -> Path | None:
    return files[0] if len(files) == 1 else None


def _files(model_dir: Path, pattern: str) -> list[Path]:
    return sorted(p for p in model_dir.glob(pattern) if p.is_file())


def _find_pickle(model_dir: Path) -> Path | None:
    for name in PICKLES:
        if (model_dir / name).is_file():
            return model_dir / name
    return _single(_files(model_dir, "*.joblib")) or _single(_files(model_dir, "*.pkl"))


def _find_xgboost(model_dir: Path) -> Path | None:
    for name in ("xgboost-model", "model.json", "model.ubj"):
        path = model_dir / name
        if path.is_file() and (path.suffix != ".json" or _is_xgboost_json(path)):
            return path
    return _single(_files(model_dir, "*.ubj")) or _single(
        [p for p in _files(model_dir, "*.json") if _is_xgboost_json(p)]
    )


def _find_lightgbm(model_dir: Path) -> Path | None:
    if (model_dir / "model.txt").is_file() and _is_lightgbm_text(model_dir / "model.txt"):
        return model_dir / "model.txt"
    return _single([p for p in _files(model_dir, "*.txt") if _is_lightgbm_text(p)])


_FINDERS = {SKLEARN: _find_pickle, XGBOOST: _find_xgboost, LIGHTGBM: _find_lightgbm}


def load_model(found: ModelFile) -> Any:
    """The model object in ``found``: an estimator, or a booster wrapped so that its
    ``predict`` is the library's own. Raises :class:`ModelLoadError` saying why not."""
    path = found.path
    if found.family == XGBOOST and _head(path)[:1] != b"\x80":  # not a pickle
        return XGBoostBooster(_load_booster(XGBOOST, path))
    if found.family == LIGHTGBM:
        return LightGBMBooster(_load_booster(LIGHTGBM, path))
    model = load_pickle(path)
    return wrap_booster(model)


def wrap_booster(model: Any) -> Any:
    """A bare XGBoost or LightGBM booster wrapped (unpickled ones too); a scikit-learn wrapper
    of one set to predict on one thread (see :class:`XGBoostBooster`); anything else as is."""
    module = type(model).__module__.split(".")[0]
    if type(model).__name__ == "Booster" and module == XGBOOST:
        return XGBoostBooster(model)
    if type(model).__name__ == "Booster" and module == LIGHTGBM:
        return LightGBMBooster(model)
    if module in (XGBOOST, LIGHTGBM) and hasattr(model, "set_params"):
        # A wrapper keeps the thread count it was trained with (XGBoost's 0 is every core).
        try:
            model.set_params(n_jobs=1)
            if module == XGBOOST:
                model.get_booster().set_param({"nthread": 1})
        except Exception as exc:  # a wrapper of another version: its own threads, but served
            log.warning("%s model: could not set one thread: %s", module, reason(exc))
    return model


def load_pickle(path: Path) -> Any:
    # A model pickled by another library version warns; that is the operator's to see in the
    # log, not an exception in the backend.
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = joblib.load(path)
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package in _EXTRAS.values():
            raise ModelLoadError(
                f"{path.name} holds a {package} model: {missing_extra(package)}"
            ) from None
        raise ModelLoadError(f"{path.name} cannot be loaded: {reason(exc)}") from None
    except Exception as exc:
        raise ModelLoadError(f"{path.name} cannot be loaded: {reason(exc)}") from None
    for w in caught:
        _report(path, w)
    return model


def _load_booster(family: str, path: Path) -> Any:
    package = _EXTRAS[family]
    try:
        if family == XGBOOST:
            import xgboost
        else:
            import lightgbm
    except ImportError:
        raise ModelLoadError(
            f"{path.name} is a {package} model: {missing_extra(package)}"
        ) from None
    except OSError as exc:  # its native library needs one the system lacks (libgomp, say)
        raise ModelLoadError(
            f"{path.name} is a {package} model, and {package} cannot load its native library: "
            f"{reason(exc)}"
        ) from None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            booster: Any
            if family == XGBOOST:
                booster = xgboost.Booster()
                # From memory, the format (JSON, UBJSON) is read from the bytes, whatever the
                # file's name.
                booster.load_model(bytearray(path.read_bytes()))
            else:
                booster = lightgbm.Booster(model_file=str(path))
    except Exception as exc:
        raise ModelLoadError(
            f"{path.name} cannot be loaded as a {package} model: {reason(exc)}"
        ) from None
    for w in caught:
        _report(path, w)
    return booster


#: The warnings of the load under way in this thread, when its caller collects them
#: (:func:`collecting_warnings`); otherwise each is logged.
_COLLECTED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "mmserver_load_warnings", default=None
)


@contextlib.contextmanager
def collecting_warnings() -> Iterator[list[str]]:
    """Collect the warnings a model file raises while it loads (``Category: message``), instead
    of logging each: the backend sends them to the frontend with the load's answer."""
    collected: list[str] = []
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


def _report(path: Path, w: warnings.WarningMessage) -> None:
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(f"{w.category.__name__}: {w.message}")
    else:
        log.warning("%s: %s: %s", path, w.category.__name__, w.message)


class XGBoostBooster:
    """An XGBoost booster loaded from its own format. ``predict`` is XGBoost's own
    (``Booster.predict`` on a ``DMatrix``), as in the SageMaker XGBoost container: the
    objective's output (values, or probabilities for a classification objective). It runs on
    one thread: a backend process is one core's worth of work, and threads of several processes
    spinning on the same cores slow every model down."""

    def __init__(self, booster: Any) -> None:
        import xgboost

        booster.set_param({"nthread": 1})
        self.booster = booster
        self.n_features_in_ = int(booster.num_features())
        self._matrix = xgboost.DMatrix

    def predict(self, batch: np.ndarray) -> np.ndarray:
        result: np.ndarray = self.booster.predict(self._matrix(batch, nthread=1))
        return result


class LightGBMBooster:
    """A LightGBM booster loaded from its text format; ``predict`` is LightGBM's own
    ``Booster.predict`` (on one thread, as :class:`XGBoostBooster`): the objective's output
    (values, or probabilities)."""

    def __init__(self, booster: Any) -> None:
        self.booster = booster
        self.n_features_in_ = int(booster.num_feature())

    def predict(self, batch: np.ndarray) -> np.ndarray:
        result: np.ndarray = self.booster.predict(batch, num_threads=1)
        return result
