"""Asynchronous inference: requests accepted into the journal, run through the WorkLoadManager
when real-time traffic leaves room, their answers written to an output location.

The life of one request (SageMaker's ``InvokeEndpointAsync``):

1. :meth:`AsyncInference.accept` checks it (its input location, headers, the bound
   ``async_max_queued``), saves an inline body under ``state_dir/inputs``, writes its row in the
   :class:`~mmserver.asynchronous.journal.Journal` (synced to disk) and only then returns, so
   the 202 is sent for a request no crash can lose;
2. the dispatcher starts it when its model may run one more asynchronous request
   (``option.async_max_workers``) and real-time requests leave room (:func:`room_for_async`:
   none is queued; while they keep the event loop busy, one start every
   :data:`~mmserver.asynchronous.admission.START_PACE_S`); a request not started within its
   TTL expires instead;
3. it runs: the input is read (``s3://`` or a local file), the body submitted through
   :meth:`WorkLoadManager.submit <mmserver.manager.wlm.WorkLoadManager.submit>` as a SageMaker
   request, all within its invocation timeout, as a *background* job: it does not count toward its
   model's real-time scale-up (:mod:`mmserver.policy.scaling`). It is submitted only while no
   real-time request is queued, and at most all the backend processes but one have
   asynchronous requests submitted at once (:func:`~mmserver.policy.scaling.background_share`);
   reading inputs and writing answers overlap (:data:`IO_PER_PREDICTION`);
4. it ends: the answer is written to its output location whole, or an error body to its failure
   location, then its row is ended (:meth:`Journal.finish <mmserver.asynchronous.journal.
   Journal.finish>` records an end once), and ``async_notify_url``, if set, is told
   (:mod:`mmserver.asynchronous.notify`).

Exactly once across crashes: an answer is written before the row says ``done``. A start finds
the rows a crash left ``running``: one whose output exists is done (it is not run again); one
whose failure exists has failed; the others run again. A request the server lacked room for
(:class:`~mmserver.errors.ResourceError`) goes back to the queue, retried a second later.

Stopping (:meth:`AsyncInference.stop`, in the server's drain): nothing new is accepted or
started; running requests get ``drain_timeout`` to end; those still running then are cancelled
and go back to the queue (an answer being written is written first); the queued ones stay for
the next start.

The journal's calls run in one thread of the runner's own (:mod:`mmserver.asynchronous.writer`),
batched with the local file work each needs first: a request's start with the read of its small
local input, its end with the writing of its answer (or failure) to a local folder, one hand-off
and one commit for all that comes meanwhile. Objects in S3 are read and written in processes
of their own at a lower CPU priority (:mod:`mmserver.asynchronous.objectcalls`), large inputs
and answers in the default executor's threads. Everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserver import errors
from mmserver.asynchronous.admission import (
    IO_PER_PREDICTION,
    YIELD_S,
    Intake,
    Turns,
    room_for_async,
)
from mmserver.asynchronous.computing import Computer
from mmserver.asynchronous.journal import ENDED, Invocation, Journal, State
from mmserver.asynchronous.locations import Locations, file_url, local_path
from mmserver.asynchronous.notify import Notifier, notification
from mmserver.asynchronous.objectcalls import ObjectCalls
from mmserver.asynchronous.requests import AsyncRequest
from mmserver.asynchronous.writer import Folders, JournalThread
from mmserver.codecs.requests import make_request
from mmserver.config.server import ServerConfig
from mmserver.ops.folderlock import FolderInUse, FolderLock
from mmserver.ops.metrics import Metrics
from mmserver.policy.scaling import background_share
from mmserver.store.names import normalize_name
from mmserver.store.objects import is_object, write_synced

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager

log = logging.getLogger(__name__)

#: Seconds a model's queued requests wait after the server lacked room to run one.
RETRY_AFTER_S = 1.0
#: Seconds between the sweeps that expire queued requests past their TTL.
SWEEP_S = 1.0
#: Seconds an ended request stays in the journal (for the state call), and between prunings.
KEEP_ENDED_S = 7 * 24 * 3600.0
PRUNE_EVERY_S = 3600.0


class AsyncInference:
    """The asynchronous requests of one server: accepted, queued, run, ended (module
    docstring). Started after the WorkLoadManager, stopped before it."""

    def __init__(
        self,
        config: ServerConfig,
        wlm: WorkLoadManager,
        metrics: Metrics,
        *,
        locations: Locations | None = None,
        clock: Callable[[], float] = time.time,
        without_paths: Callable[[str], str] = str,
    ) -> None:
        #: An error's message as a client is shown it (the server's folders cut from it:
        #: :meth:`mmserver.api.ApiState.without_paths`), in failure objects, the journal and
        #: notifications alike.
        self.without_paths = without_paths
        self.config = config
        self.wlm = wlm
        self.metrics = metrics
        self.locations = locations or Locations(config.async_input_paths)
        self.clock = clock
        self.state_dir = config.state_path
        self.inputs_dir = self.state_dir / "inputs"
        #: Held from the start to the end of :meth:`stop`: one server per state folder.
        self._lock = FolderLock(self.state_dir)
        #: Every use of the journal goes through its thread, batched.
        self._writer = JournalThread()
        #: Queued requests per model, in the order they were accepted; the models in the
        #: order they get their next turn.
        self._queued: dict[str, collections.deque[Invocation]] = {}
        #: The requests in :attr:`_queued` (kept as they come and go: read at every accept).
        self._queued_count = 0
        #: The URL prefix of the inline bodies saved under :attr:`inputs_dir` (set at start).
        self._inline_prefix = "file:///nowhere/"
        self._running: dict[str, asyncio.Task[None]] = {}
        self._per_model: collections.Counter[str] = collections.Counter()
        self._settling: set[asyncio.Task[None]] = set()
        self._not_before: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._accepting = False
        self._last_sweep = 0.0
        self._last_prune = 0.0
        self._pruning: asyncio.Task[None] | None = None
        #: The object-call process's start, begun with the server's when answers go to S3.
        self._preparing: asyncio.Task[None] | None = None
        url = config.async_notify_url.strip()
        #: Tells ``async_notify_url`` of each request that ends.
        self.notifier = Notifier(url) if url else None
        #: At most this many are submitted to their models at once, over every model...
        self._turns = Turns(
            background_share(config.backend_processes),
            lambda: self.wlm.real_time_queued,
            metrics.async_yields.inc,
        )
        #: ... and this many run at once (reading inputs and writing answers besides).
        self.max_running = IO_PER_PREDICTION * self._turns.limit
        #: When calls are accepted while real-time requests keep the event loop busy.
        self.intake = Intake(lambda: self.wlm.real_time_arrived, metrics.async_paced.inc)
        #: The object store's calls with small bodies, made in a process of its own.
        self._objects = ObjectCalls(self.locations.input_roots)
        self._computer = Computer(
            wlm, self.locations, self._objects, self._turns, config, self.state_dir
        )

    # Lifecycle --------------------------------------------------------------------------------

    def claim(self) -> None:
        """Hold ``state_dir`` for this server alone (:mod:`mmserver.ops.folderlock`): a second
        server on the same journal would run its requests again. Raises :class:`ConfigError`
        when another process holds it or it cannot be used."""
        try:
            self._lock.take()
        except FolderInUse as exc:
            holder = f"another mmserver (pid {exc.pid})" if exc.pid else "another mmserver"
            raise errors.ConfigError(
                f"option state_dir={self.state_dir}: {holder} is using it; give each server "
                "its own state_dir (two servers on one journal would run its requests twice)"
            ) from None
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            raise errors.ConfigError(
                f"option state_dir={self.state_dir} cannot be used: {exc.strerror or exc}{where}"
            ) from None

    async def start(self) -> None:
        """Hold the state folder (:meth:`claim`), open the journal and take up what it holds:
        requests a crash left running end as their written answers say, or run again; queued
        ones keep their order."""
        self.claim()
        try:
            await self._take_up()
        except BaseException:
            await self._writer.close()
            self._lock.release()
            raise
        self._accepting = True
        loop = asyncio.get_running_loop()
        self._dispatcher = loop.create_task(
            self._dispatch_forever(), name="mmserver-async-dispatcher"
        )
        places = (self.config.async_outputs, self.config.async_failures)
        to_s3 = next((place for place in places if is_object(place)), None)
        if to_s3 is not None:
            self._preparing = loop.create_task(
                self._prepare_objects(to_s3), name="mmserver-async-objects"
            )

    async def _take_up(self) -> None:
        """Open the journal and queue what it holds (:meth:`start`)."""
        await self._writer.open(functools.partial(Journal, self.state_dir))
        await asyncio.to_thread(self.inputs_dir.mkdir, parents=True, exist_ok=True)
        self._inline_prefix = await asyncio.to_thread(lambda: file_url(self.inputs_dir) + "/")
        await self._prune()
        recovered = 0
        found = await self._writer.call(self._writer.current().open)
        await asyncio.to_thread(self._drop_unjournaled_inputs, {i.input for i in found})
        await asyncio.to_thread(self._remove_staged, [i for i in found if i.state is State.RUNNING])
        for invocation in found:
            if invocation.state is State.RUNNING:
                if await self._recover(invocation):
                    continue
            self._enqueue(invocation)
            recovered += 1
        if recovered:
            log.info("asynchronous inference: %d request(s) from the journal queued", recovered)

    async def _prepare_objects(self, location: str) -> None:
        try:
            await self._objects.prepare(location)
        except errors.ShuttingDown:
            pass  # stopped as it started
        except Exception as exc:  # the first request's call tries again, and says why
            log.warning("asynchronous inference: the object calls could not start: %s", exc)

    async def _prune(self) -> None:
        self._last_prune = self.clock()
        pruned = await self._writer.call(
            self._writer.current().prune, self._last_prune - KEEP_ENDED_S
        )
        if pruned:
            log.info("asynchronous inference: %d request(s) ended a week ago forgotten", pruned)

    def _drop_unjournaled_inputs(self, inputs: set[str]) -> None:
        """Delete the saved bodies no open request names: a crash between saving a body and
        journaling its request leaves one (that request was never answered 202)."""
        for path in self.inputs_dir.glob("*.in"):
            if file_url(path) not in inputs:
                path.unlink(missing_ok=True)

    async def _recover(self, invocation: Invocation) -> bool:
        """Whether a request found running at start had ended (its answer or its failure is
        written: its row now says so); otherwise it is queued again."""
        journal = self._writer.current()
        for written, state in ((invocation.output, State.DONE), (invocation.failure, State.FAILED)):
            if await asyncio.to_thread(self.locations.exists, written):
                error = None if state is State.DONE else "see the failure object"
                finish = functools.partial(
                    journal.finish, invocation.id, state, error, self.clock()
                )
                await self._end(invocation, finish)
                self._ended(invocation, state, error=error)
                return True
        await self._writer.call(journal.move, invocation.id, State.QUEUED)
        return False

    def _remove_staged(self, interrupted: list[Invocation]) -> None:
        """Remove what the killed runs of the ``interrupted`` requests left half-written: beside
        their answers and failures, the files named for them, and the answers for objects
        being prepared in the state folder; only files last written before this server took
        that folder (a live write by another server sharing the output folder, under the same
        name a client gave both, is left alone)."""
        places = [place for i in interrupted for place in (i.output, i.failure)]
        try:
            removed = self.locations.remove_staged(places, self._computer.staging, self._lock.since)
        except OSError as exc:
            log.warning("asynchronous inference: interrupted writes not cleaned up: %s", exc)
            return
        if removed:
            log.info(
                "asynchronous inference: removed %d file(s) that interrupted writes left", removed
            )

    def close(self) -> None:
        """Accept and start nothing more (the first step of stopping)."""
        self._accepting = False
        if self._dispatcher is not None:
            self._dispatcher.cancel()

    async def stop(self, drain_timeout: float) -> None:
        """Let running requests end for up to ``drain_timeout`` seconds, put the rest back in
        the queue, and close the journal."""
        self.close()
        if self._dispatcher is not None:
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        running = list(self._running.values())
        if running and drain_timeout:
            await asyncio.wait(running, timeout=drain_timeout)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        # Answers being written are written (and recorded) before the rest is requeued.
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self._writer.journal is not None:
            requeued = await self._writer.call(self._writer.journal.requeue_running)
            if requeued:
                log.info(
                    "asynchronous inference: %d running request(s) queued again for the next start",
                    requeued,
                )
        await self._writer.close()
        if self._preparing is not None:  # a process starting is stopped once it has
            await asyncio.gather(self._preparing, return_exceptions=True)
        try:
            await self._objects.close()
            if self.notifier is not None:
                await self.notifier.close()
        finally:
            self._lock.release()

    # Accepting --------------------------------------------------------------------------------

    @property
    def open_requests(self) -> int:
        """Requests accepted and not ended (queued or running)."""
        return self._queued_count + len(self._running)

    async def accept(self, request: AsyncRequest, body: bytes) -> tuple[Invocation, bool]:
        """Journal one request and queue it: its row, and whether it is new (``False``: a
        request with its inference id was accepted before; it is not queued again). Raises what
        refuses it before anything is written."""
        self._check_room()
        model = normalize_name(request.model)
        make_request(b"", request.content_type, request.accept)  # 415 now, not in the failure
        ttl, timeout = request.ttl_s(), request.timeout_s()
        inference_id = request.checked_id()
        request.check_attributes()
        extension, filename = request.extension(), request.checked_filename()
        if self.intake.busy():  # real time first: the call waits its turn
            await self.intake.take()
            self._check_room()  # again: the server may have filled up or begun to stop
        output_base, failure_base = self._places(model)
        if extension is not None:
            output_base = self.locations.join(output_base, extension)
            failure_base = self.locations.join(failure_base, extension)
        inline: Path | None = None
        location = (request.input_location or "").strip()
        if location:
            if body:
                raise errors.InvalidInput(
                    "send the input inline or name its location, not both (Body and "
                    "InputLocation are exclusive)"
                )
        else:
            if not body:
                self.locations.check_input("")  # says what is missing
            inline = self.inputs_dir / f"{uuid.uuid4().hex}.in"
        invocation = Invocation(
            id=inference_id,
            model=model,
            input="",
            output=self.locations.join(output_base, filename or f"{inference_id}.out"),
            failure=self.locations.join(failure_base, f"{inference_id}-error.out"),
            content_type=request.content_type,
            accept=request.accept,
            custom_attributes=request.custom_attributes,
            accepted_at=self.clock(),
            ttl_s=ttl,
            timeout_s=timeout,
        )
        journal = self._writer.current()
        locations = self.locations

        def save(folders: Folders) -> str:
            # In the journal's thread: resolving a path may take a system call per folder.
            if inline is None:
                return locations.check_input(location)  # refused before anything is written
            write_synced(inline, body)
            folders.add(inline.parent)
            return file_url(inline)

        def record(source: str) -> tuple[Invocation, bool, str]:
            row, added = journal.add(dataclasses.replace(invocation, input=source))
            if not added and inline is not None:
                inline.unlink(missing_ok=True)
            return row, added, source

        row, added, source = await self._writer.run(save, record)
        if not added:
            if row.model != invocation.model or (inline is None and row.input != source):
                raise errors.InvalidInput(
                    f"inference id {inference_id!r} names another request already accepted; "
                    "use a new id"
                )
            return row, False
        self._enqueue(row)
        self.metrics.async_requests.labels("accepted").inc()
        return row, True

    def _check_room(self) -> None:
        if not self._accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")
        if self.open_requests >= self.config.async_max_queued:
            raise errors.TooManyRequests(
                f"the server holds {self.config.async_max_queued} asynchronous requests "
                "(async_max_queued); retry later"
            )

    def _places(self, model: str) -> tuple[str, str]:
        """Where the answers and failures of ``model`` go: its own settings when the server
        knows them (the model is loaded), otherwise the server's."""
        pool = self.wlm.pool(model)
        output = self.config.async_outputs
        failure = self.config.async_failure_path.strip() or None
        if pool is not None:
            output = pool.config.async_output_path or output
            failure = pool.config.async_failure_path or failure
        return output, failure or output

    def _enqueue(self, invocation: Invocation, front: bool = False) -> None:
        queue = self._queued.get(invocation.model)
        if queue is None:
            queue = self._queued[invocation.model] = collections.deque()
        if front:
            queue.appendleft(invocation)
        else:
            queue.append(invocation)
        self._queued_count += 1
        self._wake.set()

    async def status(self, inference_id: str) -> Invocation:
        """The journal's row of request ``inference_id`` (:class:`errors.NotFound` if none)."""
        row = await self._writer.call(self._writer.current().get, inference_id)
        if row is None:
            raise errors.NotFound(f"no asynchronous request has inference id {inference_id!r}")
        return row

    # Dispatching ------------------------------------------------------------------------------

    async def _dispatch_forever(self) -> None:
        while True:
            self._wake.clear()
            wait = self._start_what_may_run()
            if wait is None:
                await self._wake.wait()
                continue
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _start_what_may_run(self) -> float | None:
        """Start the requests that may run now, one model after another; the seconds after
        which to look again (``None``: only when something changes)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._queued and self.clock() - self._last_sweep >= SWEEP_S:
            self._sweep()
        if self.clock() - self._last_prune >= PRUNE_EVERY_S and self._pruning is None:
            self._pruning = self._begin_settling(self._prune())
            self._pruning.add_done_callback(self._pruned)
        wait = SWEEP_S if self._queued else None
        for model in list(self._queued):
            if not room_for_async(self.wlm.real_time_queued, len(self._running), self.max_running):
                if self.wlm.real_time_queued:
                    self.metrics.async_yields.inc()
                    wait = YIELD_S
                break
            queue = self._queued[model]
            not_before = self._not_before.get(model, 0.0)
            if not_before > now:
                wait = min(SWEEP_S, not_before - now)
                continue
            pool = self.wlm.pool(model)
            limit = pool.config.async_max_workers if pool else self.config.async_max_workers
            if self._per_model[model] >= limit:
                continue
            pause = self.intake.start_pause()
            if pause:  # real time keeps the event loop busy: one start at a time
                self.metrics.async_yields.inc()
                wait = pause if wait is None else min(wait, pause)
                break
            invocation = queue.popleft()
            self._queued_count -= 1
            if not queue:
                del self._queued[model]
            else:  # its next request waits for the other models' turns
                self._queued[model] = self._queued.pop(model)
            self._run(invocation)
        return wait

    def _pruned(self, task: asyncio.Task[None]) -> None:
        self._pruning = None
        if not task.cancelled() and task.exception() is not None:
            log.error("the asynchronous journal could not be pruned: %s", task.exception())

    def _sweep(self) -> None:
        """Expire the queued requests past their TTL."""
        now = self._last_sweep = self.clock()
        for model in list(self._queued):
            queue = self._queued[model]
            expired = [i for i in queue if i.expires_at <= now]
            if not expired:
                continue
            left = collections.deque(i for i in queue if i.expires_at > now)
            self._queued_count -= len(expired)
            if left:
                self._queued[model] = left
            else:
                del self._queued[model]
            for invocation in expired:
                self._begin_settling(self._expire(invocation))

    def _run(self, invocation: Invocation) -> None:
        self._per_model[invocation.model] += 1
        task = asyncio.get_running_loop().create_task(
            self._run_one(invocation), name=f"mmserver-async-{invocation.id}"
        )
        self._running[invocation.id] = task
        task.add_done_callback(lambda t: self._run_ended(invocation, t))

    def _run_ended(self, invocation: Invocation, task: asyncio.Task[None]) -> None:
        self._running.pop(invocation.id, None)
        self._per_model[invocation.model] -= 1
        if not self._per_model[invocation.model]:
            del self._per_model[invocation.model]
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "asynchronous request %s of %s failed",
                invocation.id,
                invocation.model,
                exc_info=task.exception(),
            )
        self._wake.set()

    async def _run_one(self, invocation: Invocation) -> None:
        journal = self._writer.current()
        if invocation.expires_at <= self.clock():
            await self._settled(self._expire(invocation))
            return
        # A small local input is read in the same hand-off as the request's start.
        most = self._computer.small_input
        started, body = await self._writer.run(
            lambda _: Locations.read_small(invocation.input, most),
            lambda small: (journal.move(invocation.id, State.RUNNING), small),
        )
        if not started:
            return  # ended already
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
            if self._accepting:
                self._not_before[invocation.model] = loop.time() + RETRY_AFTER_S
                self._enqueue(invocation, front=True)
            log.info("asynchronous request %s queued again: %s", invocation.id, exc.message)
            return
        except errors.MMServerError as exc:
            error = exc
        except Exception as exc:
            log.exception("asynchronous request %s of %s failed", invocation.id, invocation.model)
            error = errors.MMServerError(f"the request failed: {type(exc).__name__}")
        else:
            await self._settled(self._succeed(invocation, answer, content_type))
            return
        await self._settled(self._fail(invocation, State.FAILED, error))

    async def _settled(self, work: Any) -> None:
        """Run the end of a request (writing its answer or failure, recording it) to its end,
        even if the request is cancelled meanwhile."""
        await asyncio.shield(self._begin_settling(work))

    def _begin_settling(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return task

    async def _succeed(
        self, invocation: Invocation, answer: bytes | Path, content_type: str
    ) -> None:
        """Write the answer at the output location whole, then end the request done."""
        finish = functools.partial(
            self._writer.current().finish, invocation.id, State.DONE, None, self.clock()
        )
        unwritten: Exception | None = None
        if isinstance(answer, bytes) and self.locations.is_local(invocation.output):
            # Written, synced and recorded in one hand-off to the journal's thread.
            write = functools.partial(self.locations.write_local, invocation.output, answer)
            ended, unwritten = await self._end(invocation, finish, write)
        else:
            try:
                if isinstance(answer, Path):
                    await asyncio.to_thread(
                        self.locations.put_file, invocation.output, answer, content_type
                    )
                else:
                    await self._objects.write(invocation.output, answer, content_type)
            except (errors.MMServerError, OSError) as exc:
                unwritten = exc
            else:
                ended, _ = await self._end(invocation, finish)
        if unwritten is not None:
            await self._fail(invocation, State.FAILED, _not_written(unwritten))
        elif ended:
            self._ended(invocation, State.DONE, content_type=content_type)

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

        saved = invocation.input.startswith(self._inline_prefix)

        def drop(recorded: tuple[bool, Exception | None]) -> None:
            if recorded[0] and saved:
                local_path(invocation.input).unlink(missing_ok=True)

        files = None if write is None else _caught(write)
        return await self._writer.run(files, record, drop)

    async def _expire(self, invocation: Invocation) -> None:
        error = errors.PredictTimeout(
            f"the request was not started within its RequestTTLSeconds "
            f"({invocation.ttl_s:g} s) and has expired"
        )
        await self._fail(invocation, State.EXPIRED, error)

    async def _fail(
        self, invocation: Invocation, state: State, error: errors.MMServerError
    ) -> None:
        """Write the failure object of ``error`` and end the request in ``state``."""
        message = self.without_paths(error.message)
        fields = {k: message if v == error.message else v for k, v in error.to_dict().items()}
        body = json.dumps({**fields, "inferenceId": invocation.id}).encode()
        journal = self._writer.current()
        now = self.clock()
        change: Callable[[], bool]
        if state is State.EXPIRED:
            change = functools.partial(journal.move, invocation.id, state, error=message, at=now)
        else:
            change = functools.partial(journal.finish, invocation.id, state, message, now)
        unwritten: Exception | None = None
        if self.locations.is_local(invocation.failure):
            write = functools.partial(self.locations.write_local, invocation.failure, body)
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
        self.metrics.async_requests.labels(state.value).inc()
        if self.notifier is not None:
            self.notifier.send(notification(invocation, state, self.clock(), content_type, error))
        self._wake.set()

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges of the queued requests (called before a scrape)."""
        backlog = self.metrics.async_backlog
        now = self.clock()
        seen = set()
        oldest = None
        for model, queue in self._queued.items():
            backlog.labels(model).set(len(queue))
            seen.add(model)
            first = queue[0].accepted_at if queue else None
            if first is not None and (oldest is None or first < oldest):
                oldest = first
        for (model,), _, _ in backlog.series():
            if model not in seen:
                backlog.remove(model)
        self.metrics.async_oldest_seconds.set(0.0 if oldest is None else max(0.0, now - oldest))


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
