"""Sharing the backends fairly: measured cost per model, lanes, and which batch runs next.

Every backend slot belongs to a *lane*. The light lane's processes run at normal priority; the
heavy lane's processes run at a lower CPU weight (``nice``), so the operating system lets short
work preempt a long prediction, something Python cannot do inside one process, yet gives the
heavy lane its share of a busy CPU: light traffic that keeps every CPU busy slows a heavy model
down, it does not starve it. When the light lane is idle the heavy lane's processes get the
whole machine.

A model runs in the lane its measured cost calls for (:func:`lane_for`): a model one of whose
requests takes more than ``heavy_batch_ms`` of CPU (:attr:`Cost.single`: the fixed part of a
batch plus the CPU a row costs times the model's mean rows per request) moves to the heavy
lane, and back once one takes less than half of that. What counts is a *request* at its real
size, not one row: a model whose requests all carry 1,000 rows is charged for 1,000 rows and
runs in the heavy lane, however cheap one row of it is. A cheap model that is popular makes
large batches, which hold a process longer, but each of its requests is still cheap: it stays
in the light lane, where it would otherwise move back and forth as its traffic rose and fell
(each move starts its workers anew).

Lanes are decided on CPU time, never on wall time: another program keeping the machine busy
stretches a batch's wall time, not its CPU time, and a cheap model preempted by it is still
cheap. A backend reads its CPU clock only for a model whose last batch was long
(:data:`CPU_CLOCK_ABOVE_S`); a shorter batch reports its wall time as its CPU time. So a batch
reported that way and longer than that was expected short and is not known: it may have been
preempted, and is left out of the CPU averages (the backend reads the clock for the next one),
unless nothing else is known of the model yet. A model the backend could not probe at load (a
custom handler, say) has its first batch timed by the CPU clock, so that what is first known of
it is CPU time too.

A cost near the threshold (between a quarter of it and twice it, where a model's measure may
wander back and forth) moves a model at most once per :data:`LANE_DWELL_S`; a cost clearly on
one side moves it at once (:func:`may_move`). :func:`lane_now` decides both from the cost, the
lane, the clock and the last move.

Within a lane, the frontend decides which batch runs next. A worker whose model has queued jobs
waits in its slot's :class:`RunQueue` (not in the slot's pipe), ordered by start-time fair
queuing over CPU time: a model's next batch is tagged with the virtual time its previous batches
have used, so a model with a deep queue gets one share of the lane, not all of it, and a cheap
model's batch goes ahead of an expensive one's. A batch is charged its estimated CPU time at its
real size when it starts (:meth:`Cost.charge`: the fixed part plus its requests' rows), and the
difference from what it took once that is known. A slot admits another batch into its pipe only
while what is already there is cheap (:func:`admits`, on how long batches hold the process:
:attr:`Cost.estimate`): batches never wait inside a process behind an expensive one.
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

#: Seconds a model stays in a lane before a cost near the threshold may move it again: a model
#: whose cost hovers there moves at most once a minute.
LANE_DWELL_S = 60.0

#: A batch shorter than this (wall time) reports its wall time as its CPU time: a backend reads
#: its CPU clock (a system call, twice a batch) only for a model whose last batch was longer.
CPU_CLOCK_ABOVE_S = 0.0005

#: Weight of the newest batch in the moving averages of a model's cost.
_ALPHA = 0.2
#: The variance of the batch sizes (in rows squared) below which they are taken as one size and
#: the CPU time is not split into a fixed part and a part per row.
_STEADY_ROWS = 0.25


class Cost:
    """One model's measured cost: moving averages of the CPU seconds of its batches, of their
    rows and of their requests, the CPU seconds fitted to a fixed part and a part per row
    (least squares over the moving averages), and from them what one of its requests costs
    alone (:attr:`single`, what chooses its lane) and what a batch of so many requests costs
    (:meth:`charge`, what its lane's fair queue charges). Besides: the seconds a batch holds its
    backend process (:attr:`estimate`: its CPU time or its wall time, whichever is longer, for
    admitting batches behind it), the totals, and the model's place in its lane's fair queue
    (``vfinish``).

    Updated once per batch on the event loop, so plain attributes."""

    __slots__ = (
        "_c",
        "_known",
        "_n",
        "_nc",
        "_nn",
        "_probe",
        "_requests",
        "_rows",
        "_unit",
        "batches",
        "cpu_seconds",
        "estimate",
        "fixed",
        "hold",
        "per_batch",
        "per_row",
        "rows_per_request",
        "single",
        "vfinish",
        "waited",
    )

    def __init__(self, known: float | None = None) -> None:
        """``known``: the CPU seconds a request of the model took in an earlier load, if any
        (its first estimate of everything)."""
        #: Seconds a batch holds its process (moving average), ``None`` until one was measured.
        self.hold = known
        #: What the next batch is expected to hold its process: infinite while nothing is known.
        self.estimate = math.inf if known is None else known
        #: CPU seconds one request of the model takes alone, at the model's mean rows per
        #: request: infinite while nothing is known.
        self.single = math.inf if known is None else known
        #: CPU seconds of a batch (moving average; ``None`` until one was measured), and its
        #: fixed part and the part of each row (fitted; ``None``: nothing known).
        self.per_batch: float | None = None
        self.fixed = 0.0
        self.per_row: float | None = known
        #: Rows per request (ratio of the moving averages of a batch's rows and requests).
        self.rows_per_request = 1.0
        self.cpu_seconds = 0.0
        self.batches = 0
        #: Batches of other models that ran on a slot while one of this model's waited.
        self.waited = 0
        self.vfinish = 0.0
        # Moving averages of a batch's rows and requests (every batch).
        self._rows = self._requests = 1.0
        # Moving averages over the batches whose CPU time is known (and the probe row): rows,
        # CPU seconds, rows squared, rows times CPU seconds; how many points they have.
        self._n = self._c = self._nn = self._nc = 0.0
        self._known = 0
        self._probe = 0.0
        #: Every batch so far had one request of one row (the averages of rows are exactly 1):
        #: :meth:`observe` takes its short way, to the same numbers.
        self._unit = True

    def observe(
        self,
        cpu_seconds: float,
        wall_seconds: float,
        rows: int,
        requests: int = 1,
        charged: float | None = None,
    ) -> None:
        """Count one batch of ``requests`` requests and ``rows`` rows that took ``cpu_seconds``
        of CPU and ``wall_seconds`` in its backend (equal when the backend did not read its CPU
        clock: see the module docstring). ``charged``: what its lane charged it when it
        started (:meth:`charge`), corrected here to what it took."""
        self.cpu_seconds += cpu_seconds
        self.batches += 1
        held = cpu_seconds if cpu_seconds > wall_seconds else wall_seconds
        hold = self.hold
        self.hold = self.estimate = held if hold is None else hold + _ALPHA * (held - hold)
        # One request of one row, as every batch before it (most requests' batch): the
        # averages of rows and requests stay 1, ``_nn`` stays 1 and ``_nc`` equal to ``_c``,
        # and the fit comes to no fixed part and the mean CPU time per row. Taken the short
        # way below: the general way's numbers by a third of its operations.
        unit = self._unit and rows <= 1 and requests <= 1
        n = 1.0
        if not unit:
            self._unit = False
            n = self._count_rows(rows, requests)
        cpu = cpu_seconds
        if cpu == wall_seconds and cpu > CPU_CLOCK_ABOVE_S and self.single < math.inf:
            # Its CPU time is not known (a batch expected short that was long: perhaps
            # preempted); the next one's is. (One of one row changed nothing the fit reads.)
            if not unit:
                self._refit()
            return
        if charged is not None:
            self.vfinish += cpu - charged
        per_batch = self.per_batch
        self.per_batch = cpu if per_batch is None else per_batch + _ALPHA * (cpu - per_batch)
        if unit:
            if self._known:
                c = self._c
                c = self._c = self._nc = c + _ALPHA * (cpu - c)
            else:
                self._n = self._nn = 1.0
                c = self._c = self._nc = cpu
            self._known += 1
            self.fixed = 0.0
            self.per_row = self.single = c
            return
        if not self._known:
            self._n, self._c, self._nn, self._nc = n, cpu, n * n, n * cpu
        else:
            self._n += _ALPHA * (n - self._n)
            self._c += _ALPHA * (cpu - self._c)
            self._nn += _ALPHA * (n * n - self._nn)
            self._nc += _ALPHA * (n * cpu - self._nc)
        self._known += 1
        self._refit()

    def _count_rows(self, rows: int, requests: int) -> float:
        """Count a batch's rows and requests (each taken as at least 1) in their averages:
        its rows, so taken."""
        n = float(rows) if rows > 1 else 1.0
        k = float(requests) if requests > 1 else 1.0
        if self.batches == 1:
            self._rows, self._requests = n, k
        else:
            self._rows += _ALPHA * (n - self._rows)
            self._requests += _ALPHA * (k - self._requests)
        self.rows_per_request = self._rows / self._requests
        return n

    def _refit(self) -> None:
        """The fixed part, the part per row and :attr:`single` from the moving averages. The
        line goes through the mean batch (its rows, its CPU time), with the slope least squares
        give it (never below 0, never above what leaves no fixed part). While the batches keep
        one size the slope cannot be found: a request then costs its share of a batch, or the
        probe row if that took longer, but never more than the batch. (Once per batch: written
        with conditional expressions rather than ``min``/``max``.)"""
        if not self._known:
            return
        n, c, m = self._n, self._c, self.rows_per_request
        spread = self._nn - n * n
        if spread >= _STEADY_ROWS:
            per_row = (self._nc - n * c) / spread
            if per_row < 0.0:
                per_row = 0.0
            elif per_row * n > c:
                per_row = c / n
            self.fixed, self.per_row = c - per_row * n, per_row
            self.single = self.fixed + per_row * m
            return
        share = c * m / n
        probe = self._probe
        single = share if share > probe else probe
        if single > c:
            single = c
        if n - m > 0.5:  # a line through the request and the batch
            per_row = (c - single) / (n - m)
            self.fixed, self.per_row = single - per_row * m, per_row
        else:
            self.fixed, self.per_row = 0.0, c / n
        self.single = single

    def charge(self, requests: int) -> float:
        """The CPU seconds a batch of ``requests`` of the model's requests is expected to take:
        the fixed part and the part per row times their rows (the pipeline budget while nothing
        is known)."""
        per_row = self.per_row
        if per_row is None:
            return PIPELINE_BUDGET_S
        return self.fixed + per_row * requests * self.rows_per_request

    def set_probe(self, seconds: float) -> None:
        """A first estimate, from a probe row timed at load: the averages start from it as
        from a batch of one row, so that one slow first batch moves them by its weight, not all
        the way."""
        self.hold = self.estimate = self._probe = seconds
        if not self._known:
            self._n, self._c, self._nn, self._nc = 1.0, seconds, 1.0, seconds
            self._known = 1
            self._refit()


def lane_bounds(lane: str, heavy_batch_s: float) -> tuple[float, float]:
    """The range of CPU seconds a request may take for a model to stay in ``lane``: a model
    moves to the heavy lane above ``heavy_batch_s`` and back below half of it (hysteresis).
    With no threshold (no heavy lane) every cost stays."""
    if heavy_batch_s <= 0:
        return -math.inf, math.inf
    if lane == LIGHT:
        return -math.inf, heavy_batch_s
    return heavy_batch_s / 2, math.inf


def lane_for(current: str, cost: float | None, heavy_batch_s: float) -> str:
    """The lane a model one of whose requests takes ``cost`` CPU seconds belongs in, coming from
    ``current`` (see :func:`lane_bounds`). A model of unknown cost stays where it is."""
    if cost is None:
        return current
    low, high = lane_bounds(current, heavy_batch_s)
    if cost > high:
        return HEAVY
    if cost < low:
        return LIGHT
    return current


def may_move(cost: float, heavy_batch_s: float, in_lane_s: float) -> bool:
    """Whether a model one of whose requests takes ``cost`` CPU seconds, in its lane for
    ``in_lane_s`` seconds, may move to the lane that cost calls for now: at once when the cost
    is clearly light or heavy (under a quarter of ``heavy_batch_s``, over twice it), otherwise
    once it has been :data:`LANE_DWELL_S` in its lane."""
    return in_lane_s >= LANE_DWELL_S or cost > 2 * heavy_batch_s or cost < heavy_batch_s / 4


def lane_now(current: str, cost: float, heavy_batch_s: float, now: float, moved_at: float) -> str:
    """The lane a model in ``current`` runs in from ``now`` on, one of its requests taking
    ``cost`` CPU seconds (:attr:`Cost.single`), having last moved at ``moved_at`` (on the same
    clock; ``-inf``: never): the lane its cost calls for (:func:`lane_for`) if it may move there
    now (:func:`may_move`), otherwise ``current``."""
    if may_move(cost, heavy_batch_s, now - moved_at):
        return lane_for(current, cost, heavy_batch_s)
    return current


def admits(inflight: int, inflight_cost: float, estimate: float) -> bool:
    """Whether a slot with ``inflight`` batches of ``inflight_cost`` estimated seconds in its
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

    def charge(self, tag: float, cost: Cost, seconds: float) -> None:
        """A batch tagged ``tag`` starts, expected to take ``seconds`` of CPU
        (:meth:`Cost.charge`): move the clock and the model's finish tag."""
        self.vtime = tag
        cost.vfinish = tag + seconds


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
