"""Sharing the backends fairly: measured cost per model, lanes, and which batch runs next.

Every backend slot belongs to a *lane*. The light lane's processes run at normal priority; the
heavy lane's processes run at a lower CPU weight (``nice``), so the operating system lets short
work preempt a long prediction, something Python cannot do inside one process, yet gives the
heavy lane its share of a busy CPU: light traffic that keeps every CPU busy slows a heavy model
down, it does not starve it. A model runs in the
lane its measured cost calls for (:func:`lane_for`): a model whose one-row batch would hold a
process for more than ``heavy_batch_ms`` (computing, or waiting on something;
:attr:`Cost.single`) moves to the heavy lane, and back once it takes less than half of that. A
cheap model that is popular makes large batches, which hold a process longer, but each of its
requests is still cheap: it stays in the light lane, where it would otherwise move back and
forth as its traffic rose and fell (each move starts its workers anew). A cost near the
threshold (between a quarter of it and twice it, where a busy machine's preemptions alone can
move a model's measure back and forth) moves a model at most once per :data:`LANE_DWELL_S`;
a cost clearly on one side moves it at once (:func:`may_move`). :func:`lane_now` decides both
from the cost, the lane, the clock and the last move. When the light lane is idle the heavy
lane's processes get the whole machine.

Within a lane, the frontend decides which batch runs next. A worker whose model has queued jobs
waits in its slot's :class:`RunQueue` (not in the slot's pipe), ordered by start-time fair
queuing over measured CPU time: a model's next batch is tagged with the virtual time its previous
batches have used, so a model with a deep queue gets one share of the lane, not all of it, and a
cheap model's batch goes ahead of an expensive one's. A slot admits another batch into its pipe
only while what is already there is cheap (:func:`admits`): batches never wait inside a process
behind an expensive one.
"""

from __future__ import annotations

import heapq
import math
from typing import TypeVar

LIGHT = "light"
HEAVY = "heavy"

#: The most estimated CPU time a slot's pipe may hold before it admits no more: a light batch
#: waits at most this long behind the batches sent before it, and the process never idles
#: between cheap batches while the frontend is busy.
PIPELINE_BUDGET_S = 0.001

#: Seconds a model stays in a lane before a cost near the threshold may move it again.
LANE_DWELL_S = 10.0

#: Weight of the newest batch in the moving averages of a model's cost.
_ALPHA = 0.2
#: The variance of the batch sizes (in rows squared) below which they are taken as one size and
#: the hold is not split (every row is taken to cost the same).
_STEADY_ROWS = 0.25


class Cost:
    """One model's measured cost: moving averages of the CPU seconds of a batch and of a row, of
    the seconds a batch holds its backend process (its CPU time or its wall time, whichever is
    longer: a model that waits on something holds the process as surely as one that computes),
    the totals, and the model's place in its lane's fair queue (``vfinish``).

    Updated once per batch on the event loop, so plain attributes: ``estimate`` is what the
    next batch is expected to hold its process, infinite while nothing is known."""

    __slots__ = (
        "_hh",
        "_n",
        "_nh",
        "_nn",
        "_probe",
        "batches",
        "cpu_seconds",
        "estimate",
        "hold",
        "per_batch",
        "per_row",
        "vfinish",
        "waited",
    )

    def __init__(self, hold: float | None = None) -> None:
        #: Seconds a batch holds its process (moving average), ``None`` until one was measured.
        self.hold = hold
        self.estimate = math.inf if hold is None else hold
        #: CPU seconds of a batch and of a row (moving averages).
        self.per_batch: float | None = None
        self.per_row: float | None = None
        self.cpu_seconds = 0.0
        self.batches = 0
        #: Batches of other models that ran on a slot while one of this model's waited there.
        self.waited = 0
        self.vfinish = 0.0
        # Moving averages of a batch's rows, hold, rows squared and rows times hold.
        self._n = self._hh = self._nn = self._nh = 0.0
        self._probe = 0.0

    def observe(self, cpu_seconds: float, wall_seconds: float, rows: int) -> None:
        """Count one batch of ``rows`` rows that took ``cpu_seconds`` of CPU and
        ``wall_seconds`` in its backend."""
        self.cpu_seconds += cpu_seconds
        self.batches += 1
        held = cpu_seconds if cpu_seconds > wall_seconds else wall_seconds
        per_row = cpu_seconds / rows if rows > 1 else cpu_seconds
        hold = self.hold
        self.hold = self.estimate = held if hold is None else hold + _ALPHA * (held - hold)
        if self.per_batch is None or self.per_row is None:
            self.per_batch, self.per_row = cpu_seconds, per_row
        else:
            self.per_batch += _ALPHA * (cpu_seconds - self.per_batch)
            self.per_row += _ALPHA * (per_row - self.per_row)
        n = float(rows if rows > 1 else 1)
        if self.batches == 1 and not self._probe:
            self._n, self._hh, self._nn, self._nh = n, held, n * n, n * held
        else:
            self._n += _ALPHA * (n - self._n)
            self._hh += _ALPHA * (held - self._hh)
            self._nn += _ALPHA * (n * n - self._nn)
            self._nh += _ALPHA * (n * held - self._nh)

    @property
    def single(self) -> float:
        """The seconds a batch of one row is expected to hold its process: what the model's
        lane is chosen by. The batches' holds are fitted to a fixed part and a part per row
        (least squares over moving averages). While the batches keep one size that cannot be
        done: the hold of a row's share of a batch, or of the probe row timed at load if that
        took longer. Before any batch, :attr:`estimate` (the probe's, or the hold remembered
        from an earlier load)."""
        if not self.batches:
            return self.estimate
        n, hold = self._n, self._hh
        spread = self._nn - n * n
        if spread < _STEADY_ROWS:
            return min(hold, max(self._probe, hold / n))
        per_row = max(0.0, (self._nh - n * hold) / spread)
        fixed = max(0.0, hold - per_row * n)
        return fixed + per_row

    def set_probe(self, seconds: float) -> None:
        """A first estimate, from a probe row timed at load: the averages start from it as
        from a batch of one row, so that one slow first batch (a preemption in a busy process)
        moves them by its weight, not all the way."""
        self.hold = self.estimate = self._probe = seconds
        if not self.batches:
            self._n, self._hh, self._nn, self._nh = 1.0, seconds, 1.0, seconds


def lane_bounds(lane: str, heavy_batch_s: float) -> tuple[float, float]:
    """The range of seconds a batch may hold a process for a model to stay in ``lane``: a model
    moves to the heavy lane above ``heavy_batch_s`` and back below half of it (hysteresis).
    With no threshold (no heavy lane) every cost stays."""
    if heavy_batch_s <= 0:
        return -math.inf, math.inf
    if lane == LIGHT:
        return -math.inf, heavy_batch_s
    return heavy_batch_s / 2, math.inf


def lane_for(current: str, hold: float | None, heavy_batch_s: float) -> str:
    """The lane a model whose batches hold a process ``hold`` seconds belongs in, coming from
    ``current`` (see :func:`lane_bounds`). A model of unknown cost stays where it is."""
    if hold is None:
        return current
    low, high = lane_bounds(current, heavy_batch_s)
    if hold > high:
        return HEAVY
    if hold < low:
        return LIGHT
    return current


def may_move(hold: float, heavy_batch_s: float, in_lane_s: float) -> bool:
    """Whether a model whose one-row batch holds a process ``hold`` seconds, in its lane for
    ``in_lane_s`` seconds, may move to the lane that cost calls for now: at once when the cost
    is clearly light or heavy (under a quarter of ``heavy_batch_s``, over twice it), otherwise
    once it has been :data:`LANE_DWELL_S` in its lane."""
    return in_lane_s >= LANE_DWELL_S or hold > 2 * heavy_batch_s or hold < heavy_batch_s / 4


def lane_now(current: str, hold: float, heavy_batch_s: float, now: float, moved_at: float) -> str:
    """The lane a model in ``current`` runs in from ``now`` on, its one-row batch holding a
    process ``hold`` seconds (:attr:`Cost.single`), having last moved at ``moved_at`` (on the
    same clock; ``-inf``: never): the lane its cost calls for (:func:`lane_for`) if it may move
    there now (:func:`may_move`), otherwise ``current``."""
    if may_move(hold, heavy_batch_s, now - moved_at):
        return lane_for(current, hold, heavy_batch_s)
    return current


def admits(inflight: int, inflight_cost: float, estimate: float) -> bool:
    """Whether a slot with ``inflight`` batches of ``inflight_cost`` estimated CPU seconds in its
    pipe takes one more of ``estimate`` seconds now: always when the pipe is empty, otherwise
    only while all of it stays within :data:`PIPELINE_BUDGET_S`."""
    return inflight == 0 or inflight_cost + estimate <= PIPELINE_BUDGET_S


class Lane:
    """Slots that share one virtual clock: the start tag of the batch that ran last."""

    __slots__ = ("name", "vtime")

    def __init__(self, name: str) -> None:
        self.name = name
        self.vtime = 0.0

    def tag(self, cost: Cost) -> float:
        """The start tag of a model's next batch: where its previous batches left it, but never
        behind the lane's clock (an idle model earns no credit while it is idle)."""
        return max(cost.vfinish, self.vtime)

    def charge(self, tag: float, cost: Cost) -> None:
        """A batch tagged ``tag`` starts: move the clock and the model's finish tag (by the
        pipeline budget while the model's cost is unknown)."""
        self.vtime = tag
        estimate = cost.estimate
        cost.vfinish = tag + (estimate if estimate < math.inf else PIPELINE_BUDGET_S)


T = TypeVar("T")


class RunQueue(list[tuple[float, int, T]]):
    """Items waiting for one slot, smallest start tag first, first come first on ties (a heap;
    empty when false, as a list is)."""

    __slots__ = ("_seq",)

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0

    def push(self, tag: float, item: T) -> None:
        self._seq += 1
        heapq.heappush(self, (tag, self._seq, item))

    def peek(self) -> tuple[float, T]:
        tag, _, item = self[0]
        return tag, item

    def pop_first(self) -> tuple[float, T]:
        tag, _, item = heapq.heappop(self)
        return tag, item
