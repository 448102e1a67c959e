"""The frontend's side of one backend process (:class:`ProcessSlot`): writing messages, reading
replies in order, scheduling batches into the pipe, and replacing the process when it dies or a
prediction passes its deadline."""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.child import child_main
from mmserver.backend.cpus import CpuReserve
from mmserver.backend.slot import BatchCallback, Pending, Runnable, time_out
from mmserver.backend.wire import LoadInfo, LoadSpec
from mmserver.codecs.requests import Request
from mmserver.ops import capacity
from mmserver.ops.metrics import Metrics
from mmserver.policy.scheduling import LIGHT, PIPELINE_BUDGET_S, Cost, Lane, RunQueue, admits
from mmserver.procs.framing import FrameProtocol, frame

log = logging.getLogger(__name__)

_START_TIMEOUT = 60.0
#: Seconds a stopping process gets to exit by itself once its pipe is closed.
_STOP_GRACE_S = 2.0
#: How often a process slot checks the deadlines of the messages it holds.
_WATCH_S = 0.05


class _Load(Pending):
    """A load's message, which knows its model (a replacement process resends it, and reloads
    only the models whose load is not among the messages it resends)."""

    __slots__ = ("spec",)

    def __init__(self, spec: LoadSpec, future: asyncio.Future[LoadInfo]) -> None:
        super().__init__((wire.LOAD, spec), future)
        self.spec = spec


class _LoadTurn:
    """A load waiting in its slot's run queue (:meth:`ProcessSlot.load`), written to the pipe
    when its turn comes, behind whatever the pipe holds. A batch whose turn came first waits
    for the pipe to drain with the loads behind it held back: a stream of cold loads keeps a
    loaded model's batch waiting only for the loads written before its turn came, and busy
    models do not hold back a load."""

    __slots__ = ("cost", "pending", "slot", "spec")

    def __init__(self, slot: ProcessSlot, pending: _Load) -> None:
        self.slot = slot
        self.spec = pending.spec
        self.pending = pending
        #: Unknown: no batch goes behind it in the pipe.
        self.cost = Cost()

    def waiting(self) -> bool:
        return self.slot._turns.get(self.spec.key) is self and not self.pending.done()

    def begin(self, waited: int = 0) -> bool:
        slot, key = self.slot, self.spec.key
        del slot._turns[key]
        slot._loaded[key] = self.spec
        slot._write(self.pending)
        return True


class ProcessSlot:
    """One backend process, replaced when it dies. See the module docstring for the protocol.

    While the process is starting (or a replacement is), new messages are *held* and written
    once the models of the slot are loaded again, so they never reach a process that lacks their
    model.

    Batches are scheduled here, on the frontend: a worker with a batch to run waits in the
    slot's run queue (:meth:`ready`), and the slot admits the next one in fair order whenever
    its pipe holds little enough estimated work (:func:`~mmserver.policy.scheduling.admits`).
    """

    def __init__(
        self,
        index: int,
        context: multiprocessing.context.ForkServerContext,
        metrics: Metrics,
        lane: Lane,
        nice: int = 0,
        idle: bool = False,
        reserve: CpuReserve | None = None,
    ) -> None:
        self.index = index
        self.lane = lane
        #: The CPU reserve: told of every batch a light slot sends; places a heavy slot's
        #: process when it starts.
        self._light_reserve = reserve if lane.name == LIGHT else None
        self._heavy_reserve = reserve if lane.name != LIGHT else None
        self.bound_workers = 0
        #: Batches answered by this slot (a worker's wait is counted against it).
        self.answered = 0
        #: Batches admitted into this slot's pipe.
        self.admitted = 0
        self._nice = nice
        self._idle_policy = idle
        self._context = context
        self._metrics = metrics
        self._process: multiprocessing.process.BaseProcess | None = None
        self._starting: asyncio.Task[None] | None = None
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
        self._held: list[Pending] = []
        self._crashed: list[Pending] = []
        self._holding = True
        # Messages written during one turn of the event loop go out in one frame.
        self._out: list[tuple[Any, ...]] = []
        self._flush_handle: asyncio.Handle | None = None
        #: The models loaded (or being loaded) in the process, which a replacement reloads.
        self._loaded: dict[str, LoadSpec] = {}
        #: Loads waiting in the run queue for their turn, where the loads' share of the slot
        #: has got to, and what a load here costs (the moving average of the seconds the loads
        #: held the process; the pipeline budget until one was measured): the loads take turns
        #: with the models' batches as one more model.
        self._turns: dict[str, _LoadTurn] = {}
        self._loads_vfinish = 0.0
        self.load_cost = Cost(PIPELINE_BUDGET_S)
        self._restarting: asyncio.Task[None] | None = None
        self._stopping = False
        self._restarts: collections.deque[float] = collections.deque(maxlen=5)
        #: What each model loaded here measured at its load, their sum, and the process's
        #: resident bytes once it had started, with no model (:meth:`unaccounted_bytes`).
        self._charged: dict[str, int] = {}
        self._charged_total = 0
        self._baseline = 0
        #: Why the process is being replaced though it did not die (:meth:`recycle`).
        self._recycling: str | None = None
        #: A replacement is starting or loading its models again: its memory is not settled.
        self._settling = False
        self._loop: asyncio.AbstractEventLoop  # the event loop the slot was started on

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def live_pid(self) -> int | None:
        """The process's id while it runs (not once it has exited: the id may be another's)."""
        process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def describe(self) -> str:
        return f"backend process {self.index} (pid {self.pid})"

    # Lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the process; returns once it answered a ping. What was sent meanwhile (a slot
        started on first use) is written then."""
        try:
            await self._spawn()
        except BaseException as exc:
            held, self._held = self._held, []
            turns, self._turns = list(self._turns.values()), {}
            error = (
                exc
                if isinstance(exc, errors.MMServerError)
                else errors.BackendDied(f"{self.describe()} could not start: {exc}")
            )
            for pending in [*held, *(turn.pending for turn in turns)]:
                pending.fail(error)
            raise
        self._holding = False
        held, self._held = self._held, []
        for pending in held:
            if not pending.done():
                self._write(pending)
        self._pump()

    def _ensure_started(self) -> None:
        """Start the process on first use (the heavy lane's slots start when a model needs
        them); a start that failed is tried again on the next use."""
        if self._process is not None or self._stopping:
            return
        self._loop = asyncio.get_running_loop()
        if self._starting is None or self._starting.done():
            self._starting = self._loop.create_task(
                self._start_once(), name=f"mmserver-backend-{self.index}-start"
            )

    async def _start_once(self) -> None:
        try:
            await self.start()
        except Exception as exc:
            log.error("%s could not start: %s", self.describe(), exc)

    async def _spawn(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=child_main,
            args=(child, self.index, self._nice, self._idle_policy, self.lane.name),
            name=f"mmserver-backend-{self.index}",
            daemon=True,
        )
        await loop.run_in_executor(None, process.start)
        child.close()
        if self._heavy_reserve is not None and process.pid is not None:
            self._heavy_reserve.place(process.pid)
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        parent.close()
        sock.setblocking(False)
        self._process = process
        _, protocol = await loop.create_unix_connection(
            lambda: FrameProtocol(self._on_reply, self._on_connection_lost, self._pump), sock=sock
        )
        self._protocol = protocol
        ping: asyncio.Future[Any] = loop.create_future()
        self._write(Pending((wire.PING,), ping))
        try:
            await asyncio.wait_for(asyncio.shield(ping), _START_TIMEOUT)
        except TimeoutError:
            process.kill()
            raise errors.BackendDied(
                f"{self.describe()} did not answer within {_START_TIMEOUT:.0f} s of starting"
            ) from None
        self._baseline = capacity.rss_bytes([process.pid]) if process.pid is not None else 0
        self._charged.clear()
        self._charged_total = 0

    async def stop(self) -> None:
        """Close the pipe (the process exits after answering what it holds) and reap it."""
        self._stopping = True
        for task in (self._restarting, self._starting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for handle in (self._pump_handle, self._watchdog):
            if handle is not None:
                handle.cancel()
        self._pump_handle = self._watchdog = None
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        process = self._process
        if process is not None:
            loop = asyncio.get_running_loop()
            # Past the drain nothing the process still computes is wanted: an idle process
            # exits at once, one held by a model's code is killed after this grace.
            await loop.run_in_executor(None, process.join, _STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                await loop.run_in_executor(None, process.join, 5.0)
        shutting_down = errors.ShuttingDown("the server is shutting down")
        turns, self._turns = list(self._turns.values()), {}
        for pending in [*self._crashed, *self._inflight, *self._held, *(t.pending for t in turns)]:
            pending.fail(shutting_down)
        self._inflight.clear()
        self._held.clear()
        self._crashed.clear()

    def kill(self) -> None:
        """Kill the process now; it is replaced as if it had died."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    # Operations -------------------------------------------------------------------------------

    async def load(self, spec: LoadSpec) -> LoadInfo:
        """Load a model in the process. The load waits its turn in the run queue with the
        batches waiting here (:class:`_LoadTurn`)."""
        if self._stopping:
            raise errors.ShuttingDown("the server is shutting down")
        self._ensure_started()
        future: asyncio.Future[LoadInfo] = self._loop.create_future()
        turn = _LoadTurn(self, _Load(spec, future))
        self._turns[spec.key] = turn
        tag = max(self._loads_vfinish, self.lane.vtime)
        self._loads_vfinish = tag + self.load_cost.estimate
        self._queue(tag, turn)
        try:
            info = await future
        except BaseException:
            if self._turns.get(spec.key) is turn:
                del self._turns[spec.key]
            self._loaded.pop(spec.key, None)
            raise
        if info.seconds > 0:
            self.load_cost.observe(info.seconds, info.seconds, 1)
        self._charge(spec.key, info)
        return info

    # Memory -----------------------------------------------------------------------------------

    def _charge(self, key: str, info: LoadInfo) -> None:
        """Count what the load of ``key`` measured here (a load of a model already loaded
        measures 0 and changes nothing)."""
        if key in self._loaded and info.memory_bytes and key not in self._charged:
            self._charged[key] = info.memory_bytes
            self._charged_total += info.memory_bytes

    def unaccounted_bytes(self) -> int:
        """Resident bytes the process holds beyond what it held at start and what its models'
        loads measured: what their predictions keep, pages the allocator kept, a leak. 0 while
        the process does not run."""
        pid = self.live_pid
        if pid is None or not self._baseline or self._holding or self._settling:
            return 0
        held = capacity.rss_bytes([pid]) - self._baseline - self._charged_total
        return max(0, held)

    def recycle(self, reason: str) -> bool:
        """Replace the process with a new one that loads the same models, if it has nothing to
        do (nothing is answered with an error); whether it did. What arrives meanwhile is held
        for the replacement, as after a crash."""
        if not self.free() or self._stopping or self._restarting is not None or self._settling:
            return False
        if self.live_pid is None:
            return False
        self._recycling = reason
        self._holding = True  # nothing more goes to this process
        self.kill()
        return True

    # Scheduling -------------------------------------------------------------------------------

    def ready(self, worker: Runnable) -> None:
        """``worker`` has a batch to run here: it runs at once if the process is idle, otherwise
        when its turn comes (:meth:`_pump`). Its batch is taken from its queue only then."""
        mark = self.answered
        cost = worker.cost
        tag = self.lane.tag(cost)
        if not self._runq and not self._pumping and not self._holding and not self._stopping:
            pipe = math.inf if self._pipe_unknown else self._pipe_cost
            if admits(len(self._inflight), pipe, cost.estimate):
                # Nobody waits and the pipe has room: it runs now, as the pump would run it.
                if worker.begin(self.admitted - mark):
                    self.lane.charge(tag, cost)
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
        if self._holding or self._stopping or self._pumping:
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
                if type(worker) is not _LoadTurn and not admits(
                    len(self._inflight), pipe, cost.estimate
                ):
                    break
                runq.pop_first()
                # Every batch admitted since the worker's mark ran, or runs, before its own.
                if worker.begin(self.admitted - mark):
                    lane.charge(tag, cost)
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
            Pending((wire.PREDICT, key, requests), callback=callback, cost=estimate), deadline
        )
        if self._light_reserve is not None:
            self._light_reserve.light_batch()

    async def unload(self, key: str) -> None:
        turn = self._turns.pop(key, None)
        if turn is not None:  # never sent: nothing to unload
            name = key.split("#")[0]
            turn.pending.fail(errors.ShuttingDown(f"model {name} was unloaded before it loaded"))
        if self._loaded.pop(key, None) is None or self._stopping:
            return
        try:
            await self._send((wire.UNLOAD, key), deadline=None, cost=0.0)
        except errors.MMServerError:
            pass  # a process that died holds nothing
        finally:
            # Counted until the process has let it go: its pages are held until then.
            self._charged_total -= self._charged.pop(key, 0)

    def _send(
        self, message: tuple[Any, ...], deadline: float | None, cost: float = math.inf
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        self._enqueue(Pending(message, future, cost=cost), deadline)
        return future

    def _enqueue(self, pending: Pending, deadline: float | None) -> None:
        if self._stopping:
            raise errors.ShuttingDown("the server is shutting down")
        if deadline is not None:
            pending.deadline = deadline
            if self._watchdog is None:
                self._watchdog = self._loop.call_later(_WATCH_S, self._watch)
        if self._holding:
            self._held.append(pending)
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

    # Replies and faults -----------------------------------------------------------------------

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
        for pending in (*self._inflight, *self._held):
            if pending.done() or pending.deadline == math.inf:
                continue
            if pending.deadline > now:
                waiting = True
                continue
            running = self._inflight[0] is pending if self._inflight else False
            time_out(pending)
            if running and not self._holding:
                log.warning("%s: a prediction timed out; replacing the process", self.describe())
                self.kill()
        if waiting and not self._stopping:
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
        if self._stopping:
            return
        self._holding = True
        if self._inflight:
            running = self._inflight.popleft()
            if running.op == wire.PING:  # a replacement that died while starting
                running.fail(errors.BackendDied(f"{self.describe()} died while starting"))
            else:
                self._crashed.append(running)
        self._held[:0] = [p for p in self._inflight if not p.done()]
        self._inflight.clear()
        self._pipe_cost, self._pipe_unknown = 0.0, 0
        if self._restarting is None:
            self._restarting = asyncio.get_running_loop().create_task(
                self._restart(), name=f"mmserver-backend-{self.index}-restart"
            )

    async def _restart(self) -> None:
        """Replace a dead process: fail what it was running, reload its models, resend the rest."""
        loop = asyncio.get_running_loop()
        reloads: list[asyncio.Future[Any]] = []
        specs: list[LoadSpec] = []
        self._settling = True
        while not self._stopping:
            process = self._process
            exit_code: int | None = None
            if process is not None:
                await loop.run_in_executor(None, process.join, 5.0)
                exit_code = process.exitcode
            described = f"backend process {self.index} (pid {self.pid}, exit code {exit_code})"
            crashed, self._crashed = self._crashed, []
            for pending in crashed:
                pending.fail(
                    errors.BackendDied(
                        f"{described} died while running this request; it has been replaced, "
                        "so the request can be retried"
                    )
                )
            self._metrics.backend_restarts.inc()
            recycling, self._recycling = self._recycling, None
            log.log(
                logging.INFO if recycling else logging.WARNING,
                "%s %s; starting a replacement to reload %d model(s) and resend %d message(s)",
                described,
                f"replaced: {recycling}" if recycling else "died",
                len(self._loaded),
                len(self._held),
            )
            now = time.monotonic()
            self._restarts.append(now)
            if len(self._restarts) == self._restarts.maxlen and now - self._restarts[0] < 10.0:
                await asyncio.sleep(1.0)  # a crash loop: do not spin
            try:
                await self._spawn()
            except errors.BackendDied:
                continue  # the replacement died too; its ping is in _crashed
            except Exception:
                log.exception("could not start a replacement for %s", described)
                await asyncio.sleep(1.0)
                continue
            # A load the dead process had not begun is sent again with the held messages.
            resent = {p.spec.key for p in self._held if isinstance(p, _Load)}
            specs = [s for key, s in self._loaded.items() if key not in resent]
            reloads = [loop.create_future() for _ in specs]
            for spec, reload in zip(specs, reloads, strict=True):
                self._write(Pending((wire.LOAD, spec), reload))
            held, self._held = self._held, []
            for pending in held:
                if not pending.done():
                    self._write(pending)
            self._holding = False
            self._pump()
            log.info("backend process %d replaced by pid %s", self.index, self.pid)
            break
        self._restarting = None
        results = await asyncio.gather(*reloads, return_exceptions=True)
        self._settling = False
        for spec, result in zip(specs, results, strict=True):
            if isinstance(result, BaseException):
                log.error("reloading %s into %s failed: %s", spec.key, self.describe(), result)
            else:
                self._charge(spec.key, result)
