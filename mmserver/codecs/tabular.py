"""Requests as columns: rows, records and named columns to a model's inputs, and batches to one
DataFrame (runs where the model runs, a backend process).

:func:`to_columns` takes what a request body held, in any of the forms
:mod:`mmserver.codecs.requests`
reads — rows by position, with or without column names, records (one object per row), or one
list per named column — and gives the model's columns in its order, each checked against its
kind (:mod:`mmserver.codecs.schema`): numbers (booleans count as 1 and 0), strings, booleans,
categories.
``null`` (and NaN) is a missing value: NaN in a number column, ``None`` in the others, refused
where the model does not take one. Every error names the column and the row.

A model fitted on numbers only gets the columns as one float64 matrix (:func:`dense`); any other
gets a :class:`Table`, and each batch of them becomes one DataFrame (:func:`to_frame`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserver.codecs.schema import BOOLEAN, CATEGORY, NUMBER, STRING, Column, Inputs
from mmserver.errors import InvalidInput

#: A request's rows in one of three shapes: ``("rows", names or None, rows)``,
#: ``("records", None, records)`` or ``("columns", names, one list per name)``.
Form = tuple[str, Sequence[str] | None, Sequence[Any]]

_MISSING = object()


class Table:
    """Rows as columns, in the model's order: float64 for numbers, object arrays for strings
    and categories, bool (object when one is missing) for booleans."""

    __slots__ = ("columns", "rows")

    def __init__(self, columns: list[np.ndarray], rows: int) -> None:
        self.columns = columns
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, len(self.columns))


def merge_tables(parts: Sequence[Table]) -> Table:
    """The rows of every part, in order, as one table."""
    if len(parts) == 1:
        return parts[0]
    columns = [np.concatenate([p.columns[j] for p in parts]) for j in range(len(parts[0].columns))]
    return Table(columns, sum(p.rows for p in parts))


def to_frame(batch: Table | np.ndarray, inputs: Inputs) -> Any:
    """One DataFrame of a batch, with the model's column names and a dtype per column."""
    import pandas as pd

    if isinstance(batch, np.ndarray):
        return pd.DataFrame(batch, columns=list(inputs.names), copy=False)
    data: dict[str, Any] = {}
    for column, values in zip(inputs.columns, batch.columns, strict=True):
        if column.kind == CATEGORY:
            data[column.name] = pd.Categorical(values, categories=column.categories)
        else:
            data[column.name] = values
    return pd.DataFrame(data, copy=False)


def row_table(columns: Sequence[Column], row: Sequence[Any]) -> Table:
    """A table of one row of values (the load's probes)."""
    return Table([_array([v], c) for c, v in zip(columns, row, strict=True)], 1)


# ------------------------------------------------------------------------------------------------
# Forms to columns
# ------------------------------------------------------------------------------------------------


def to_columns(form: Form, inputs: Inputs, model: str) -> tuple[list[list[Any]], int]:
    """The values of each of the model's columns, in its order, and the number of rows. Raises
    :class:`InvalidInput` for unknown, lacking or repeated columns and ragged rows."""
    shape, names, items = form
    columns = inputs.columns
    if shape == "records":
        return _from_records(items, inputs, model)
    if shape == "columns":
        assert names is not None
        positions = _positions(names, inputs, model, "")
        lengths = {len(v) for v in items}
        if len(lengths) > 1:
            raise InvalidInput(
                "the columns hold different numbers of values; each column needs one per row"
            )
        rows = lengths.pop() if lengths else 0
        return [list(items[positions[j]]) for j in range(len(columns))], rows
    width = len(columns)
    if names is not None:
        positions = _positions(names, inputs, model, " of the header")
        width = len(names)
    for i, row in enumerate(items):
        if not isinstance(row, list):
            raise InvalidInput(
                f"row {i} is a JSON {json_kind(row)}; expected every row to be a list of values"
            )
        if len(row) != width:
            raise InvalidInput(
                f"row {i} has {len(row)} values; {model} takes {width} column(s)"
                + ("" if names is not None else f" ({', '.join(inputs.names)})")
            )
    if names is None:
        return [[row[j] for row in items] for j in range(width)], len(items)
    return [[row[positions[j]] for row in items] for j in range(len(columns))], len(items)


def _positions(names: Sequence[str], inputs: Inputs, model: str, where: str) -> list[int]:
    """For each of the model's columns, its position among ``names``."""
    index: dict[str, int] = {}
    known = set(inputs.names)
    for position, name in enumerate(names):
        if not isinstance(name, str):
            raise InvalidInput(f"column name {name!r}{where} is not a string")
        if name not in known:
            raise InvalidInput(_unknown(name, inputs, model))
        if name in index:
            raise InvalidInput(f"column {name!r} is named twice{where.replace(' of ', ' in ')}")
        index[name] = position
    lacking = [c for c in inputs.names if c not in index]
    if lacking:
        raise InvalidInput(
            f"column {lacking[0]!r} is missing{where}; {model} takes {', '.join(inputs.names)}"
        )
    return [index[c] for c in inputs.names]


def _from_records(
    records: Sequence[Any], inputs: Inputs, model: str
) -> tuple[list[list[Any]], int]:
    names = inputs.names
    known = set(names)
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise InvalidInput(
                f"record {i} is a JSON {json_kind(record)}; expected an object of column: value"
            )
        if len(record) != len(names) or not known.issuperset(record):
            for key in record:
                if key not in known:
                    raise InvalidInput(f"record {i}: {_unknown(key, inputs, model)}")
            lacking = next(c for c in names if c not in record)
            raise InvalidInput(
                f"record {i} lacks column {lacking!r}; {model} takes {', '.join(names)} "
                "(send null for a missing value)"
            )
    return [[record[c] for record in records] for c in names], len(records)


def _unknown(name: str, inputs: Inputs, model: str) -> str:
    return f"column {name!r} is not one of {model}'s columns ({', '.join(inputs.names)})"


# ------------------------------------------------------------------------------------------------
# Columns to arrays
# ------------------------------------------------------------------------------------------------


def dense(values: list[list[Any]], rows: int, inputs: Inputs) -> np.ndarray:
    """Number columns as one C-contiguous float64 matrix, checked."""
    matrix = np.empty((rows, len(values)), dtype=np.float64)
    for j, (column, cells) in enumerate(zip(inputs.columns, values, strict=True)):
        matrix[:, j] = _array(cells, column)
    return matrix


def table(values: list[list[Any]], rows: int, inputs: Inputs) -> Table:
    """Columns of any kind as a :class:`Table`, each checked."""
    return Table(
        [_array(cells, column) for column, cells in zip(inputs.columns, values, strict=True)],
        rows,
    )


def _array(cells: Sequence[Any], column: Column) -> np.ndarray:
    kind = column.kind
    if kind == NUMBER:
        out = np.empty(len(cells), dtype=np.float64)
        for i, v in enumerate(cells):
            t = type(v)
            if t is float:
                if v != v or v in (math.inf, -math.inf):
                    v = _nan_or_refuse(v, column, i)
                out[i] = v
            elif t is int or t is bool:
                try:
                    out[i] = v
                except OverflowError:
                    raise _wrong(column, i, v, "a number within a float's range") from None
            elif v is None:
                out[i] = _nan_or_refuse(None, column, i)
            elif isinstance(v, int | float | np.number):
                out[i] = float(v)
            else:
                raise _wrong(column, i, v, "a number")
        if column.known:
            known = column.known
            for i, v in enumerate(out.tolist()):
                if v == v and v not in known:
                    raise _unknown_category(column, i, v)
        return out
    values: list[Any] = list(cells)
    for i, v in enumerate(values):
        if v is None or (type(v) is float and v != v):
            if not column.missing:
                raise _missing(column, i)
            values[i] = None
        elif kind == BOOLEAN:
            if type(v) is not bool:
                raise _wrong(column, i, v, "true or false")
        elif kind == STRING and type(v) is not str:
            raise _wrong(column, i, v, "a string")
        elif kind == CATEGORY and not isinstance(v, str | int | float):
            raise _wrong(column, i, v, "a category (a string or a number)")
        elif column.known and v not in column.known:
            raise _unknown_category(column, i, v)
    if kind == BOOLEAN and None not in values:
        return np.array(values, dtype=bool)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _unknown_category(column: Column, row: int, value: Any) -> InvalidInput:
    return InvalidInput(
        f"column {column.name!r}, row {row}: {value!r} is not a category the model knows "
        f"({_listing(column.categories or ())})"
    )


def _nan_or_refuse(value: Any, column: Column, row: int) -> float:
    if value is not None and value == value:  # an infinity: never a missing value
        raise InvalidInput(
            f"column {column.name!r}, row {row}: {value!r} is not finite; expected a number or "
            "null for a missing value"
        )
    if not column.missing:
        raise _missing(column, row)
    return math.nan


def _missing(column: Column, row: int) -> InvalidInput:
    return InvalidInput(
        f"column {column.name!r}, row {row}: the value is missing, and the model does not take "
        "missing values in this column"
    )


def _wrong(column: Column, row: int, value: Any, expected: str) -> InvalidInput:
    text = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return InvalidInput(
        f"column {column.name!r}, row {row}: {text} is {_article(json_kind(value))}; the model "
        "takes "
        f"{expected} in this column"
    )


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _listing(values: Sequence[Any], limit: int = 8) -> str:
    shown = ", ".join(repr(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (``null``, ``number``, ``array``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# ------------------------------------------------------------------------------------------------
# CSV cells
# ------------------------------------------------------------------------------------------------


def csv_cells(rows: list[list[str]], inputs: Inputs) -> list[list[Any]]:
    """CSV rows (text cells, by the model's column order) as values of each column's kind: an
    empty cell is a missing value."""
    out: list[list[Any]] = []
    for j, column in enumerate(inputs.columns):
        cells: list[Any] = []
        named = frozenset(v for v in column.categories or () if isinstance(v, str))
        for i, row in enumerate(rows):
            text = row[j]
            if not text.strip():
                cells.append(None)
            elif column.kind == NUMBER:
                flag = _CSV_NUMBERS.get(text.strip().lower())
                try:
                    cells.append(flag if flag is not None else float(text))
                except ValueError:
                    raise InvalidInput(
                        f"column {column.name!r}, line {i + 1}: {text[:40]!r} is not a number; "
                        "the model takes numbers in this column"
                    ) from None
            elif column.kind == BOOLEAN:
                flag = _BOOLEANS.get(text.strip().lower())
                if flag is None:
                    raise InvalidInput(
                        f"column {column.name!r}, line {i + 1}: {text[:40]!r} is not true or false"
                    )
                cells.append(flag)
            elif column.kind == CATEGORY and column.categories and text not in named:
                cells.append(_category(text, column))
            else:
                cells.append(text)
        out.append(cells)
    return out


_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}
#: A boolean in a number column (a model fitted on a bool column counts it as 1 and 0).
_CSV_NUMBERS = {"true": 1.0, "false": 0.0}


def _category(text: str, column: Column) -> Any:
    """A CSV cell of a category column whose categories are numbers."""
    for value in column.categories or ():
        if not isinstance(value, str) and str(value) == text:
            return value
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else number
