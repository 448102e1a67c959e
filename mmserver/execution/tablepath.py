"""The compiled path of a pipeline fitted on a DataFrame (runs inside the backend processes).

A scikit-learn pipeline of a ColumnTransformer and an estimator spends most of a small batch's
time in its own machinery, not in arithmetic: pandas indexing per transformer, a validation per
step, and its per-call checks cost ~5-20 ms whatever the rows, so a batch of one row costs what
a batch of 32 does. When every transformer of its ColumnTransformer is one that is plain
arithmetic once fitted, :func:`compile_head` computes the same matrix straight from a batch's
columns (:class:`~mmserver.codecs.tabular.Table`):

- ``OneHotEncoder`` (string categories, no dropped or infrequent categories): a look-up of each
  value's position;
- ``SimpleImputer`` (a fitted statistic per column): missing values replaced by it;
- ``StandardScaler``: subtract the mean, divide by the scale;
- ``passthrough`` columns of numbers, and ``drop``;
- a ``Pipeline`` of these.

The last step then runs on that matrix: its own method, or one of its candidate paths
(:mod:`mmserver.execution.candidates`). :func:`plan_table_paths` verifies each against the
pipeline's own predict on probe rows of the model's columns (known categories, values it does not
know where it takes them, missing values where it takes them) exactly as
:mod:`mmserver.execution.fastpath` does for matrices, times them, and keeps the fastest verified one
per batch size; any doubt leaves the pipeline's own predict.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from mmserver.codecs.schema import BOOLEAN, NUMBER, Inputs
from mmserver.codecs.tabular import Table
from mmserver.execution.candidates import Fn, candidates, scaler_arithmetic, split_pipeline
from mmserver.execution.families import reason
from mmserver.execution.fastpath import (
    COMPILED,
    LARGE_ROWS,
    OWN,
    Candidate,
    Plan,
    disagreement,
    own_plan,
    timed_plan,
)

_PROBE_ROWS = 64
_TIMED_ROWS = 1024

#: A compiled transformer: the batch, the positions of its input columns -> its output matrix.
Step = Callable[[list[np.ndarray]], np.ndarray]


def compile_head(head: Any, inputs: Inputs) -> Callable[[Table], np.ndarray] | None:
    """The matrix ``head.transform`` makes of a batch, computed from its columns; ``None`` when
    a step is not one this knows."""
    steps = getattr(head, "steps", None)
    if not isinstance(steps, list) or not steps:
        return None
    first = _column_transformer(steps[0][1], inputs)
    if first is None:
        return None
    rest = [_numeric(step) for _, step in steps[1:]]
    if any(r is None for r in rest):
        return None
    after: list[Callable[[np.ndarray], np.ndarray]] = [r for r in rest if r is not None]

    def transform(batch: Table) -> np.ndarray:
        out = first(batch)
        for step in after:
            out = step(out)
        return out

    return transform


def _column_transformer(ct: Any, inputs: Inputs) -> Callable[[Table], np.ndarray] | None:
    transformers = getattr(ct, "transformers_", None)
    indices = getattr(ct, "_transformer_to_input_indices", None)
    if not isinstance(transformers, list) or not isinstance(indices, dict):
        return None
    kinds = [c.kind for c in inputs.columns]
    parts: list[tuple[list[int], Step]] = []
    for name, transformer, _ in transformers:
        taken = [int(i) for i in indices.get(name, ())]
        if transformer == "drop" or not taken:
            continue
        if transformer == "passthrough":
            if any(kinds[i] not in (NUMBER, BOOLEAN) for i in taken):
                return None
            parts.append((taken, _stack))
            continue
        step = _transformer(transformer)
        if step is None:
            return None
        parts.append((taken, step))
    if not parts:
        return None

    def transform(batch: Table) -> np.ndarray:
        columns = batch.columns
        pieces = [step([columns[i] for i in taken]) for taken, step in parts]
        return pieces[0] if len(pieces) == 1 else np.hstack(pieces)

    return transform


def _stack(columns: list[np.ndarray]) -> np.ndarray:
    """Columns of numbers (or booleans, ``None`` where one is missing) as a float matrix."""
    return np.column_stack([_floats(c) for c in columns])


def _floats(column: np.ndarray) -> np.ndarray:
    if column.dtype.kind != "O":
        return np.asarray(column, dtype=np.float64)
    return np.array([math.nan if v is None else v for v in column.tolist()], dtype=np.float64)


def _transformer(transformer: Any) -> Step | None:
    """A fitted transformer of raw columns as a :data:`Step`."""
    steps = getattr(transformer, "steps", None)
    if isinstance(steps, list) and steps:
        first = _transformer(steps[0][1])
        if first is None:
            return None
        rest = [_numeric(step) for _, step in steps[1:]]
        if any(r is None for r in rest):
            # A string imputer before an encoder: both on the raw columns.
            second = _transformer(steps[1][1]) if len(steps) == 2 else None
            if second is None or type(steps[0][1]).__name__ != "SimpleImputer":
                return None
            return _chain_raw(steps[0][1], second)
        after = [r for r in rest if r is not None]

        def chained(columns: list[np.ndarray]) -> np.ndarray:
            out = first(columns)
            for step in after:
                out = step(out)
            return out

        return chained
    kind = type(transformer).__name__
    if kind == "OneHotEncoder":
        return _one_hot(transformer)
    numeric = _numeric(transformer)
    if numeric is None:
        return None
    return lambda columns: numeric(_stack(columns))


def _numeric(step: Any) -> Callable[[np.ndarray], np.ndarray] | None:
    """A fitted step on a matrix of numbers, as arithmetic."""
    kind = type(step).__name__
    if kind == "StandardScaler":
        return scaler_arithmetic(step)
    if kind == "SimpleImputer" and not getattr(step, "add_indicator", False):
        stats = getattr(step, "statistics_", None)
        if not isinstance(stats, np.ndarray) or stats.dtype.kind != "f":
            return None
        if not np.isfinite(stats).all():
            return None  # a column all missing when fitted: the imputer drops or keeps it
        missing = step.missing_values
        if not (isinstance(missing, float) and math.isnan(missing)):
            return None
        return lambda x: np.where(np.isnan(x), stats, x)
    return None


def _one_hot(encoder: Any) -> Step | None:
    categories = getattr(encoder, "categories_", None)
    if (
        not isinstance(categories, list)
        or getattr(encoder, "drop_idx_", None) is not None
        or getattr(encoder, "_infrequent_enabled", False)
        or encoder.handle_unknown not in ("ignore", "error")
        or np.dtype(encoder.dtype) != np.float64
    ):
        return None
    lookups: list[dict[Any, int]] = []
    offsets: list[int] = []
    width = 0
    for values in categories:
        if not isinstance(values, np.ndarray) or values.dtype.kind != "O":
            return None
        lookup: dict[Any, int] = {}
        for j, value in enumerate(values.tolist()):
            if isinstance(value, float) and math.isnan(value):
                lookup[None] = j  # the missing value's own category
            elif isinstance(value, str):
                lookup[value] = j
            else:
                return None
        lookups.append(lookup)
        offsets.append(width)
        width += len(values)

    def encode(columns: list[np.ndarray]) -> np.ndarray:
        rows = len(columns[0])
        out = np.zeros((rows, width), dtype=np.float64)
        for column, lookup, offset in zip(columns, lookups, offsets, strict=True):
            get = lookup.get
            for i, value in enumerate(column.tolist()):
                j = get(value)
                if j is not None:
                    out[i, offset + j] = 1.0
        return out

    return encode


def _chain_raw(imputer: Any, encoder: Step) -> Step | None:
    """A string ``SimpleImputer`` (most frequent or constant) before an encoder."""
    stats = getattr(imputer, "statistics_", None)
    if (
        not isinstance(stats, np.ndarray)
        or stats.dtype.kind != "O"
        or getattr(imputer, "add_indicator", False)
        or not all(isinstance(s, str) for s in stats.tolist())
    ):
        return None
    missing = imputer.missing_values
    if not (missing is None or (isinstance(missing, float) and math.isnan(missing))):
        return None
    fills = stats.tolist()

    def imputed(columns: list[np.ndarray]) -> np.ndarray:
        filled = []
        for column, fill in zip(columns, fills, strict=True):
            values = column.tolist()
            if None in values:
                column = np.array([fill if v is None else v for v in values], dtype=object)
            filled.append(column)
        return encoder(filled)

    return imputed


# ------------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------------


def plan_table_paths(
    model: Any, method: str, own: Callable[[Any], Any], inputs: Inputs, batch_rows: int
) -> Plan | None:
    """The plan of a pipeline fitted on a DataFrame whose first steps compile
    (:func:`compile_head`); ``None`` when they do not."""
    started = time.perf_counter()
    head, last = split_pipeline(model)
    if head is None:
        return None
    transform = compile_head(head, inputs)
    if transform is None:
        return None
    own_last = getattr(last, method, None)
    if not callable(own_last):
        return None
    rejected: dict[str, str] = {}
    made = [(COMPILED, own_last)] + [
        (n, fn) for n, fn, _ in candidates(last, method, None, rejected)
    ]
    convert_s = time.perf_counter() - started
    batch_rows = min(batch_rows, _TIMED_ROWS)
    probes = probe_table(inputs)
    one = _rows(probes, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want_batch = np.asarray(own(probes))
            want_row = np.asarray(own(one))
    except Exception as exc:
        return own_plan(own, batch_rows, f"the own {method} fails on probe rows: {reason(exc)}")
    kept = [Candidate(OWN, own)]
    for name, fn in made:
        path = _behind(transform, fn, want_batch)
        why = disagreement(path, probes, want_batch) or disagreement(path, one, want_row)
        if why is None:
            kept.append(Candidate(name, path))
        else:
            rejected[name] = why
    if len(kept) == 1:
        return Plan([(math.inf, OWN, own)], batch_rows, rejected=rejected, convert_s=convert_s)
    full, large = _rows(probes, batch_rows), _rows(probes, LARGE_ROWS)
    return timed_plan(own, kept, one, full, batch_rows, rejected, convert_s, large=large)


def _behind(transform: Callable[[Table], np.ndarray], fn: Fn, like: np.ndarray) -> Fn:
    """``fn`` after the compiled columns, its answer in the own method's shape and type."""
    row_shape, dtype = like.shape[1:], like.dtype

    def path(batch: Any) -> np.ndarray:
        out = np.asarray(fn(transform(batch)))
        if out.shape[1:] != row_shape:
            out = out.reshape((len(batch), *row_shape))
        return out.astype(dtype, copy=False)

    return path


def probe_table(inputs: Inputs, rows: int = _PROBE_ROWS) -> Table:
    """Rows of the model's columns that reach every category it knows, and where the model
    takes them, values it does not know and missing values."""
    rng = np.random.default_rng(0)
    columns: list[np.ndarray] = []
    for column in inputs.columns:
        if column.kind == NUMBER:
            values = rng.normal(0.0, 3.0, rows) * rng.choice([1.0, 10.0, 100.0], rows)
            if column.missing:
                values[rng.random(rows) < 0.15] = np.nan
            columns.append(values)
            continue
        if column.kind == BOOLEAN:
            columns.append(rng.random(rows) < 0.5)
            continue
        pool: list[Any] = list(column.categories or ["a", "b", ""])
        if not column.closed:
            pool.append("\x00not a category")
        if column.missing:
            pool.append(None)
        picks = np.empty(rows, dtype=object)
        picks[:] = [pool[i % len(pool)] for i in rng.permutation(rows)]
        columns.append(picks)
    return Table(columns, rows)


def _rows(table: Table, count: int) -> Table:
    """``count`` rows of ``table``, repeated as needed."""
    take = np.arange(count) % table.rows
    return Table([c[take] for c in table.columns], count)
