"""Verified fast predict paths, chosen per model at load (runs inside the backend processes).

A tree ensemble's own ``predict`` is slow for the small batches an online service gets (a
300-tree random forest takes ~27 ms for one row, most of it per-call overhead). So at load, the
candidate paths of a model's method are built:

- ``own``: the estimator's own method (always there, and the fallback);
- ``linear``: ``X @ coef_ + intercept_`` for scikit-learn's linear regressors
  (:func:`linear_predict`);
- ``treelite``: the model converted to treelite and run by its GTIL interpreter, in this process
  (scikit-learn's forests, extra-trees, gradient boosting, histogram gradient boosting and
  isolation forest; XGBoost and LightGBM boosters), never compiled with a C toolchain;
- ``native``: an XGBoost or LightGBM booster's own predict, without its wrapper's checks;
- ``numpy``: a scikit-learn random forest's or extra-trees' node tables walked by NumPy for all
  trees and rows at once (:func:`mmserver.execution.candidates.forest_walk`).

For a pipeline whose last step has candidates, the steps before it transform the batch first.
A candidate is kept only if it gives the own method's answers on probe rows (rows that straddle
the model's split thresholds, where float32 and float64 comparisons part), for a batch and for
one row: the same shape and type, and values equal, or within 1e-9 of the largest answer. For a
model that takes missing values, the probes are checked again with NaN in some of their values;
a candidate that answers otherwise there is kept only for batches without a missing value
(:attr:`Plan.finite_only`). For a model fitted on a DataFrame of numbers, the own method gets the
batch as a DataFrame, the candidates as the matrix they compute on.
Each kept path is timed for one row, for a full batch and for :data:`LARGE_ROWS` rows (a request
may hold far more rows than a batch of requests: a batch transform's payload, a large
asynchronous input, and a forest's own predict, slow for one row, is the fastest there), and
each batch size goes to the path that is fastest at that size (costs taken as linear in the rows
between two measurements, and past the last along the last two). Any failure or doubt leaves
the own method. :class:`Plan` is the result.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmserver.execution.candidates import (
    LINEAR,
    NATIVE,
    NUMPY,
    TREELITE,
    Fn,
    candidates,
    split_pipeline,
)
from mmserver.execution.families import reason

OWN = "own"
#: A pipeline's last step on its compiled first steps (:mod:`mmserver.execution.tablepath`).
COMPILED = "compiled"
#: Every path's name, in the order of preference among equals.
PATHS = (LINEAR, NATIVE, NUMPY, TREELITE, COMPILED, OWN)

_PROBE_ROWS = 64
_RELATIVE = 1e-9
#: The most rows a full batch is timed with: a larger ``batch_size`` takes the path chosen
#: for this many rows.
_TIMED_ROWS = 1024
#: The rows of the large batch every path is also timed with, once (see the module docstring).
LARGE_ROWS = 256
#: Timing repeats: at least 2, at most 7, until this many seconds were spent on one size.
_TIME_BUDGET_S = 0.02
#: Past the large batch, the paths' costs are compared at rows that double up to this many.
_FARTHEST_ROWS = 1 << 30


@dataclass
class Candidate:
    name: str
    fn: Fn
    one_row_s: float | None = None
    batch_s: float | None = None
    large_s: float | None = None

    def cost(self, rows: int, batch_rows: int) -> float:
        """The cost of ``rows`` rows: along the line through the measurements on each side of
        it, past the last along the last two."""
        one = self.one_row_s or 0.0
        points = [(1, one)]
        if batch_rows > 1:
            points.append((batch_rows, self.batch_s if self.batch_s is not None else one))
        if self.large_s is not None and LARGE_ROWS > batch_rows:
            points.append((LARGE_ROWS, self.large_s))
        if len(points) == 1:
            return one * rows
        segment = 1
        while segment < len(points) - 1 and rows > points[segment][0]:
            segment += 1
        (r0, c0), (r1, c1) = points[segment - 1], points[segment]
        return max(0.0, c0 + (c1 - c0) * (rows - r0) / (r1 - r0))


@dataclass
class Plan:
    """Which path each batch size takes. ``routes`` are ``(last_rows, name, fn)`` in rising
    order of ``last_rows`` (the last one's is ``math.inf``)."""

    routes: list[tuple[float, str, Fn]]
    batch_rows: int
    measured: dict[str, tuple[float | None, float | None, float | None]] = field(
        default_factory=dict
    )
    rejected: dict[str, str] = field(default_factory=dict)
    convert_s: float = 0.0
    #: Paths that answer otherwise than the own method on a missing value: a batch that holds
    #: one goes to the own method.
    finite_only: frozenset[str] = frozenset()

    @property
    def uses(self) -> set[str]:
        return {name for _, name, _ in self.routes}

    def ranges(self) -> list[tuple[int, int | None, str]]:
        """``(first rows, last rows or None for any more, path)`` of each route."""
        out: list[tuple[int, int | None, str]] = []
        first = 1
        for last, name, _ in self.routes:
            out.append((first, None if last == math.inf else int(last), name))
            first = first if last == math.inf else int(last) + 1
        return out

    def describe(self) -> dict[str, Any]:
        """What the describe call shows: the path of each range of batch rows and what every
        kept path cost at load (ms for one row and for ``batchRows`` rows)."""
        return {
            "routes": [
                {"fromRows": first, "toRows": last, "path": name}
                for first, last, name in self.ranges()
            ],
            "batchRows": self.batch_rows,
            "largeRows": LARGE_ROWS,
            "measuredMillis": {
                name: {"oneRow": _ms(one), "batch": _ms(full), "large": _ms(large)}
                for name, (one, full, large) in self.measured.items()
            },
            "rejected": dict(self.rejected),
            "withoutMissingValuesOnly": sorted(self.finite_only),
            "conversionMillis": _ms(self.convert_s),
        }

    def _costs(
        self, measured: tuple[float | None, float | None, float | None] | None, start: str, end: str
    ) -> str:
        """A path's measured costs as the load line shows them (empty when not measured)."""
        if measured is None:
            return ""
        one, full, large = measured
        if one is None:
            return ""
        text = f"{one * 1000:.3f} ms at 1 row, {(full or 0) * 1000:.3f} ms at {self.batch_rows}"
        if large is not None:
            text += f", {large * 1000:.3f} ms at {LARGE_ROWS}"
        return start + text + end

    def summary(self) -> str:
        """One line for the load log."""
        parts = []
        for first, last, name in self.ranges():
            rows = (
                f"{first}+" if last is None else f"{first}" if last == first else f"{first}-{last}"
            )
            measured = self.measured.get(name)
            parts.append(f"{rows} rows: {name}{self._costs(measured, ' (', ')')}")
        own = self.measured.get(OWN)
        if own is not None and OWN not in self.uses and own[0] is not None:
            parts.append(f"own{self._costs(own, ' ', '')}")
        if self.convert_s:
            parts.append(f"converted in {self.convert_s * 1000:.0f} ms")
        return "; ".join(parts)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def own_plan(fn: Fn, batch_rows: int, why: str | None = None) -> Plan:
    return Plan([(math.inf, OWN, fn)], batch_rows, rejected={"all": why} if why else {})


def plan_paths(
    model: Any,
    method: str,
    own: Fn,
    n_features: int,
    batch_rows: int,
    *,
    frame: Fn | None = None,
    missing: bool = False,
) -> Plan:
    """Build, verify and time the candidate paths of ``model.<method>`` (``own``); the plan of
    which one each batch size takes. ``frame`` makes the DataFrame a pipeline's first steps
    take from a matrix (a model fitted on one); ``missing``: the model takes missing values,
    and the candidates are checked on them too."""
    started = time.perf_counter()
    batch_rows = min(batch_rows, _TIMED_ROWS)  # past it, the full batch's path (see routes)
    rejected: dict[str, str] = {}
    head, last = split_pipeline(model)
    made = candidates(last, method, head, rejected, frame)
    convert_s = time.perf_counter() - started
    if not made:
        return Plan([(math.inf, OWN, own)], batch_rows, rejected=rejected, convert_s=convert_s)
    probes = _probe_rows(n_features, [t for _, _, t in made], head)
    # One row is checked apart from the batch: a path may take another route for it (a
    # library's single-row code, BLAS's matrix-vector product). The linear product computes
    # the own predict's own expression (X @ coef + intercept) whatever the rows, so its batch
    # check covers one row, and a model with no other path is spared the own one-row call.
    one_row = any(name != LINEAR for name, _, _ in made)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "X does not have valid feature names"
            want_batch = own(probes)
            want_row = own(probes[:1]) if one_row else want_batch[:1]
    except Exception as exc:
        return own_plan(own, batch_rows, f"the own {method} fails on probe rows: {reason(exc)}")
    if not isinstance(want_batch, np.ndarray) or not isinstance(want_row, np.ndarray):
        return own_plan(own, batch_rows, f"the own {method} does not return an array")
    gaps = _with_gaps(probes) if missing else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want_gaps = None if gaps is None else np.asarray(own(gaps))
    except Exception:
        want_gaps = None  # the own method fails on these: batches with gaps fail the same way
    kept = [Candidate(OWN, own)]
    finite_only: set[str] = set()
    for name, fn, _ in made:
        fitted = _shaped(fn, want_batch)
        why = disagreement(fitted, probes, want_batch)
        if why is None and name != LINEAR:
            why = disagreement(fitted, probes[:1], want_row)
        if why is None:
            kept.append(Candidate(name, fitted))
            if gaps is not None and (
                want_gaps is None or disagreement(fitted, gaps, want_gaps) is not None
            ):
                finite_only.add(name)
        else:
            rejected[name] = why
    if len(kept) == 1:
        return Plan([(math.inf, OWN, own)], batch_rows, rejected=rejected, convert_s=convert_s)
    if [c.name for c in kept] == [OWN, LINEAR] and not finite_only:
        # The product is what the own predict computes after its checks: faster at any size,
        # and not worth the load time of measuring.
        return Plan(
            [(math.inf, LINEAR, kept[1].fn)], batch_rows, rejected=rejected, convert_s=convert_s
        )
    reps = -(-max(batch_rows, LARGE_ROWS) // len(probes))
    tiled = np.tile(probes, (reps, 1))
    full = np.ascontiguousarray(tiled[:batch_rows])
    large = np.ascontiguousarray(tiled[:LARGE_ROWS])
    return timed_plan(
        own, kept, probes[:1], full, batch_rows, rejected, convert_s, finite_only, large
    )


def timed_plan(
    own: Fn,
    kept: list[Candidate],
    one: Any,
    full: Any,
    batch_rows: int,
    rejected: dict[str, str],
    convert_s: float,
    finite_only: set[str] | frozenset[str] = frozenset(),
    large: Any = None,
) -> Plan:
    """The plan of the verified paths ``kept`` (the own method first), each timed on one row
    (``one``), on a full batch (``full``) and once on :data:`LARGE_ROWS` rows (``large``, when
    more than a full batch); the own method alone when timing fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in kept:
                c.one_row_s = fastest(c.fn, one)
                c.batch_s = fastest(c.fn, full) if batch_rows > 1 else c.one_row_s
                if large is not None and LARGE_ROWS > batch_rows:
                    c.large_s = fastest(c.fn, large, repeats=1)
    except Exception as exc:  # e.g. no memory for a huge batch: the own method, as any doubt
        return own_plan(own, batch_rows, f"the paths could not be timed: {reason(exc)}")
    return Plan(
        routes(kept, batch_rows),
        batch_rows,
        measured={c.name: (c.one_row_s, c.batch_s, c.large_s) for c in kept},
        rejected=rejected,
        convert_s=convert_s,
        finite_only=frozenset(finite_only),
    )


def _with_gaps(probes: np.ndarray) -> np.ndarray:
    """The probe rows with about a third of their values missing (NaN), one row all missing."""
    rng = np.random.default_rng(1)
    gaps = probes.copy()
    gaps[rng.random(gaps.shape) < 0.35] = np.nan
    gaps[0] = np.nan
    return gaps


# ------------------------------------------------------------------------------------------------
# Verifying and timing
# ------------------------------------------------------------------------------------------------


def _shaped(fn: Fn, like: np.ndarray) -> Fn:
    """``fn`` with its output in the own method's shape and type (per row)."""
    row_shape = like.shape[1:]
    dtype = like.dtype

    def shaped(batch: np.ndarray) -> np.ndarray:
        out = np.asarray(fn(batch))
        if out.shape[1:] != row_shape:
            out = out.reshape((len(batch), *row_shape))
        return out.astype(dtype, copy=False)

    return shaped


def disagreement(fn: Fn, rows: Any, want: np.ndarray) -> str | None:
    """Why ``fn(rows)`` is not ``want`` (``None`` when it is)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = np.asarray(fn(rows))
    except Exception as exc:
        return f"fails on probe rows: {reason(exc)}"
    if got.shape != want.shape:  # (the caller's candidates are cast to the own answer's type)
        return f"gives shape {list(got.shape)} where the own method gives {list(want.shape)}"
    if np.array_equal(got, want):
        return None
    if want.dtype.kind != "f":
        return "gives other answers on probe rows"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    worst = float(np.max(np.abs(got - want)))
    if math.isfinite(worst) and worst <= _RELATIVE * scale:
        return None
    return f"differs on probe rows by {worst:.3g} (largest answer {scale:.3g})"


def fastest(fn: Fn, rows: Any, repeats: int = 2) -> float:
    """The fastest of a few calls (at least ``repeats``, more while they are quick)."""
    best = math.inf
    spent = 0.0
    for repeat in range(7):
        started = time.perf_counter()
        fn(rows)
        took = time.perf_counter() - started
        best = min(best, took)
        spent += took
        if repeat + 1 >= repeats and spent > _TIME_BUDGET_S:
            break
    return best


def routes(kept: Sequence[Candidate], batch_rows: int) -> list[tuple[float, str, Fn]]:
    """The fastest path for every number of rows up to the largest measured, costs taken as
    lines between the measured points; past it (one request may hold many rows), the fastest
    at rows doubling from there, costs followed along the last two measurements."""
    order = {name: i for i, name in enumerate(PATHS)}
    routes: list[tuple[float, str, Fn]] = []

    def route(rows: int, last: int) -> None:
        c = min(kept, key=lambda c: (c.cost(rows, batch_rows), order[c.name]))
        if routes and routes[-1][1] == c.name:
            routes[-1] = (last, c.name, c.fn)
        else:
            routes.append((last, c.name, c.fn))

    measured = max(1, batch_rows)
    if any(c.large_s is not None for c in kept):
        measured = max(measured, LARGE_ROWS)
    for rows in range(1, measured + 1):
        route(rows, rows)
    rows = measured
    while rows < _FARTHEST_ROWS:
        route(2 * rows, 2 * rows)  # a change of path within a doubling takes its far end
        rows *= 2
    _, name, fn = routes[-1]
    routes[-1] = (math.inf, name, fn)
    return routes


def _probe_rows(n_features: int, tl_models: Sequence[Any], head: Any) -> np.ndarray:
    """Rows that take many branches of the model's trees: each value sits on, just below or
    just above one of the split thresholds of its feature (in float64 and in float32), with a
    few rows of plain random values and extreme ones."""
    rng = np.random.default_rng(0)
    rows = rng.normal(0.0, 3.0, (_PROBE_ROWS, n_features))
    rows[0] = 0.0
    rows[1] = 1e6
    rows[2] = -1e6
    thresholds = _thresholds(tl_models, n_features)
    for j, values in enumerate(thresholds):
        if not len(values):
            continue
        picks = rng.choice(values, _PROBE_ROWS)
        as32 = picks.astype(np.float32)
        nudged = np.stack(
            [
                picks,
                np.nextafter(picks, -np.inf),
                np.nextafter(picks, np.inf),
                as32.astype(np.float64),
                np.nextafter(as32, np.float32(np.inf)).astype(np.float64),
                np.nextafter(as32, np.float32(-np.inf)).astype(np.float64),
            ]
        )
        rows[3:, j] = nudged[rng.integers(0, len(nudged), _PROBE_ROWS), np.arange(_PROBE_ROWS)][3:]
    if head is not None and any(len(v) for v in thresholds):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = np.asarray(head.inverse_transform(rows), dtype=np.float64)
            if back.shape == rows.shape and np.isfinite(back).all():
                rows = back
        except Exception:
            pass  # the steps before cannot be inverted: the random rows stay
    return np.ascontiguousarray(rows, dtype=np.float64)


def _thresholds(tl_models: Sequence[Any], n_features: int) -> list[np.ndarray]:
    """Per feature, the split thresholds of the first trees of the treelite models."""
    found: list[list[np.ndarray]] = [[] for _ in range(n_features)]
    for tm in tl_models:
        if tm is None:
            continue
        try:
            for tree in range(min(int(tm.num_tree), 64)):
                accessor = tm.get_tree_accessor(tree)
                kinds = accessor.get_field("node_type")
                split = accessor.get_field("split_index")[kinds == 1]
                values = accessor.get_field("threshold")[kinds == 1].astype(np.float64)
                for j in np.unique(split):
                    if 0 <= j < n_features:
                        found[j].append(values[split == j])
        except Exception:
            continue  # another layout of treelite: random rows only
    return [np.unique(np.concatenate(v)) if v else np.empty(0) for v in found]
