"""The frontend's side of one backend process (:class:`ProcessSlot`): admitting batches into the
pipe in fair order, writing messages, reading replies in order and answering 504 past a
deadline. Its collaborators: the process itself (:mod:`~mmserver.backend.process`), its start and
replacement (:mod:`~mmserver.backend.lifetime`), and the models loaded in it
(:mod:`~mmserver.backend.loads`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing
import pickle
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.cpus import CpuReserve
from mmserver.backend.envprocs import EnvContext
from mmserver.backend.lifetime import ProcessLifetime, running_models
from mmserver.backend.loads import LoadTurn, SlotLoads
from mmserver.backend.process import BackendProcess
from mmserver.backend.slot import BatchCallback, Pending, Runnable, time_out
from mmserver.backend.wire import LoadInfo, LoadSpec
from mmserver.codecs.requests import Request
from mmserver.ops.metrics import Metrics
from mmserver.policy.scheduling import LIGHT, Cost, Lane, RunQueue, admits
from mmserver.procs.framing import FrameProtocol, frame
from mmserver.procs.replies import data_loads

log = logging.getLogger(__name__)

#: How often a process slot checks the deadlines of the messages it holds.
_WATCH_S = 0.05


class ProcessSlot:
    """One backend process, replaced when it dies. See the package docstring for the protocol.

    While the process is starting (or a replacement is), new messages are *held* and written
    once the models of the slot are loaded again, so they never reach a process that lacks their
    model (:class:`~mmserver.backend.lifetime.ProcessLifetime` starts and replaces the process).

    Batches are scheduled here, on the frontend: a worker with a batch to run waits in the
    slot's run queue (:meth:`ready`), and the slot admits the next one in fair order whenever
    its pipe holds little enough estimated work (:func:`~mmserver.policy.scheduling.admits`).
    Admitting a batch, writing it and reading its reply use this class's own attributes only:
    that is every batch's path. The process (:class:`~mmserver.backend.process.BackendProcess`),
    its lifetime and the models loaded in it (:class:`~mmserver.backend.loads.SlotLoads`) are
    collaborators.
    """

    def __init__(
        self,
        index: int,
        context: multiprocessing.context.ForkServerContext | EnvContext,
        metrics: Metrics,
        lane: Lane,
        nice: int = 0,
        idle: bool = False,
        reserve: CpuReserve | None = None,
        runs_code: bool = False,
    ) -> None:
        """``runs_code``: the process runs a model's own code (a fully trusted model's own
        process): its replies are read as data only (:mod:`mmserver.procs.replies`)."""
        self.index = index
        self.lane = lane
        self._unpickle = data_loads if runs_code else pickle.loads
        self.bound_workers = 0
        #: Batches answered by this slot (a worker's wait is counted against it).
        self.answered = 0
        #: Batches admitted into this slot's pipe.
        self.admitted = 0
        #: The CPU reserve: told of every batch a light slot sends; places a heavy slot's
        #: process when it starts.
        self._light_reserve = reserve if lane.name == LIGHT else None
        heavy_reserve = reserve if lane.name != LIGHT else None
        self._process = BackendProcess(index, lane.name, context, nice, idle, heavy_reserve)
        self._loads = SlotLoads(self._write)
        self._lifetime = ProcessLifetime(self, self._process, self._loads, metrics)
        self._protocol: FrameProtocol | None = None
        #: Who waits for a turn here, each with the count of batches this slot had answered
        #: when it came (every batch admitted since runs before its own: its wait).
        self._runq: RunQueue[tuple[Runnable, int]] = RunQueue()
        self._pump_handle: asyncio.Handle | None = None
        self._pumping = False
        self._inflight: collections.deque[Pending] = collections.deque()
        #: Estimated seconds of the batches in the pipe, and how many messages there have
        #: no estimate (loads, batches of models not measured yet).
        self._pipe_cost = 0.0
        self._pipe_unknown = 0
        self._watchdog: asyncio.TimerHandle | None = None
        #: Messages for a process that is starting (or a replacement that is), written once it
        #: has its models (:meth:`resume`).
        self.held: list[Pending] = []
        self._holding = True
        #: Whether the slot is stopping: it starts no process any more.
        self.stopping = False
        # Messages written during one turn of the event loop go out in one frame.
        self._out: list[tuple[Any, ...]] = []
        self._flush_handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop  # the event loop the slot was started on

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def live_pid(self) -> int | None:
        """The process's id while it runs (not once it has exited: the id may be another's)."""
        return self._process.live_pid

    @property
    def load_cost(self) -> Cost:
        """What a load here is expected to hold the process (:class:`SlotLoads`)."""
        return self._loads.cost

    def describe(self) -> str:
        return self._process.describe()

    # Lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the process; returns once it answered a ping. What was sent meanwhile (a slot
        started on first use) is written then."""
        await self._lifetime.start()

    async def stop(self) -> None:
        """Close the pipe (the process exits after answering what it holds) and reap it."""
        self.stopping = True
        crashed = await self._lifetime.stop()
        for handle in (self._pump_handle, self._watchdog):
            if handle is not None:
                handle.cancel()
        self._pump_handle = self._watchdog = None
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        await self._process.stop()
        shutting_down = errors.ShuttingDown("the server is shutting down")
        turns = self._loads.take_turns()
        for pending in [*crashed, *self._inflight, *self.held, *turns]:
            pending.fail(shutting_down)
        self._inflight.clear()
        self.held.clear()

    def kill(self) -> None:
        """Kill the process now; it is replaced as if it had died."""
        self._process.kill()

    def recycle(self, reason: str) -> bool:
        """Replace the process with a new one that loads the same models, if it has nothing to
        do (nothing is answered with an error); whether it did. What arrives meanwhile is held
        for the replacement, as after a crash."""
        if not self.free() or self.stopping or not self._lifetime.recycle(reason):
            return False
        self._holding = True  # nothing more goes to this process
        return True

    # What the lifetime does to the messages (:class:`~mmserver.backend.lifetime.Messages`) --------

    def take_held(self) -> list[Pending]:
        """The messages held for a process that could not start, which are held no more."""
        held, self.held = self.held, []
        return held

    async def connect(self, sock: socket.socket) -> asyncio.Future[Any]:
        """Read a new process's replies from ``sock`` (its pipe) and ping it; the ping's future,
        answered once the process runs."""
        loop = self._loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: FrameProtocol(
                self._on_reply, self._on_connection_lost, self._pump, self._unpickle
            ),
            sock=sock,
        )
        self._protocol = protocol
        ping: asyncio.Future[Any] = loop.create_future()
        self._write(Pending((wire.PING,), ping))
        return ping

    def resume(self, first: Iterable[Pending] = ()) -> None:
        """The process answered its ping: write ``first`` (a replacement's reloads), then the
        messages held for it in their order, and admit the batches waiting their turn."""
        for pending in first:
            self._write(pending)
        held, self.held = self.held, []
        for pending in held:
            if not pending.done():
                self._write(pending)
        self._holding = False
        self._pump()

    # Models ---------------------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> LoadInfo:
        """Load a model in the process. The load waits its turn in the run queue with the
        batches waiting here (:class:`~mmserver.backend.loads.LoadTurn`)."""
        if self.stopping:
            raise errors.ShuttingDown("the server is shutting down")
        loop = self._loop = asyncio.get_running_loop()
        self._lifetime.start_soon()
        future: asyncio.Future[LoadInfo] = loop.create_future()
        loads = self._loads
        tag, turn = loads.turn(spec, future, self.lane.vtime)
        self._queue(tag, turn)
        try:
            info = await future
        except BaseException:
            loads.failed(turn)
            raise
        loads.answered(spec.key, info)
        return info

    async def unload(self, key: str) -> None:
        if not self._loads.unload(key) or self.stopping:
            return
        try:
            await self._send((wire.UNLOAD, key), deadline=None, cost=0.0)
        except errors.MMServerError:
            pass  # a process that died holds nothing
        finally:
            # Counted until the process has let it go: its pages are held until then.
            self._loads.uncharge(key)

    def unaccounted_bytes(self) -> int:
        """Resident bytes the process holds beyond what it held at start and what its models'
        loads measured: what their predictions keep, pages the allocator kept, a leak. 0 while
        the process does not run, or while it starts or reloads its models."""
        if self._holding or self._lifetime.settling:
            return 0
        return self._loads.unaccounted_bytes(lambda: self._process.live_pid)

    # Scheduling -----------------------------------------------------------------------------------

    def ready(self, worker: Runnable) -> None:
        """``worker`` has a batch to run here: it runs at once if the process is idle, otherwise
        when its turn comes (:meth:`_pump`). Its batch is taken from its queue only then."""
        mark = self.answered
        cost = worker.cost
        tag = self.lane.tag(cost)
        if not self._runq and not self._pumping and not self._holding and not self.stopping:
            pipe = math.inf if self._pipe_unknown else self._pipe_cost
            if admits(len(self._inflight), pipe, cost.estimate):
                # Nobody waits and the pipe has room: it runs now, as the pump would run it.
                if worker.begin(self.admitted - mark):
                    self.lane.charge(tag, cost, worker.charge)
                return
        self._queue(tag, worker, mark)

    def _queue(self, tag: float, item: Runnable, mark: int = 0) -> None:
        self._runq.push(tag, (item, mark))
        if not self._inflight:
            self._pump()
        elif self._pump_handle is None and not self._pumping:
            # Workers made ready in this turn of the event loop are ordered together.
            self._pump_handle = self._loop.call_soon(self._pump)

    @property
    def waiting(self) -> int:
        """Batches and loads waiting for their turn here."""
        return sum(1 for _, _, (item, _) in self._runq if item.waiting())

    @property
    def in_pipe(self) -> int:
        """Messages written to the process (or about to be) and not answered yet."""
        return len(self._inflight)

    def free(self) -> bool:
        """Nothing running or waiting here."""
        return not self._inflight and not self._runq and not self._holding

    def _pump(self) -> None:
        """Admit waiting workers' batches in fair order while the pipe has room; their messages
        go out in one frame."""
        if self._pump_handle is not None:
            self._pump_handle.cancel()
            self._pump_handle = None
        if self._holding or self.stopping or self._pumping:
            return
        runq, lane = self._runq, self.lane
        self._pumping = True
        try:
            while runq:
                tag, (worker, mark) = runq.peek()
                if not worker.waiting():
                    runq.pop_first()  # it left, or was given its jobs elsewhere
                    continue
                cost = worker.cost
                pipe = math.inf if self._pipe_unknown else self._pipe_cost
                # A load may go behind anything: what waits for the pipe to drain is a batch.
                if type(worker) is not LoadTurn and not admits(
                    len(self._inflight), pipe, cost.estimate
                ):
                    break
                runq.pop_first()
                # Every batch admitted since the worker's mark ran, or runs, before its own.
                if worker.begin(self.admitted - mark):
                    lane.charge(tag, cost, worker.charge)
        finally:
            self._pumping = False
        if self._out and self._flush_handle is None:
            self._flush()

    def send_batch(
        self,
        key: str,
        requests: Sequence[Request],
        deadline: float,
        callback: BatchCallback,
        estimate: float = math.inf,
    ) -> None:
        """Send a batch; ``callback`` gets its result (its answers and their CPU seconds) or its
        error, from the event loop, as soon as they are known. ``estimate`` is its expected CPU
        seconds, for admitting what follows. Raises :class:`errors.ShuttingDown` at once when
        the slot is stopping."""
        self.admitted += 1
        self._enqueue(
            # Positional: a call with keywords is not specialized (every batch's).
            Pending((wire.PREDICT, key, requests), None, callback, estimate),
            deadline,
        )
        if self._light_reserve is not None:
            self._light_reserve.light_batch()

    def _send(
        self, message: tuple[Any, ...], deadline: float | None, cost: float = math.inf
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        self._enqueue(Pending(message, future, cost=cost), deadline)
        return future

    def _enqueue(self, pending: Pending, deadline: float | None) -> None:
        if self.stopping:
            raise errors.ShuttingDown("the server is shutting down")
        if deadline is not None:
            pending.deadline = deadline
            if self._watchdog is None:
                self._watchdog = self._loop.call_later(_WATCH_S, self._watch)
        if self._holding:
            self.held.append(pending)
        else:
            self._write(pending)

    def _write(self, pending: Pending) -> None:
        """Send ``pending``'s message: at once if the process has nothing to do, else with the
        other messages written in this turn of the event loop, in one frame (one pickle, one
        system call; measured, a frame per light batch cost the frontend a pickle and the
        process an unpickle and a reply each)."""
        idle = not self._inflight
        self._inflight.append(pending)
        if pending.cost < math.inf:
            self._pipe_cost += pending.cost
        else:
            self._pipe_unknown += 1
        self._out.append(pending.message)
        if self._flush_handle is None and not self._pumping:
            if idle:
                self._flush()
            else:
                self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        out, self._out = self._out, []
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None and out:
            protocol.transport.writelines(frame(out[0] if len(out) == 1 else (wire.MANY, out)))

    # Replies and deadlines ------------------------------------------------------------------------

    def _on_reply(self, reply: tuple[Any, ...]) -> None:
        if not self._inflight:
            log.error("%s answered a message it was not sent", self.describe())
            return
        inflight = self._inflight
        pending = inflight.popleft()
        if not inflight:
            self._pipe_cost, self._pipe_unknown = 0.0, 0  # no drift from float sums
        elif pending.cost < math.inf:
            self._pipe_cost -= pending.cost
        else:
            self._pipe_unknown -= 1
        if pending.op == wire.PREDICT:
            self.answered += 1
        if reply[0] == wire.OK:
            pending.succeed(reply[1])
        else:
            pending.fail(errors.from_name(reply[1], reply[2], reply[3]))

    def _watch(self) -> None:
        """Answer 504 every message whose deadline has passed; if the process is running one,
        replace the process. Runs every ``_WATCH_S`` while any message has a deadline (one
        timer per slot, not one per batch)."""
        self._watchdog = None
        now = self._loop.time()
        waiting = False
        for pending in (*self._inflight, *self.held):
            if pending.done() or pending.deadline == math.inf:
                continue
            if pending.deadline > now:
                waiting = True
                continue
            running = self._inflight[0] is pending if self._inflight else False
            time_out(pending)
            if running and not self._holding:
                models = running_models([pending])
                log.warning(
                    "%s: a prediction of model %s timed out; replacing the process",
                    self.describe(),
                    models[0] if models else "-",
                    extra={"model": models[0]} if models else None,
                )
                self.kill()
        if waiting and not self.stopping:
            self._watchdog = self._loop.call_later(_WATCH_S, self._watch)

    def _on_connection_lost(self, protocol: FrameProtocol) -> None:
        if protocol is not self._protocol:
            return
        self._protocol = None
        # Unsent frames belong to messages now being failed or held for the replacement.
        self._out.clear()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self.stopping:
            return
        self._holding = True
        inflight = self._inflight
        running = inflight.popleft() if inflight else None
        self.held[:0] = [p for p in inflight if not p.done()]
        inflight.clear()
        self._pipe_cost, self._pipe_unknown = 0.0, 0
        self._lifetime.died(running)
