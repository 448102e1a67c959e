"""Running a started asynchronous request (step 3 of :mod:`mmserver.asynchronous.runner`): its row
moved to ``running``, a small local input read in the same hand-off to the journal's thread;
its answer computed through the WorkLoadManager within its invocation timeout
(:class:`~mmserver.asynchronous.computing.Computer`); then its end handed to the
:class:`~mmserver.asynchronous.settling.Settler`, the answer or the failure it met. A request the
server lacked room for (:class:`~mmserver.errors.ResourceError`: no room for its model now, or
the server stopping) goes back to the queue instead; one whose TTL passed before it ran
expires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mmserver import errors
from mmserver.asynchronous.computing import Computer
from mmserver.asynchronous.journal import Invocation, State
from mmserver.asynchronous.locations import Locations
from mmserver.asynchronous.settling import Settler
from mmserver.asynchronous.writer import JournalThread

log = logging.getLogger(__name__)


class Runner:
    """Runs started asynchronous requests to their ends (module docstring)."""

    def __init__(
        self,
        writer: JournalThread,
        computer: Computer,
        settler: Settler,
        clock: Callable[[], float],
    ) -> None:
        self._writer = writer
        self._computer = computer
        self._settler = settler
        self._clock = clock

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
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(invocation.timeout_s):
                answer, content_type = await self._computer.compute(
                    invocation, loop.time() + invocation.timeout_s, body
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
            return True
        except errors.MMServerError as exc:
            error = exc
        except Exception as exc:
            log.exception("asynchronous request %s of %s failed", invocation.id, invocation.model)
            error = errors.MMServerError(f"the request failed: {type(exc).__name__}")
        else:
            await self._settler.settled(self._settler.succeed(invocation, answer, content_type))
            return False
        await self._settler.settled(self._settler.fail(invocation, State.FAILED, error))
        return False
