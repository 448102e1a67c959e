"""Asynchronous inference: requests accepted into the journal, run through the WorkLoadManager
when real-time traffic leaves room, their answers written to an output location.

The life of one request (SageMaker's ``InvokeEndpointAsync``), a stage per module, the stages
composed by :class:`AsyncInference`:

1. accepting (:mod:`mmserver.asynchronous.accepting`): :meth:`AsyncInference.accept` checks it
   (its input location, headers, the bound ``async_max_queued``), saves an inline body under
   ``state_dir/inputs``, writes its row in the
   :class:`~mmserver.asynchronous.journal.Journal` (synced to disk) and only then returns, so
   the 202 is sent for a request no crash can lose;
2. dispatching (:mod:`mmserver.asynchronous.dispatching`): the dispatcher starts it when its
   model may run one more asynchronous request (``option.async_max_workers``) and real-time
   requests leave room (:func:`~mmserver.asynchronous.admission.room_for_async`: none is
   queued; while they keep the event loop busy, one start every
   :data:`~mmserver.asynchronous.admission.START_PACE_S`); a request not started within its
   TTL expires instead;
3. running (:mod:`mmserver.asynchronous.running`): the input is read (``s3://`` or a local
   file), the body submitted through :meth:`WorkLoadManager.submit
   <mmserver.manager.wlm.WorkLoadManager.submit>` as a SageMaker request, all within its
   invocation timeout, as a *background* job: it does not count toward its model's real-time
   scale-up (:mod:`mmserver.policy.scaling`). It is submitted only while no real-time request
   is queued, and at most all the backend processes but one have asynchronous requests
   submitted at once (:func:`~mmserver.policy.scaling.background_share`); reading inputs and
   writing answers overlap (:data:`~mmserver.asynchronous.admission.IO_PER_PREDICTION`);
4. settling (:mod:`mmserver.asynchronous.settling`): the answer is written to its output
   location whole, or an error body to its failure location, then its row is ended
   (:meth:`Journal.finish <mmserver.asynchronous.journal.Journal.finish>` records an end
   once), and ``async_notify_url``, if set, is told (:mod:`mmserver.asynchronous.notify`).

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
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver import errors
from mmserver.asynchronous.accepting import Acceptor
from mmserver.asynchronous.admission import IO_PER_PREDICTION, Intake, Turns
from mmserver.asynchronous.computing import Computer
from mmserver.asynchronous.dispatching import Dispatcher
from mmserver.asynchronous.journal import Invocation, Journal, State
from mmserver.asynchronous.locations import Locations, file_url
from mmserver.asynchronous.notify import Notifier
from mmserver.asynchronous.objectcalls import ObjectCalls
from mmserver.asynchronous.requests import AsyncRequest
from mmserver.asynchronous.running import Runner
from mmserver.asynchronous.settling import Settler
from mmserver.asynchronous.writer import JournalThread
from mmserver.config.server import ServerConfig
from mmserver.ops.folderlock import FolderInUse, FolderLock
from mmserver.ops.metrics import Metrics
from mmserver.ops.traces import http_door
from mmserver.policy.scaling import background_share
from mmserver.store.objects import is_object

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager
    from mmserver.ops.otel import Tracing

#: How ``InvokeEndpointAsync`` calls are shown in traces (the route of
#: :mod:`mmserver.api.asynchronous`).
ACCEPT_DOOR = http_door("POST", "/endpoints/{endpoint}/async-invocations")

log = logging.getLogger(__name__)


class AsyncInference:
    """The asynchronous requests of one server: accepted, queued, run, ended (module
    docstring), one collaborator per stage. Started after the WorkLoadManager, stopped before
    it; :meth:`start` and :meth:`stop` order the stages' own starts and stops."""

    def __init__(
        self,
        config: ServerConfig,
        wlm: WorkLoadManager,
        metrics: Metrics,
        *,
        locations: Locations | None = None,
        clock: Callable[[], float] = time.time,
        without_paths: Callable[[str], str] = str,
        tracing: Tracing | None = None,
    ) -> None:
        #: An error's message as a client is shown it (the server's folders cut from it:
        #: :meth:`mmserver.api.ApiState.without_paths`), in failure objects, the journal and
        #: notifications alike.
        self.without_paths = without_paths
        #: Traces, when the environment asks for them: a traced call's span is the parent of
        #: its run's (the journal keeps its ``traceparent``).
        self.tracing = tracing
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
        #: The object-call process's start, begun with the server's when answers go to S3.
        self._preparing: asyncio.Task[None] | None = None
        url = config.async_notify_url.strip()
        #: Tells ``async_notify_url`` of each request that ends.
        self.notifier = Notifier(url) if url else None
        # At most this many are submitted to their models at once, over every model...
        turns = Turns(
            background_share(config.backend_processes),
            lambda: wlm.real_time_queued,
            metrics.async_yields.inc,
        )
        #: ... and this many run at once (reading inputs and writing answers besides).
        self.max_running = IO_PER_PREDICTION * turns.limit
        #: The object store's calls with small bodies, made in a process of its own.
        self._objects = ObjectCalls(self.locations.input_roots)
        self._computer = Computer(wlm, self.locations, self._objects, turns, config, self.state_dir)
        # The stages, last first: each is handed the next. The dispatcher looks again when a
        # request is queued or ends (``wake``).
        wake = asyncio.Event()
        self._settler = Settler(
            self._writer,
            self.locations,
            self._objects,
            metrics,
            self.notifier,
            clock=clock,
            without_paths=without_paths,
            wake=wake.set,
        )
        runner = Runner(self._writer, self._computer, self._settler, clock, tracing)
        intake = Intake(lambda: wlm.room.queued.arrived, metrics.async_paced.inc)
        self._dispatcher = Dispatcher(
            config,
            wlm,
            metrics,
            intake,
            runner,
            self._settler,
            max_running=self.max_running,
            wake=wake,
            clock=clock,
        )
        self._acceptor = Acceptor(
            config,
            wlm,
            metrics,
            self.locations,
            self._writer,
            self._dispatcher,
            intake,
            inputs_dir=self.inputs_dir,
            clock=clock,
        )

    @property
    def intake(self) -> Intake:
        """When calls are accepted, and requests start, while real-time requests keep the event
        loop busy: one :class:`~mmserver.asynchronous.admission.Intake` for both."""
        return self._acceptor.intake

    @intake.setter
    def intake(self, intake: Intake) -> None:
        self._acceptor.intake = self._dispatcher.intake = intake

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
        ones keep their order. Then calls are accepted and requests started."""
        self.claim()
        try:
            await self._take_up()
        except BaseException:
            await self._writer.close()
            self._lock.release()
            raise
        self._acceptor.open()
        self._dispatcher.start()
        places = (self.config.async_outputs, self.config.async_failures)
        to_s3 = next((place for place in places if is_object(place)), None)
        if to_s3 is not None:
            self._preparing = asyncio.get_running_loop().create_task(
                self._prepare_objects(to_s3), name="mmserver-async-objects"
            )

    async def _take_up(self) -> None:
        """Open the journal and queue what it holds (:meth:`start`)."""
        await self._writer.open(functools.partial(Journal, self.state_dir))
        await asyncio.to_thread(self.inputs_dir.mkdir, parents=True, exist_ok=True)
        self._settler.inline_prefix = await asyncio.to_thread(
            lambda: file_url(self.inputs_dir) + "/"
        )
        await self._settler.prune()
        recovered = 0
        found = await self._writer.call(self._writer.current().open)
        await asyncio.to_thread(self._drop_unjournaled_inputs, {i.input for i in found})
        await asyncio.to_thread(self._remove_staged, [i for i in found if i.state is State.RUNNING])
        for invocation in found:
            if invocation.state is State.RUNNING:
                if await self._settler.recover(invocation):
                    continue
            self._dispatcher.enqueue(invocation)
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

    def _drop_unjournaled_inputs(self, inputs: set[str]) -> None:
        """Delete the saved bodies no open request names: a crash between saving a body and
        journaling its request leaves one (that request was never answered 202)."""
        for path in self.inputs_dir.glob("*.in"):
            if file_url(path) not in inputs:
                path.unlink(missing_ok=True)

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
        self._acceptor.close()
        self._dispatcher.close()

    async def stop(self, drain_timeout: float) -> None:
        """Let running requests end for up to ``drain_timeout`` seconds, put the rest back in
        the queue, and close the journal."""
        self.close()
        await self._dispatcher.stop(drain_timeout)
        # Answers being written are written (and recorded) before the rest is requeued.
        await self._settler.drain()
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

    # Requests ---------------------------------------------------------------------------------

    @property
    def open_requests(self) -> int:
        """Requests accepted and not ended (queued or running)."""
        return self._dispatcher.open_requests

    async def accept(self, request: AsyncRequest, body: bytes) -> tuple[Invocation, bool]:
        """Journal one request and queue it: its row, and whether it is new (``False``: a
        request with its inference id was accepted before; it is not queued again). Raises what
        refuses it before anything is written (:meth:`Acceptor.accept
        <mmserver.asynchronous.accepting.Acceptor.accept>`). A call that is traced keeps its
        own span's ``traceparent`` in the journal."""
        tracing = self.tracing
        trace = None
        if tracing is not None:
            trace = tracing.sampled(ACCEPT_DOOR, request.traceparent, request.tracestate)
        if trace is None:
            return await self._acceptor.accept(request, body)
        assert tracing is not None
        request = dataclasses.replace(request, traceparent=tracing.traceparent(trace))
        trace.attributes["mmserver.model"] = request.model
        try:
            row, added = await self._acceptor.accept(request, body)
        except BaseException as exc:
            code = exc.status_code if isinstance(exc, errors.MMServerError) else 500
            tracing.export(trace, code)
            raise
        trace.attributes["mmserver.inference_id"] = row.id
        tracing.export(trace, 202)
        return row, added

    async def status(self, inference_id: str) -> Invocation:
        """The journal's row of request ``inference_id`` (:class:`errors.NotFound` if none)."""
        row = await self._writer.call(self._writer.current().get, inference_id)
        if row is None:
            raise unknown_request(inference_id)
        return row

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges of the queued requests (called before a scrape)."""
        self._dispatcher.refresh_metrics()


def unknown_request(inference_id: str) -> errors.NotFound:
    """The answer for an inference id the caller has no request of."""
    return errors.NotFound(f"no asynchronous request has inference id {inference_id!r}")
