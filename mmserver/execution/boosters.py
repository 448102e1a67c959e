"""The bare boosters of XGBoost and LightGBM, loaded from their own formats, wrapped so that
``predict`` is the library's own, and what their families (:mod:`mmserver.execution.families`)
know of a booster, bare or in its scikit-learn wrapper: whether it is one, its native predict,
its treelite model, its own contributions (TreeSHAP), its columns' names and categories. Runs
inside the backend processes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mmserver.errors import ModelLoadError

XGBOOST, LIGHTGBM = "xgboost", "lightgbm"

Fn = Callable[[np.ndarray], Any]


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


def is_a(estimator: Any, package: str, base: str) -> bool:
    """Whether ``estimator`` is an instance of ``package``'s class ``base``, told by its
    classes' names: the package is not imported (it may not be installed)."""
    kind: type = type(estimator)
    return _class_is_a(kind, package, base)


@functools.lru_cache(maxsize=1024)
def _class_is_a(kind: type, package: str, base: str) -> bool:
    # Asked several times a load, of a handful of classes: the answer is kept by class.
    return any(
        cls.__name__ == base and cls.__module__.split(".")[0] == package for cls in kind.__mro__
    )


def owns_xgboost(est: Any) -> bool:
    return isinstance(est, XGBoostBooster) or is_a(est, XGBOOST, "XGBModel")


def xgboost_booster(est: Any) -> Any:
    return est.booster if isinstance(est, XGBoostBooster) else est.get_booster()


def xgboost_native(est: Any) -> Fn:
    inplace = xgboost_booster(est).inplace_predict
    return lambda batch: inplace(batch)


def xgboost_treelite(est: Any) -> Any:
    import treelite

    return treelite.frontend.from_xgboost(xgboost_booster(est))


#: A booster's contributions on a batch: ``(values[row, output, column], base[row, output])``.
Contributions = Callable[[Any], tuple[np.ndarray, np.ndarray]]


def xgboost_contributions(est: Any) -> Contributions:
    """XGBoost's exact TreeSHAP (``pred_contribs``) of the margin, on one thread."""
    import xgboost

    booster = xgboost_booster(est)
    names, types = booster.feature_names, booster.feature_types

    def contributions(batch: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(batch, np.ndarray):
            data = xgboost.DMatrix(batch, feature_names=names, feature_types=types, nthread=1)
        else:  # a DataFrame: its columns name themselves
            data = xgboost.DMatrix(batch, nthread=1, enable_categorical=True)
        out = np.asarray(booster.predict(data, pred_contribs=True), dtype=np.float64)
        return _values_and_bias(out if out.ndim == 3 else out[:, None, :])

    return contributions


def _values_and_bias(out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A library's contributions (the bias in the last column) as values and base."""
    return out[:, :, :-1], out[:, :, -1]


def xgboost_names(est: Any) -> list[str] | None:
    names = list(xgboost_booster(est).feature_names or [])
    return named(names, [f"f{j}" for j in range(len(names))])


def named(names: list[Any], generic: list[str]) -> list[str] | None:
    return [str(n) for n in names] if names and names != generic else None


def owns_lightgbm(est: Any) -> bool:
    return isinstance(est, LightGBMBooster) or is_a(est, LIGHTGBM, "LGBMModel")


def lightgbm_booster(est: Any) -> Any:
    return est.booster if isinstance(est, LightGBMBooster) else est.booster_


def lightgbm_native(est: Any) -> Fn | None:
    if isinstance(est, LightGBMBooster):
        return None  # a bare booster's own predict is its predict already
    run = est.booster_.predict
    return lambda batch: run(batch, num_threads=1)


def lightgbm_treelite(est: Any) -> Any:
    import treelite

    return treelite.frontend.from_lightgbm(lightgbm_booster(est))


def lightgbm_contributions(est: Any) -> Contributions:
    """LightGBM's exact TreeSHAP (``pred_contrib``) of the raw score, on one thread."""
    booster = lightgbm_booster(est)
    outputs = max(1, int(booster.num_model_per_iteration()))

    def contributions(batch: Any) -> tuple[np.ndarray, np.ndarray]:
        out = np.asarray(booster.predict(batch, pred_contrib=True, num_threads=1), np.float64)
        return _values_and_bias(out.reshape(len(out), outputs, -1))

    return contributions


def lightgbm_names(est: Any) -> list[str] | None:
    names = list(lightgbm_booster(est).feature_name())
    return named(names, [f"Column_{j}" for j in range(len(names))])


def lightgbm_categories(est: Any, width: int) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """``(input index, categories)`` of a LightGBM model's pandas categorical features."""
    booster = lightgbm_booster(est)
    categories = getattr(booster, "pandas_categorical", None)
    if not categories or not hasattr(booster, "model_to_string"):
        return
    try:
        text = booster.model_to_string(num_iteration=0)
    except Exception:
        return
    # The parameters at the end of the model text name the categorical features by index.
    line = next(
        (ln for ln in reversed(text.splitlines()) if ln.startswith("[categorical_feature:")), ""
    )
    listed = line.partition(":")[2].rstrip("]").strip()
    try:
        categorical = [int(j) for j in listed.replace(",", " ").split()]
    except ValueError:
        categorical = []
    if len(categorical) != len(categories) or any(not 0 <= j < width for j in categorical):
        raise ModelLoadError(
            "the LightGBM model's categorical features do not match its pandas categories; "
            "declare the columns (option.columns or input_schema.json)"
        )
    for index, values in zip(categorical, categories, strict=True):
        yield index, tuple(values)
