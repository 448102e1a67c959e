"""What a fitted model says of the input it takes: the column names it was fitted on and their
kinds, read from its encoders and, for a booster, from what its family knows of it
(:class:`~mmserver.execution.families.Family`). Runs inside the backend processes, at load."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mmserver.codecs.schema import CATEGORY, NUMBER, STRING, Column
from mmserver.execution.families import Family, owner
from mmserver.execution.handlers import step


def feature_names(model: Any) -> list[str] | None:
    """The column names the model was fitted on: ``feature_names_in_`` of the estimator or of a
    pipeline's first step, or the feature names a booster keeps (LightGBM's generic
    ``Column_N`` names and XGBoost's ``fN`` ones are no names)."""
    for candidate in (model, step(model, 0)):
        if candidate is None:
            continue
        try:
            names = getattr(candidate, "feature_names_in_", None)
        except Exception:
            names = None
        if isinstance(names, np.ndarray) and names.ndim == 1 and names.dtype.kind in "OU":
            return [str(n) for n in names]
    family, booster = _booster(model)
    if family is None or family.feature_names is None:
        return None
    try:
        return family.feature_names(booster)
    except Exception:
        return None


def fitted_columns(model: Any, names: Sequence[str]) -> list[Column]:
    """The columns of a model fitted on a DataFrame with ``names``, their kinds from its
    encoders and its booster."""
    columns = [Column(name) for name in names]
    for index, column in _encoded(model, len(names)):
        columns[index] = replace(column, name=names[index])
    family, booster = _booster(model)
    if family is not None and family.categories is not None:
        for index, categories in family.categories(booster, len(names)):
            columns[index] = Column(names[index], CATEGORY, categories)
    if family is not None and family.kinds is not None:
        for index, kind in family.kinds(booster):
            columns[index] = Column(names[index], kind)
    return columns


def _booster(model: Any) -> tuple[Family | None, Any]:
    """The family of the booster that ends ``model`` (itself, or a pipeline's last step) and
    that estimator; ``(None, ...)`` when it ends in no booster."""
    final = step(model, -1)
    estimator = model if final is None else final
    return owner(estimator), estimator


def _encoded(model: Any, width: int) -> Iterator[tuple[int, Column]]:
    """``(input index, column)`` of each input a fitted encoder reads categories from: a
    ColumnTransformer's (first in a pipeline, or a HistGradientBoosting model's own for its
    categorical features), or the first step's."""
    head = step(model, 0) or model
    final = step(model, -1) or model
    for candidate in (head, getattr(final, "_preprocessor", None)):
        transformers = getattr(candidate, "transformers_", None)
        indices = getattr(candidate, "_transformer_to_input_indices", None)
        if isinstance(transformers, list) and isinstance(indices, dict):
            for name, transformer, _ in transformers:
                taken = list(indices.get(name, ()))
                yield from _string_inputs(transformer, taken)
            return
    yield from _string_inputs(head, list(range(width)))


def _string_inputs(transformer: Any, taken: list[int]) -> Iterator[tuple[int, Column]]:
    """The columns among ``taken`` (the inputs of ``transformer``, in order) an encoder reads:
    strings, or numbers that are categories (closed where the encoder fails on others)."""
    steps = getattr(transformer, "steps", None)
    parts = [s for _, s in steps] if isinstance(steps, list) else [transformer]
    for part in parts:
        categories = getattr(part, "categories_", None)
        if isinstance(categories, list) and len(categories) == len(taken):
            closed = getattr(part, "handle_unknown", "error") == "error"
            for index, values in zip(taken, categories, strict=True):
                if not isinstance(values, np.ndarray):
                    continue
                if values.dtype.kind in "OU":
                    known = tuple(v for v in values.tolist() if isinstance(v, str))
                    yield index, Column("", STRING, known, closed)
                elif values.dtype.kind in "iuf":
                    yield index, Column("", NUMBER, tuple(values.tolist()), closed)
            return
        statistics = getattr(part, "statistics_", None)
        if isinstance(statistics, np.ndarray) and statistics.dtype.kind == "O":
            for index, value in zip(taken, statistics.tolist(), strict=False):
                if isinstance(value, str):
                    yield index, Column("", STRING)
