"""What both kinds of slot share: a message waiting for its reply (:class:`Pending`), the
callback a batch's sender gets, and what a slot's run queue holds (:class:`Runnable`)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from mmserver import errors
from mmserver.policy.scheduling import Cost

log = logging.getLogger(__name__)


#: Called with ``(result, None)`` or ``(None, error)`` when a batch is answered; a batch's
#: result is a :data:`BatchResult`.
BatchCallback = Callable[[Any, BaseException | None], None]


class Runnable(Protocol):
    """What a slot's run queue holds: a worker whose model has jobs queued (see
    :mod:`mmserver.policy.scheduling`)."""

    @property
    def cost(self) -> Cost: ...

    #: The estimated CPU seconds of what :meth:`begin` sent, which the lane charges its model.
    charge: float

    def waiting(self) -> bool: ...
    def begin(self, waited: int = 0) -> bool: ...


class Pending:
    """One message sent (or to be sent) to a backend process, and who wants its reply: a
    future, or (for batches) a callback called as soon as the reply is read. ``cost`` is the
    estimated seconds it holds the process (infinite when unknown, as for a load)."""

    __slots__ = (
        "callback",
        "cost",
        "deadline",
        "deadline_handle",
        "finished",
        "future",
        "message",
        "op",
    )

    def __init__(
        self,
        message: tuple[Any, ...],
        future: asyncio.Future[Any] | None = None,
        callback: BatchCallback | None = None,
        cost: float = math.inf,
    ) -> None:
        self.op = message[0]
        #: What is pickled to the process (with the other messages written in the same turn).
        self.message = message
        self.future = future
        self.callback = callback
        self.cost = cost
        self.finished = False
        #: On the event loop's clock; a process slot's watchdog answers it 504 once passed.
        self.deadline = math.inf
        self.deadline_handle: asyncio.TimerHandle | None = None  # a thread slot's timer

    def done(self) -> bool:
        """Answered, or no longer wanted (its future was cancelled)."""
        return self.finished or (self.future is not None and self.future.done())

    def succeed(self, result: Any) -> None:
        self._settle(result, None)

    def fail(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, result: Any, error: BaseException | None) -> None:
        if self.finished:
            return
        self.finished = True
        if self.deadline_handle is not None:
            self.deadline_handle.cancel()
        if self.callback is not None:
            try:
                self.callback(result, error)
            except Exception:  # it runs inside the reply reader: never let it break that
                log.exception("a batch's answer callback failed")
        elif self.future is not None and not self.future.done():
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)


def time_out(pending: Pending) -> None:
    pending.fail(
        errors.PredictTimeout("the prediction did not finish within option.predict_timeout")
    )
