"""Which input column each column a pipeline's last step sees comes from, so that attributions
computed on the last step's columns are summed back to the model's input columns: a one-hot
encoded column's block to its source column, a scaler's or an imputer's column to its own.

A map is a 0/1 matrix of ``(columns the last step sees, input columns)``; attributions of the
last step's columns times the map are the input columns'. Only steps whose columns follow from
their inputs' are mapped: scalers, imputers, encoders, passthrough, and a ``ColumnTransformer``
of them (nested pipelines too); anything else (a PCA, a polynomial expansion) has no map.
Runs inside the backend processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Steps whose every output column is one input column, transformed on its own.
ELEMENTWISE = frozenset(
    {
        "StandardScaler",
        "MinMaxScaler",
        "MaxAbsScaler",
        "RobustScaler",
        "SimpleImputer",
        "OrdinalEncoder",
        "PowerTransformer",
        "QuantileTransformer",
    }
)


def column_map(steps: Sequence[Any], names: Sequence[str]) -> np.ndarray | None:
    """The map of a pipeline's steps before its last (``steps``) for inputs named ``names``
    (``None`` when a step's columns do not follow from its inputs')."""
    mapped: np.ndarray | None = np.eye(len(names))
    current = list(names)
    for step in steps:
        if step is None or step == "passthrough":
            continue
        assert mapped is not None
        inner = _step_map(step, current)
        if inner is None:
            return None
        mapped = inner @ mapped
        current = [f"x{j}" for j in range(inner.shape[0])]
    return mapped


def _step_map(step: Any, names: list[str]) -> np.ndarray | None:
    kind = type(step).__name__
    width = len(names)
    if kind == "Pipeline":
        return column_map([s for _, s in step.steps], names)
    if kind == "ColumnTransformer":
        return _columns_map(step, names)
    if kind == "OneHotEncoder":
        return _one_hot_map(step, width)
    if kind in ELEMENTWISE:
        if kind == "SimpleImputer" and (
            getattr(step, "add_indicator", False) or _dropped_columns(step, width)
        ):
            return None
        return np.eye(width)
    return None


def _dropped_columns(imputer: Any, width: int) -> bool:
    statistics = getattr(imputer, "statistics_", None)
    keep = getattr(imputer, "keep_empty_features", False)
    return statistics is not None and not keep and bool(np.isnan(_floats(statistics)).any())


def _floats(values: Any) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return np.zeros(len(values))


def _one_hot_map(encoder: Any, width: int) -> np.ndarray | None:
    if getattr(encoder, "_infrequent_enabled", False):
        return None  # its infrequent categories share a column: no block per column to sum
    categories = getattr(encoder, "categories_", None)
    if categories is None or len(categories) != width:
        return None
    drop = getattr(encoder, "drop_idx_", None)
    sizes = [len(c) - (drop is not None and drop[j] is not None) for j, c in enumerate(categories)]
    mapped = np.zeros((sum(sizes), width))
    row = 0
    for j, size in enumerate(sizes):
        mapped[row : row + size, j] = 1.0
        row += size
    return mapped


def _columns_map(transformer: Any, names: list[str]) -> np.ndarray | None:
    """A ``ColumnTransformer``'s map: each transformer's block of output columns from its
    input columns (by name, index, mask or slice)."""
    slices = getattr(transformer, "output_indices_", None)
    if slices is None:
        return None
    total = max((s.stop for s in slices.values()), default=0)
    mapped = np.zeros((total, len(names)))
    for name, step, columns in transformer.transformers_:
        if step == "drop":
            continue
        out = slices[name]
        positions = _positions(columns, names)
        if positions is None:
            return None
        if not positions:
            continue
        inner = (
            np.eye(len(positions))
            if step == "passthrough"
            else _step_map(step, [names[p] for p in positions])
        )
        if inner is None or inner.shape[0] != out.stop - out.start:
            return None
        block = np.zeros((inner.shape[0], len(names)))
        block[:, positions] = inner
        mapped[out] = block
    return mapped


def _positions(columns: Any, names: list[str]) -> list[int] | None:
    if isinstance(columns, slice):
        return list(range(len(names)))[columns]
    if isinstance(columns, str | int | np.integer):
        columns = [columns]
    array = np.asarray(columns)
    if array.dtype == bool:
        return [int(j) for j in np.flatnonzero(array)]
    positions = []
    for column in array.tolist():
        if isinstance(column, str):
            if column not in names:
                return None
            positions.append(names.index(column))
        elif isinstance(column, int) and 0 <= column < len(names):
            positions.append(column)
        else:
            return None
    return positions


def standardized(steps: Sequence[Any]) -> bool:
    """Whether the steps end by centring every column on its training mean (a
    ``StandardScaler`` with ``with_mean``, alone or on every column a ``ColumnTransformer``
    keeps): the last step's columns then have a training mean of 0."""
    kept = [s for s in steps if s is not None and s != "passthrough"]
    if not kept:
        return False
    last = kept[-1]
    kind = type(last).__name__
    if kind == "Pipeline":
        return standardized([s for _, s in last.steps])
    if kind == "StandardScaler":
        return bool(getattr(last, "with_mean", False))
    if kind == "ColumnTransformer":
        parts = [s for _, s, _ in last.transformers_ if s != "drop"]
        return bool(parts) and all(s != "passthrough" and standardized([s]) for s in parts)
    return False
