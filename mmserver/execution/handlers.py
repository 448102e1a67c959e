"""What every model handler is and shares: the :class:`Predictor` protocol the backend calls,
the batch it takes, and the checks of what a model answers. Runs inside the backend processes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from mmserver.codecs.schema import Inputs
from mmserver.codecs.tabular import Table
from mmserver.errors import ModelError

#: A batch as the model takes it: rows of numbers, or a table of typed columns.
Batch = np.ndarray | Table


class Predictor(Protocol):
    """A loaded model. ``predict`` takes a batch of what the model takes (``inputs``) and
    returns one output per row.

    ``outputs`` names what the model can answer, ``predict``'s answer first; ``output`` answers
    the batch with one of them (the V2 API's requested outputs)."""

    n_features: int | None
    outputs: tuple[str, ...]
    inputs: Inputs

    def predict(self, batch: Batch) -> np.ndarray | list[Any]: ...

    def output(self, name: str, batch: Batch) -> np.ndarray | list[Any]: ...


def n_features(model: Any) -> int | None:
    """``n_features_in_`` of the estimator, or of a pipeline's first step."""
    for candidate in (model, step(model, 0)):
        if candidate is None:
            continue
        try:
            value = getattr(candidate, "n_features_in_", None)
        except Exception:  # an unfitted estimator's property may raise anything
            value = None
        if isinstance(value, int | np.integer) and not isinstance(value, bool):
            return int(value)
    return None


def step(model: Any, index: int) -> Any:
    """The estimator of a pipeline's step ``index`` (``None`` if ``model`` is no pipeline)."""
    steps = getattr(model, "steps", None)
    if (
        isinstance(steps, list)
        and steps
        and isinstance(steps[index], tuple)
        and len(steps[index]) == 2
    ):
        return steps[index][1]
    return None


def check_rows(out: Any, batch: Any) -> np.ndarray | list[Any]:
    """``out``, a model's answer to ``batch``, as one item per row; :class:`ModelError` when it
    is not a sequence of that many."""
    expected = len(batch)
    if isinstance(out, np.ndarray):
        got = out.shape[0] if out.ndim > 0 else None
        result: np.ndarray | list[Any] = out
    elif isinstance(out, list | tuple):
        got = len(out)
        result = list(out)
    elif (
        hasattr(out, "__len__")
        and hasattr(out, "__iter__")
        and not isinstance(out, Mapping | str | bytes)
    ):
        result = list(out)  # e.g. a pandas Series
        got = len(result)
    else:
        raise ModelError(
            f"model returned {type(out).__name__}; expected a list or array with one item "
            f"per input row ({expected})"
        )
    if got != expected:
        raise ModelError(f"model returned {got} rows for {expected} inputs")
    return result
