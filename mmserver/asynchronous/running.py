"""Running a started asynchronous request (step 3 of :mod:`mmserver.asynchronous.runner`): its row
moved to ``running``, a small local input read in the same hand-off to the journal's thread;
its answer computed through the WorkLoadManager within its invocation timeout
(:class:`~mmserver.asynchronous.computing.Computer`); then its end handed to the
:class:`~mmserver.asynchronous.settling.Settler`, the answer or the failure it met. A request the
server lacked room for (:class:`~mmserver.errors.ResourceError`: no room for its model now, or
the server stopping) goes back to the queue instead; one whose TTL passed before it ran
expires. A request whose call was traced continues that trace: its run is a span of its own
(:data:`RUN_DOOR`) under the call's, with its jobs' spans under it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver import errors
from mmserver.asynchronous.computing import Computer
from mmserver.asynchronous.journal import Invocation, State
from mmserver.asynchronous.locations import Locations
from mmserver.asynchronous.settling import Settler
from mmserver.asynchronous.writer import JournalThread
from mmserver.ops.traces import Door, Trace

if TYPE_CHECKING:
    from mmserver.ops.otel import Tracing

log = logging.getLogger(__name__)

#: How the run of an asynchronous request is shown in traces: the status is the one the
#: real-time path would have answered (200, or the error's).
RUN_DOOR = Door("asynchronous invocation", {}, status_key="mmserver.status_code", kind="consumer")


class Runner:
    """Runs started asynchronous requests to their ends (module docstring)."""

    def __init__(
        self,
        writer: JournalThread,
        computer: Computer,
        settler: Settler,
        clock: Callable[[], float],
        tracing: Tracing | None = None,
    ) -> None:
        self._writer = writer
        self._computer = computer
        self._settler = settler
        self._clock = clock
        self._tracing = tracing

    async def run(self, invocation: Invocation) -> bool:
        """Run ``invocation`` to its end; whether it went back to the queue instead (its row
        says ``queued`` again: the caller queues it again, or leaves it for the next start).

        Cancelled (the server stopping), the computing stops; an end already begun is written
        and recorded all the same (:meth:`Settler.settled
        <mmserver.asynchronous.settling.Settler.settled>`)."""
        journal = self._writer.current()
        if invocation.expires_at <= self._clock():
            await self._settler.settled(self._settler.expire(invocation))
            return False
        # A small local input is read in the same hand-off as the request's start.
        most = self._computer.small_input
        started, body = await self._writer.run(
            lambda _: Locations.read_small(invocation.input, most),
            lambda small: (journal.move(invocation.id, State.RUNNING), small),
        )
        if not started:
            return False  # ended already
        trace = None
        if self._tracing is not None:
            trace = self._tracing.continued(RUN_DOOR, invocation.traceparent)
            if trace is not None:
                trace.attributes["mmserver.model"] = invocation.model
                trace.attributes["mmserver.inference_id"] = invocation.id
        status = 499  # cancelled: the server stops
        try:
            queued, status = await self._compute(invocation, body, trace)
        finally:
            if trace is not None:
                assert self._tracing is not None
                self._tracing.export(trace, status)
        return queued

    async def _compute(
        self, invocation: Invocation, body: bytes | None, trace: Trace | None
    ) -> tuple[bool, int]:
        """Compute the answer of the started ``invocation`` and settle its end, or queue it
        again: whether it was queued again (as :meth:`run`), and the status the real-time path
        would have answered."""
        journal = self._writer.current()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(invocation.timeout_s):
                answer, content_type = await self._computer.compute(
                    invocation, loop.time() + invocation.timeout_s, body, trace
                )
        except TimeoutError:
            error: errors.MMServerError = errors.PredictTimeout(
                f"the request was not answered within its invocation timeout "
                f"({invocation.timeout_s:g} s)"
            )
        except errors.ResourceError as exc:
            # No room for its model now, or the server is stopping: it runs later.
            await self._writer.call(journal.move, invocation.id, State.QUEUED)
            log.info("asynchronous request %s queued again: %s", invocation.id, exc.message)
            return True, exc.status_code
        except errors.MMServerError as exc:
            error = exc
        except Exception as exc:
            log.exception("asynchronous request %s of %s failed", invocation.id, invocation.model)
            error = errors.MMServerError(f"the request failed: {type(exc).__name__}")
        else:
            await self._settler.settled(self._settler.succeed(invocation, answer, content_type))
            return False, 200
        await self._settler.settled(self._settler.fail(invocation, State.FAILED, error))
        return False, error.status_code
