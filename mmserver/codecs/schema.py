"""What a model takes as input: its columns, their kinds, and where it takes missing values.

Runs inside the backend processes, at load. A model fitted on a NumPy array takes a 2-D float64
matrix, as it always did (:attr:`Inputs.frame` is false, no pandas work per request). A model
fitted on a pandas DataFrame (it has ``feature_names_in_``, or a booster that names its features)
takes a DataFrame with those columns in its order, each of a kind:

- ``number``: float64 (integers too; a missing value is NaN);
- ``string``: Python strings in an object column (a missing value is ``None``);
- ``boolean``: ``True``/``False``;
- ``category``: a pandas categorical column with the categories the model was fitted on
  (LightGBM's ``pandas_categorical``).

The kinds come from a declared schema when there is one (``option.columns`` in
``serving.properties``, or ``input_schema.json`` beside the model file, in MLflow's column-spec
form), otherwise from the fitted model: a OneHotEncoder's or OrdinalEncoder's string categories
make a column a string one (and, with ``handle_unknown='error'``, its categories the only values
accepted), LightGBM's categorical features make category columns, everything else is a number.

Whether a model takes missing values is found by calling it at load (``option.missing_values``,
``auto`` by default): a row of valid values, then that row with each column missing in turn (all
columns at once for a matrix model). A column the model fails on refuses missing values with a
400 that names it (every column, when the model fails on the valid row itself); ``refuse``
refuses them everywhere, ``accept`` hands them all to the model. A custom handler is not probed:
it gets missing values only with ``accept``.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mmserver.codecs import mlmodel
from mmserver.errors import ModelLoadError

log = logging.getLogger(__name__)

NUMBER, STRING, BOOLEAN, CATEGORY = "number", "string", "boolean", "category"
KINDS = (NUMBER, STRING, BOOLEAN, CATEGORY)
#: MLflow's column types (and a few common spellings) to kinds.
_TYPE_NAMES = {
    "number": NUMBER,
    "double": NUMBER,
    "float": NUMBER,
    "long": NUMBER,
    "integer": NUMBER,
    "int": NUMBER,
    "string": STRING,
    "str": STRING,
    "boolean": BOOLEAN,
    "bool": BOOLEAN,
    "category": CATEGORY,
}
SCHEMA_FILE = "input_schema.json"


@dataclass(frozen=True, slots=True)
class Column:
    """One input column. ``categories``: the values the model knows (a category column's, or a
    string column's when ``closed``: any other value is refused, as the model's encoder would
    fail on it). ``missing``: whether the model takes a missing value here."""

    name: str
    kind: str = NUMBER
    categories: tuple[Any, ...] | None = None
    closed: bool = False
    missing: bool = True
    #: The categories of a closed column, for a look-up per value (numbers as floats).
    known: frozenset[Any] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        known: frozenset[Any] = frozenset()
        if self.closed and self.categories is not None:
            known = frozenset(
                float(v) if self.kind == NUMBER else v
                for v in self.categories
                if not (isinstance(v, float) and math.isnan(v))
            )
        object.__setattr__(self, "known", known)


@dataclass(frozen=True, slots=True)
class Inputs:
    """What a model takes. ``columns`` is empty when the model does not say (a custom handler,
    or a model that does not tell its width); ``frame``: the model takes a DataFrame (it was
    fitted on one), else a float64 matrix; ``raw``: a custom handler that takes each request as
    it came; ``missing``: a matrix model takes missing values (NaN); ``sparse_missing``: an index
    a libsvm row leaves out is a missing value (XGBoost's and LightGBM's reading), not 0."""

    columns: tuple[Column, ...] = ()
    frame: bool = False
    raw: bool = False
    missing: bool = True
    sparse_missing: bool = False
    #: A CSV body's first line names the columns (``option.csv_header``).
    csv_header: bool = False
    #: Read and answer as the SageMaker XGBoost container does (``option.sagemaker_xgboost``):
    #: a body without a ``Content-Type`` is CSV, and answers are its CSV line or JSON array.
    sagemaker_xgboost: bool = False
    #: Read per request, so kept, not derived each time: the number of columns (``None`` when
    #: not known), their names, and whether every column is a number (the rows then travel as
    #: one float64 matrix).
    width: int | None = field(init=False, compare=False)
    names: tuple[str, ...] = field(init=False, compare=False)
    dense: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "width", len(self.columns) or None)
        object.__setattr__(self, "names", tuple(c.name for c in self.columns))
        object.__setattr__(self, "dense", all(c.kind == NUMBER for c in self.columns))

    def describe(self) -> list[dict[str, Any]]:
        """Per column its name, kind and whether it takes missing values (the signature)."""
        return [
            {
                "name": c.name,
                "kind": c.kind,
                "missing": c.missing,
                **({"categories": list(c.categories)} if c.categories is not None else {}),
            }
            for c in self.columns
        ]


def matrix_inputs(width: int | None, missing: bool = True) -> Inputs:
    """The inputs of a model fitted on arrays: ``width`` unnamed numbers."""
    return Inputs(
        tuple(Column(f"x{j}", missing=missing) for j in range(width or 0)), missing=missing
    )


# ------------------------------------------------------------------------------------------------
# Declared schemas
# ------------------------------------------------------------------------------------------------


def declared(
    model_dir: Path, properties: Mapping[str, str], names: Container[str] | None = None
) -> list[Column] | None:
    """The columns ``option.columns`` (``name:kind, ...``), ``input_schema.json`` or an MLflow
    folder's signature (:mod:`mmserver.codecs.mlmodel`) declare. ``names``: the names of the
    folder's files, when they were listed already (``None``: each file is looked for)."""
    text = properties.get("option.columns")
    if text is not None:
        columns = []
        for part in text.split(","):
            name, _, kind = part.strip().rpartition(":")
            if not name:
                name, kind = kind, NUMBER
            columns.append(_column(name.strip(), kind.strip(), "option.columns"))
        return _unique(columns, "option.columns")

    def has(file: str) -> bool:
        return (model_dir / file).is_file() if names is None else file in names

    if not has(SCHEMA_FILE):
        if not has(mlmodel.MLMODEL):
            return None
        signed = mlmodel.signature_columns(mlmodel.read(model_dir / mlmodel.MLMODEL))
        if signed is None:
            return None
        where = f"{mlmodel.MLMODEL}'s signature"
        return _unique([_column(c["name"], c["type"], where) for c in signed], where)
    try:
        data = json.loads((model_dir / SCHEMA_FILE).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{SCHEMA_FILE} is not valid JSON: {exc}") from None
    if isinstance(data, dict):
        data = data.get("inputs")
    if not isinstance(data, list) or not all(
        isinstance(item, dict) and isinstance(item.get("name"), str) for item in data
    ):
        raise ModelLoadError(
            f'{SCHEMA_FILE} must be a list of columns, each {{"name": ..., "type": ...}}'
        )
    out = []
    for item in data:
        column = _column(item["name"], str(item.get("type", NUMBER)), SCHEMA_FILE)
        categories = item.get("categories")
        if categories is not None:
            if not isinstance(categories, list):
                raise ModelLoadError(f"{SCHEMA_FILE}: categories of {column.name!r} must be a list")
            column = replace(column, categories=tuple(categories), closed=column.kind == STRING)
        out.append(column)
    return _unique(out, SCHEMA_FILE)


def _column(name: str, kind: str, where: str) -> Column:
    found = _TYPE_NAMES.get(kind.lower())
    if not name or found is None:
        raise ModelLoadError(
            f"{where}: column {name!r} has type {kind!r}; expected one of "
            f"{', '.join(sorted(_TYPE_NAMES))}"
        )
    return Column(name, found)


def _unique(columns: list[Column], where: str) -> list[Column]:
    seen: set[str] = set()
    for c in columns:
        if c.name in seen:
            raise ModelLoadError(f"{where}: column {c.name!r} is declared twice")
        seen.add(c.name)
    if not columns:
        raise ModelLoadError(f"{where} declares no column")
    return columns


# ------------------------------------------------------------------------------------------------
# What the fitted model says
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Missing values
# ------------------------------------------------------------------------------------------------


def probe_missing(
    columns: Sequence[Column], call: Callable[[list[Column], list[Any]], Any], frame: bool
) -> list[Column]:
    """``columns`` with ``missing`` set to whether the model's own method (``call``, on one row
    of these values) answers when that column is missing. A model that fails on the valid row
    itself is left to say so at predict time (every column takes missing values)."""
    if not frame:
        # Rows of numbers: one call, a row of NaN. A model that fails on it (one that fails on
        # every row included) takes no missing values; one that fails on plain rows says so
        # at predict time.
        gaps = [float("nan")] * len(columns)
        ok = _answers(call, list(columns), gaps)
        return [replace(c, missing=ok) for c in columns]
    base = [_valid_value(c) for c in columns]
    if not _answers(call, list(columns), base):
        log.warning(
            "the model fails on a row of plain values (%s): it is not sent missing values; "
            "declare its columns if their kinds were not found right",
            ", ".join(f"{c.name}={v!r}" for c, v in zip(columns, base, strict=True)),
        )
        return [replace(c, missing=False) for c in columns]
    out = []
    for j, column in enumerate(columns):
        row = list(base)
        row[j] = float("nan") if column.kind == NUMBER else None
        out.append(replace(column, missing=_answers(call, list(columns), row)))
    return out


def _valid_value(column: Column) -> Any:
    if column.categories:
        return column.categories[0]
    return {NUMBER: 0.0, STRING: "", BOOLEAN: False, CATEGORY: None}[column.kind]


def _answers(
    call: Callable[[list[Column], list[Any]], Any], columns: list[Column], row: list[Any]
) -> bool:
    """Whether the model answers this row with values (an answer of NaN is no answer). The
    backends skip scikit-learn's finiteness checks; here they are on, so that a model that
    does not take NaN says so."""
    import sklearn

    try:
        with warnings.catch_warnings(), sklearn.config_context(assume_finite=False):
            warnings.simplefilter("ignore")
            answer = np.asarray(call(columns, row))
    except Exception:
        return False
    return not (answer.dtype.kind == "f" and bool(np.isnan(answer).any()))
