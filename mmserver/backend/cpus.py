"""Which CPUs the heavy lane's processes may run on: all of them while the light lane is idle,
all but ``heavy_reserved_cpus`` while it has work (:class:`CpuReserve`).

The heavy lane's processes run at a lower CPU weight (or, on request, at the lowest priority), so
light work preempts them when it wakes up; yet a CPU that a heavy process keeps busy still serves
light work worse than an idle one does. Measured on a 2-CPU virtual machine (light models under
8 connections, p99 against their p99 alone, five alternated rounds): beside an idle-priority busy
loop free to run on either CPU, 2.2-3.2 x; beside the same loop kept to one CPU, 0.95-1.9 x;
beside two such loops, one kept to each CPU, 2.7-3.5 x. What the light work needs is one CPU
that no heavy process touches. It needs it only while it has work: when the light lane is idle
the heavy processes get every CPU again, so a heavy model alone still has the whole machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Iterable

from mmserver.ops.capacity import affinity_mask

log = logging.getLogger(__name__)

#: How long the light lane must have sent no batch before the heavy lane gets every CPU again.
HOLD_S = 0.2


def set_process_cpus(pid: int, cpus: Collection[int]) -> bool:
    """Let every thread of process ``pid`` run on ``cpus`` only; ``False`` when the process is
    gone. Raises :class:`OSError` when the system refuses (a sandbox that forbids it, CPUs that
    are no longer the server's). A thread the process starts later inherits the mask of the
    thread that starts it."""
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return False
    done = False
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
            done = True
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return done


class CpuReserve:
    """Keeps ``count`` of the server's CPUs free of the heavy lane while the light lane has work.

    The light lane's slots call :meth:`light_batch` for every batch they send (an increment and
    a test). The first batch after a quiet spell narrows every heavy process to the other CPUs
    (in the next turn of the event loop, once that batch is on its way); a check every ``hold``
    seconds gives them every CPU again once the light lane has sent no batch since the last
    check, so between ``hold`` and twice ``hold`` after its last batch. A heavy process started
    or replaced meanwhile is placed by :meth:`place`. With fewer than two CPUs, ``count`` 0, or
    a system that refuses (logged once), it does nothing.
    """

    def __init__(
        self,
        count: int,
        heavy_pids: Callable[[], Iterable[int]],
        *,
        cpus: Collection[int] | None = None,
        hold: float = HOLD_S,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        every = sorted(affinity_mask() if cpus is None else cpus)
        count = max(0, min(count, len(every) - 1))
        #: Every CPU the server may use; the heavy lane's while the light lane is idle.
        self.every = frozenset(every)
        #: The heavy lane's CPUs while the light lane has work: the lowest-numbered are kept for
        #: the light work, as the interrupts its network traffic raises tend to land there.
        self.narrow = frozenset(every[count:])
        self.enabled = count > 0
        #: Whether the heavy lane is kept to :attr:`narrow` now.
        self.narrowed = False
        #: Batches the light lane has sent, and how many times the heavy lane was narrowed.
        self.batches = 0
        self.narrowings = 0
        self.hold = hold
        self._heavy_pids = heavy_pids
        self._on_change = on_change
        self._seen = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def heavy_cpus(self) -> frozenset[int]:
        """The CPUs the heavy lane's processes may run on now."""
        return self.narrow if self.narrowed else self.every

    def light_batch(self) -> None:
        """A light batch has been sent: keep the reserved CPUs free of the heavy lane."""
        self.batches += 1
        if not self.narrowed and self.enabled:
            self.narrowed = True
            self.narrowings += 1
            self._seen = self.batches
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.hold, self.check)
            loop.call_soon(self._apply)

    def place(self, pid: int) -> None:
        """A heavy process has started: give it the CPUs the heavy lane has now (it was forked
        with every CPU)."""
        if self.narrowed:
            self._set(pid, self.narrow)

    def close(self) -> None:
        """Stop narrowing (the server is stopping)."""
        self.enabled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def check(self) -> None:
        """Runs every ``hold`` seconds while the heavy lane is narrowed: keeps it so if the
        light lane has sent a batch since the last check, else gives it every CPU again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.narrowed:
            return
        if self.batches != self._seen and self.enabled:  # the light lane is still busy
            self._seen = self.batches
            self._timer = asyncio.get_running_loop().call_later(self.hold, self.check)
            return
        self.narrowed = False
        self._apply()

    def _apply(self) -> None:
        cpus = self.heavy_cpus
        for pid in self._heavy_pids():
            self._set(pid, cpus)
        if self._on_change is not None:
            self._on_change(len(self.heavy_cpus))

    def _set(self, pid: int, cpus: frozenset[int]) -> None:
        if not self.enabled and cpus != self.every:
            return
        try:
            set_process_cpus(pid, cpus)
        except OSError as exc:
            log.warning("the heavy lane's CPUs cannot be set (%s): no CPU is kept free for it", exc)
            self.enabled = False
            self.narrowed = False
            for other in self._heavy_pids():  # undo what was done, as far as it goes
                try:
                    set_process_cpus(other, self.every)
                except OSError:
                    pass
