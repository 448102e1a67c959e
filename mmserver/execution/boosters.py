"""The bare boosters of XGBoost and LightGBM, loaded from their own formats, wrapped so that
``predict`` is the library's own (the families of :mod:`mmserver.execution.families`). Runs
inside the backend processes."""

from __future__ import annotations

from typing import Any

import numpy as np


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
