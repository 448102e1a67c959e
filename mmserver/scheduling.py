"""Sharing the backends fairly: measured cost per model, lanes, and which batch runs next.

Every backend slot belongs to a *lane*. The light lane's processes run at normal priority; the
heavy lane's processes run at a lower one (``nice``), so the operating system lets short work
preempt a long prediction, something Python cannot do inside one process. A model runs in the
lane its measured cost calls for (:func:`lane_for`): a model whose batches hold a process for
more than ``heavy_batch_ms`` on average (computing, or waiting on something) moves to the heavy
lane, and back once they take less than half of that. When the light lane is idle the heavy
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
from typing import Generic, TypeVar

LIGHT = "light"
HEAVY = "heavy"

#: The most estimated CPU time a slot's pipe may hold before it admits no more: a light batch
#: waits at most this long behind the batches sent before it, and the process never idles
#: between cheap batches while the frontend is busy.
PIPELINE_BUDGET_S = 0.001

#: Weight of the newest batch in the moving averages of a model's cost.
_ALPHA = 0.2


class Cost:
    """One model's measured cost: moving averages of the CPU seconds of a batch and of a row, of
    the seconds a batch holds its backend process (its CPU time or its wall time, whichever is
    longer: a model that waits on something holds the process as surely as one that computes),
    the totals, and the model's place in its lane's fair queue (``vfinish``)."""

    __slots__ = ("batches", "cpu_seconds", "hold", "per_batch", "per_row", "vfinish", "waited")

    def __init__(self, hold: float | None = None) -> None:
        #: Seconds a batch holds its process (moving average), ``None`` until one was measured.
        self.hold = hold
        #: CPU seconds of a batch and of a row (moving averages).
        self.per_batch: float | None = None
        self.per_row: float | None = None
        self.cpu_seconds = 0.0
        self.batches = 0
        #: Batches of other models that ran on a slot while one of this model's waited there.
        self.waited = 0
        self.vfinish = 0.0

    def observe(self, cpu_seconds: float, wall_seconds: float, rows: int) -> None:
        """Count one batch of ``rows`` rows that took ``cpu_seconds`` of CPU and
        ``wall_seconds`` in its backend."""
        self.cpu_seconds += cpu_seconds
        self.batches += 1
        self.hold = _average(self.hold, max(cpu_seconds, wall_seconds))
        self.per_batch = _average(self.per_batch, cpu_seconds)
        self.per_row = _average(self.per_row, cpu_seconds / max(1, rows))

    def estimate(self) -> float:
        """The expected seconds the next batch holds its process; infinite while unknown."""
        return math.inf if self.hold is None else self.hold


def _average(average: float | None, value: float) -> float:
    return value if average is None else average + _ALPHA * (value - average)


def lane_for(current: str, hold: float | None, heavy_batch_s: float) -> str:
    """The lane a model whose batches hold a process ``hold`` seconds belongs in (with
    hysteresis: it moves to the heavy lane above ``heavy_batch_s`` and back below half of it).
    A model of unknown cost stays where it is."""
    if hold is None or heavy_batch_s <= 0:
        return current
    if current == LIGHT and hold > heavy_batch_s:
        return HEAVY
    if current == HEAVY and hold < heavy_batch_s / 2:
        return LIGHT
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
        estimate = cost.estimate()
        cost.vfinish = tag + (PIPELINE_BUDGET_S if math.isinf(estimate) else estimate)


T = TypeVar("T")


class RunQueue(Generic[T]):
    """Items waiting for one slot, smallest start tag first, first come first on ties."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, tag: float, item: T) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (tag, self._seq, item))

    def peek(self) -> tuple[float, T]:
        tag, _, item = self._heap[0]
        return tag, item

    def pop(self) -> tuple[float, T]:
        tag, _, item = heapq.heappop(self._heap)
        return tag, item

    def clear(self) -> list[T]:
        items = [item for _, _, item in self._heap]
        self._heap.clear()
        return items
