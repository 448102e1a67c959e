"""Settling asynchronous requests, the last stage of their life (step 4 of
:mod:`mmserver.asynchronous.runner`): the answer written to its output location whole, or an
error body to its failure location; then the request's row ended (:meth:`Journal.finish
<mmserver.asynchronous.journal.Journal.finish>` records an end once) and its saved inline body
deleted; then its end counted and ``async_notify_url``, if set, told
(:mod:`mmserver.asynchronous.notify`).

An answer is on disk before its row says ``done``: a local one is written, synced and recorded in
one hand-off to the journal's thread (:mod:`mmserver.asynchronous.writer`); one in S3 or in a
file the pieces' answers were joined in is put first, and recorded after. An answer that cannot
be written fails its request; a failure that cannot be written is logged, and the end recorded
all the same.

Also here, the ends found in the journal: at start, a request a crash left running whose answer
or failure is written ends as it says (:meth:`Settler.recover`); rows ended more than
:data:`KEEP_ENDED_S` ago are forgotten (:meth:`Settler.prune`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.asynchronous.journal import ENDED, Invocation, State
from mmserver.asynchronous.locations import Locations, local_path
from mmserver.asynchronous.notify import Notifier, notification
from mmserver.asynchronous.objectcalls import ObjectCalls
from mmserver.asynchronous.writer import Folders, JournalThread
from mmserver.ops.metrics import Metrics

log = logging.getLogger(__name__)

#: Seconds an ended request stays in the journal (for the state call).
KEEP_ENDED_S = 7 * 24 * 3600.0


class Settler:
    """Ends the asynchronous requests of one server (module docstring).

    An end, once begun, runs in a task of its own that this settler owns (:meth:`begin`): a
    request cancelled while its answer is being written (the server stopping) has it written and
    recorded all the same, and :meth:`drain` awaits every end begun before the journal closes.
    ``wake`` is called each time a request has ended: the dispatcher looks again."""

    def __init__(
        self,
        writer: JournalThread,
        locations: Locations,
        objects: ObjectCalls,
        metrics: Metrics,
        notifier: Notifier | None,
        *,
        clock: Callable[[], float],
        without_paths: Callable[[str], str],
        wake: Callable[[], None],
    ) -> None:
        self._writer = writer
        self._locations = locations
        self._objects = objects
        self._metrics = metrics
        self._notifier = notifier
        self._clock = clock
        #: An error's message as a client is shown it, in failure objects, the journal and
        #: notifications alike.
        self._without_paths = without_paths
        self._wake = wake
        #: The URL prefix of the inline bodies saved in the state folder (set at start): an
        #: ended request's body under it is deleted.
        self.inline_prefix = "file:///nowhere/"
        #: When the journal was last pruned (:meth:`prune`), on ``clock``.
        self.last_prune = 0.0
        self._settling: set[asyncio.Task[None]] = set()

    # The tasks of the ends --------------------------------------------------------------------

    async def settled(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (the end of a request: writing its answer or failure, recording it) to
        its end, even if the caller is cancelled meanwhile."""
        await asyncio.shield(self.begin(work))

    def begin(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in a task this settler keeps until it is done (:meth:`drain`)."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def drain(self) -> None:
        """Wait for every end begun (:meth:`begin`) to be written and recorded."""
        await asyncio.gather(*self._settling, return_exceptions=True)

    # Ends -------------------------------------------------------------------------------------

    async def succeed(
        self, invocation: Invocation, answer: bytes | Path, content_type: str
    ) -> None:
        """Write the answer at the output location whole, then end the request done."""
        finish = functools.partial(
            self._writer.current().finish, invocation.id, State.DONE, None, self._clock()
        )
        unwritten: Exception | None = None
        if isinstance(answer, bytes) and self._locations.is_local(invocation.output):
            # Written, synced and recorded in one hand-off to the journal's thread.
            write = functools.partial(self._locations.write_local, invocation.output, answer)
            ended, unwritten = await self._end(invocation, finish, write)
        else:
            try:
                if isinstance(answer, Path):
                    await asyncio.to_thread(
                        self._locations.put_file, invocation.output, answer, content_type
                    )
                else:
                    await self._objects.write(invocation.output, answer, content_type)
            except (errors.MMServerError, OSError) as exc:
                unwritten = exc
            else:
                ended, _ = await self._end(invocation, finish)
        if unwritten is not None:
            await self.fail(invocation, State.FAILED, _not_written(unwritten))
        elif ended:
            self._ended(invocation, State.DONE, content_type=content_type)

    async def expire(self, invocation: Invocation) -> None:
        """End a request not started within its TTL: expired, with its failure written."""
        error = errors.PredictTimeout(
            f"the request was not started within its RequestTTLSeconds "
            f"({invocation.ttl_s:g} s) and has expired"
        )
        await self.fail(invocation, State.EXPIRED, error)

    async def fail(self, invocation: Invocation, state: State, error: errors.MMServerError) -> None:
        """Write the failure object of ``error`` and end the request in ``state``."""
        message = self._without_paths(error.message)
        fields = {k: message if v == error.message else v for k, v in error.to_dict().items()}
        body = json.dumps({**fields, "inferenceId": invocation.id}).encode()
        journal = self._writer.current()
        now = self._clock()
        change: Callable[[], bool]
        if state is State.EXPIRED:
            change = functools.partial(journal.move, invocation.id, state, error=message, at=now)
        else:
            change = functools.partial(journal.finish, invocation.id, state, message, now)
        unwritten: Exception | None = None
        if self._locations.is_local(invocation.failure):
            write = functools.partial(self._locations.write_local, invocation.failure, body)
            ended, unwritten = await self._end(invocation, change, write)
            if unwritten is not None:  # the end is recorded all the same
                ended, _ = await self._end(invocation, change)
        else:
            try:
                await self._objects.write(invocation.failure, body, "application/json")
            except (errors.MMServerError, OSError) as exc:
                unwritten = exc
            ended, _ = await self._end(invocation, change)
        if unwritten is not None:
            log.error(
                "asynchronous request %s: its failure could not be written to %s: %s",
                invocation.id,
                invocation.failure,
                unwritten,
            )
        if ended:
            self._ended(invocation, state, error=message)

    async def _end(
        self,
        invocation: Invocation,
        change: Callable[[], bool],
        write: Callable[[Folders], None] | None = None,
    ) -> tuple[bool, Exception | None]:
        """Record the end of ``invocation`` (``change``: a use of the journal, whether it
        ended the request) and then delete its saved inline body; with ``write`` (the local
        file work of its answer or failure) first, in the same hand-off. Whether it ended,
        and what ``write`` raised (then nothing is recorded)."""

        def record(unwritten: Exception | None) -> tuple[bool, Exception | None]:
            return (False, unwritten) if unwritten is not None else (change(), None)

        saved = invocation.input.startswith(self.inline_prefix)

        def drop(recorded: tuple[bool, Exception | None]) -> None:
            if recorded[0] and saved:
                local_path(invocation.input).unlink(missing_ok=True)

        files = None if write is None else _caught(write)
        return await self._writer.run(files, record, drop)

    def _ended(
        self,
        invocation: Invocation,
        state: State,
        *,
        content_type: str | None = None,
        error: str | None = None,
    ) -> None:
        """Count a request that has ended (once) and notify of it."""
        assert state in ENDED
        self._metrics.async_requests.labels(state.value).inc()
        if self._notifier is not None:
            self._notifier.send(notification(invocation, state, self._clock(), content_type, error))
        self._wake()

    # The ends found in the journal ------------------------------------------------------------

    async def recover(self, invocation: Invocation) -> bool:
        """Whether a request found running at start had ended (its answer or its failure is
        written: its row now says so); otherwise its row says ``queued`` again."""
        journal = self._writer.current()
        for written, state in ((invocation.output, State.DONE), (invocation.failure, State.FAILED)):
            if await asyncio.to_thread(self._locations.exists, written):
                error = None if state is State.DONE else "see the failure object"
                finish = functools.partial(
                    journal.finish, invocation.id, state, error, self._clock()
                )
                await self._end(invocation, finish)
                self._ended(invocation, state, error=error)
                return True
        await self._writer.call(journal.move, invocation.id, State.QUEUED)
        return False

    async def prune(self) -> None:
        """Forget the requests that ended more than :data:`KEEP_ENDED_S` ago."""
        self.last_prune = self._clock()
        pruned = await self._writer.call(
            self._writer.current().prune, self.last_prune - KEEP_ENDED_S
        )
        if pruned:
            log.info("asynchronous inference: %d request(s) ended a week ago forgotten", pruned)


def _caught(write: Callable[[Folders], None]) -> Callable[[Folders], Exception | None]:
    """``write`` returning what it raised (an answer that could not be written), if
    anything."""

    def caught(folders: Folders) -> Exception | None:
        try:
            write(folders)
        except (errors.MMServerError, OSError) as exc:
            return exc
        return None

    return caught


def _not_written(exc: Exception) -> errors.MMServerError:
    if isinstance(exc, errors.MMServerError):
        return exc
    strerror = exc.strerror if isinstance(exc, OSError) else str(exc)
    return errors.MMServerError(f"the answer could not be written: {strerror}")
