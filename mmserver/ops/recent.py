"""A model's answer times over the last minute, for the status page: six ten-second slots of a
log-spaced histogram (50 µs to 60 s, each bound 1.5 times the one before), the oldest slot
reused as time moves on. A request costs a clock read, a bisection and an increment (~0.3 µs);
a read sums the slots no older than a minute, so p50 and p99 are known within a bucket's width
(±25 %) without keeping the times themselves. A slot is made when a request first counts in it:
a model asked once in the last minute holds one slot, 0.4 KB; one asked all the time, six. (A
list, not an ``array``: an increment of an array's item costs twice a list's, 65 against 36 ns,
and it is on every request's way.)"""

from __future__ import annotations

from bisect import bisect_left as _bisect
from time import monotonic as _monotonic

#: The upper bounds of the buckets (seconds); the last bucket takes anything slower.
BOUNDS = tuple(50e-6 * 1.5**k for k in range(37))
_SLOT_S = 10.0
_SLOTS = 6
_WIDTH = len(BOUNDS) + 1
#: An empty slot, copied to make one.
_EMPTY = [0] * _WIDTH


class Recent:
    """Answer times of one model over the last minute (see the module docstring)."""

    __slots__ = ("_current", "_period", "_slots", "_stamps")

    def __init__(self) -> None:
        #: The slots, each made when a request first counts in it.
        self._slots: list[list[int] | None] = [None] * _SLOTS
        #: The ten-second period each slot counts (-1: none yet): a whole number, as a float
        #: (a float's floor division is a third of an int()'s and a division's time).
        self._stamps = [-1.0] * _SLOTS
        self._period = -1.0
        self._current = _EMPTY  # never counted in: the first add() turns to a slot of its own

    def add(self, seconds: float) -> None:
        period = _monotonic() // _SLOT_S
        if period != self._period:
            self._turn(period)
        self._current[_bisect(BOUNDS, seconds)] += 1

    def _turn(self, period: float) -> None:
        """Count in the slot of ``period`` from now on, emptied if it counted an older one."""
        slot = int(period) % _SLOTS
        self._period = period
        current = self._slots[slot]
        if current is None:
            current = self._slots[slot] = _EMPTY.copy()
        elif self._stamps[slot] != period:
            current[:] = _EMPTY
        self._stamps[slot] = period
        self._current = current

    def summary(self) -> tuple[int, float | None, float | None]:
        """The answers of the last minute, and their p50 and p99 in seconds (``None`` when
        there were none): the upper bound of the bucket each falls in."""
        period = _monotonic() // _SLOT_S
        totals = [0] * _WIDTH
        for counts, stamp in zip(self._slots, self._stamps, strict=True):
            if counts is not None and period - stamp < _SLOTS:
                for i, count in enumerate(counts):
                    totals[i] += count
        count = sum(totals)
        if not count:
            return 0, None, None
        return count, _quantile(totals, count, 0.5), _quantile(totals, count, 0.99)


def _quantile(totals: list[int], count: int, q: float) -> float:
    rank = q * count
    seen = 0
    for i, bucket in enumerate(totals):
        seen += bucket
        if seen >= rank:
            return BOUNDS[i] if i < len(BOUNDS) else BOUNDS[-1]
    return BOUNDS[-1]
