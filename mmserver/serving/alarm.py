"""An alarm: one callback on the event loop at a time that may be moved, for a pool's timers
(its delayed dispatch and the expiry of its queued jobs)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class Alarm:
    """Calls ``callback`` at the time it was last armed for (:meth:`arm`), once.

    :attr:`at` is that time, infinite while the alarm is not armed, so that a caller arms it
    for an earlier time only with one comparison on its own path (``if when < alarm.at``). The
    time is kept here, never asked of the handle: uvloop's ``call_at`` for a time already
    reached returns a plain ``Handle``, which has no ``when()``. Every method runs on the event
    loop."""

    __slots__ = ("_callback", "_handle", "_loop", "at")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
        self._loop = loop
        self._callback = callback
        self._handle: asyncio.Handle | None = None
        #: When it rings, on the loop's clock (infinite: not armed).
        self.at = math.inf

    def arm(self, when: float) -> None:
        """Ring at ``when`` instead of when it was armed for, if it was."""
        if self._handle is not None:
            self._handle.cancel()
        self.at = when
        self._handle = self._loop.call_at(when, self._ring)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.at = math.inf

    def _ring(self) -> None:
        # Disarmed before the callback runs: it may arm the alarm again.
        self._handle = None
        self.at = math.inf
        self._callback()
