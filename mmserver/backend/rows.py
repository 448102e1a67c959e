"""A batch's rows, whichever requests they came from: merged into one call's rows, cut back into
one piece per request, and taken by index (runs where the model runs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserver import errors
from mmserver.codecs.tabular import Table, merge_tables

#: A batch's rows: a float64 matrix, or a table of typed columns.
Rows = np.ndarray | Table


def merge(parts: Sequence[Rows]) -> Rows:
    """The rows of every part, in order, as one 2-D array (or one table)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Table):
        return merge_tables(parts)  # type: ignore[arg-type]
    return np.concatenate(parts, axis=0)  # type: ignore[arg-type]


def split(outputs: Any, counts: Sequence[int]) -> list[Any]:
    """Cut ``outputs`` (one entry per input row) back into one piece per request."""
    total = sum(counts)
    if len(outputs) != total:
        raise errors.ModelError(f"the model returned {len(outputs)} outputs for {total} rows")
    if len(counts) == 1:
        return [outputs]
    pieces = []
    start = 0
    for count in counts:
        pieces.append(outputs[start : start + count])
        start += count
    return pieces


def take(rows: Rows, index: Sequence[int]) -> Rows:
    """The rows of ``rows`` at ``index``, in that order."""
    if len(index) == len(rows):
        return rows
    positions = np.asarray(index, dtype=np.intp)
    if isinstance(rows, Table):
        return Table([column[positions] for column in rows.columns], len(positions))
    return rows[positions]
