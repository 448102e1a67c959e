"""Backend processes: where models are loaded and predictions run, never on the event loop.

The only module that touches :mod:`multiprocessing`. A :class:`BackendPool` owns a fixed number of
*slots*; each slot is one long-lived process (:class:`ProcessSlot`) or, with
``backend_processes = 0``, a thread pool inside the frontend (:class:`ThreadSlot`, for
development and tests). Workers of the frontend are bound to a slot and send it batches.

Wire protocol (frontend ⇄ process): each process is connected by one ``AF_UNIX`` stream socket
(``multiprocessing.Pipe``); a message is one frame in ``Connection.send_bytes`` framing (a 4-byte
big-endian length, or ``-1`` and an 8-byte length) holding a pickle (protocol 5). A batch travels
as its requests' bodies, undecoded, and comes back as one encoded answer per request
(:func:`~mmserver.batching.answer_batch` runs in the process). The process handles messages
strictly in order and answers each one, so the frontend matches replies to requests by order: the
oldest unanswered message is the one *running*; those after it are *waiting*.

Faults: when a process dies, the message it was running fails with :class:`BackendDied`; a new
process is started, every model that was loaded in the slot is loaded again, and the waiting
messages are sent to it in their original order. When a prediction passes its deadline while
running, it is answered with :class:`PredictTimeout` and the process is replaced the same way, so
no worker stays stuck behind it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from mmserver import errors
from mmserver.batching import Answer, answer_batch
from mmserver.codecs import Request
from mmserver.config import ModelConfig
from mmserver.metrics import Metrics
from mmserver.scheduling import HEAVY, LIGHT, Cost, Lane, RunQueue, admits
from mmserver.store import tree_size

log = logging.getLogger(__name__)

_LOAD, _PREDICT, _UNLOAD, _PING = 0, 1, 2, 3
_OK, _ERR = 0, 1
_START_TIMEOUT = 60.0
#: Batches longer than this (wall time) have their CPU time read from the CPU clock.
_CPU_CLOCK_ABOVE_S = 0.0005
#: How often a process slot checks the deadlines of the messages it holds.
_WATCH_S = 0.05

#: Imported once by the fork server and shared copy-on-write by every backend process, so a
#: process starts (or is replaced) in milliseconds and a model's first load does not pay for
#: importing the estimator families most stores use (the optional ones when installed: a module
#: that cannot be imported is skipped).
PRELOAD = (
    "mmserver.backend", "mmserver.predictor", "joblib", "sklearn", "sklearn.linear_model",
    "sklearn.pipeline", "sklearn.preprocessing", "sklearn.tree", "sklearn.ensemble",
    "treelite", "treelite.sklearn", "treelite.gtil", "xgboost", "lightgbm",
)
_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


@dataclass(frozen=True)
class LoadSpec:
    """What a slot needs to load (and, after a restart, reload) one model."""

    key: str
    model_dir: Path
    config: ModelConfig


@dataclass(frozen=True)
class LoadInfo:
    """What loading a model in a slot reported: the memory one copy of it takes there (0 when
    it was loaded already), the CPU seconds of one prediction of a probe row (``None`` when
    the model could not be probed: a custom handler, or a model that does not say its width),
    and the model's :func:`~mmserver.predictor.signature` (``None`` when loaded already)."""

    memory_bytes: int
    probe_seconds: float | None = None
    #: The default handler's family and predict paths (``EstimatorPredictor.describe``).
    paths: dict[str, Any] | None = None
    signature: dict[str, Any] | None = None


#: A batch's answers (one per request), the CPU and wall seconds they took, the rows
#: predicted, and the predict path they took (``own`` for a custom handler).
BatchResult = tuple[list[Answer], float, float, int, str]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Models:
    """The models loaded in one slot, and the three operations on them (runs in the backend).

    ``clock`` measures the CPU time of a long batch: the whole process's in a backend process
    (a model may compute in threads of its own), the calling thread's in a thread slot."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.predictors: dict[str, Any] = {}
        self._clock = clock
        self._long: set[str] = set()  # models whose last batch was long

    def load(self, spec: LoadSpec) -> LoadInfo:
        from mmserver.predictor import load_predictor, signature  # imported where they run

        existing = self.predictors.get(spec.key)
        if existing is not None:
            return LoadInfo(0)
        before = _rss_bytes()
        predictor = load_predictor(spec.model_dir, spec.config)
        measured = max(0, _rss_bytes() - before)
        self.predictors[spec.key] = predictor
        # A page-granular RSS delta of zero means "too small to see", not "free".
        memory = measured or int(1.2 * tree_size(spec.model_dir)[0])
        describe = getattr(predictor, "describe", None)
        return LoadInfo(
            memory, self._probe(predictor), describe() if describe else None,
            signature(predictor),
        )

    def _probe(self, predictor: Any) -> float | None:
        """CPU seconds of predicting one row of zeros (the second of two calls: the first pays
        for warming up), so that the frontend knows the model's cost before its first batch."""
        from mmserver.predictor import EstimatorPredictor

        width = getattr(predictor, "n_features", None)
        if not isinstance(predictor, EstimatorPredictor) or not width:
            return None  # a custom handler's predict may have effects of its own
        row = np.zeros((1, width))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                predictor.predict(row)
                started = self._clock()
                predictor.predict(row)
                return self._clock() - started
        except Exception:
            return None

    def predict(self, key: str, requests: Sequence[Request]) -> BatchResult:
        """The batch's answers, the CPU and wall seconds they took, and the rows predicted."""
        name = key.split("#")[0]
        predictor = self.predictors.get(key)
        if predictor is None:
            raise errors.BackendDied(f"model {name} is not loaded in this backend")
        rows = 0

        def predict(batch: np.ndarray, output: str | None = None) -> Any:
            nonlocal rows
            rows += len(batch)
            return predictor.predict(batch) if output is None else predictor.output(output, batch)

        # The CPU clock costs a system call, twice a batch: it is read for the models whose
        # last batch was long; a short batch's CPU time is taken as its wall time.
        timed = key in self._long
        cpu = self._clock() if timed else 0.0
        started = time.perf_counter()
        try:
            answers = answer_batch(
                requests, predict, predictor.n_features, name, predictor.outputs
            )
        except errors.MMServerError:
            raise
        except Exception as exc:
            raise errors.ModelError(f"{type(exc).__name__}: {exc}") from None
        wall = time.perf_counter() - started
        cpu = self._clock() - cpu if timed else wall
        if wall > _CPU_CLOCK_ABOVE_S:
            self._long.add(key)
        elif timed:
            self._long.discard(key)
        return answers, cpu, wall, rows, getattr(predictor, "last_path", "own")

    def unload(self, key: str) -> None:
        self.predictors.pop(key, None)
        self._long.discard(key)


# ------------------------------------------------------------------------------------------------
# Inside a backend process
# ------------------------------------------------------------------------------------------------


class _FrameReader:
    """Reads frames from the frontend's socket: small ones from a 64 KiB read buffer (one
    ``recv`` brings every message queued meanwhile), large ones straight into a buffer of their
    exact size, with no intermediate copies."""

    _CHUNK = 65536

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._chunk = bytearray(self._CHUNK)
        self._view = memoryview(self._chunk)

    def _fill(self, want: int) -> bool:
        while len(self._buffer) < want:
            count = self._sock.recv_into(self._chunk)
            if count == 0:
                return False
            self._buffer += self._view[:count]
        return True

    def read(self) -> bytes | bytearray | None:
        """The next frame's payload, or ``None`` once the frontend closed the socket."""
        buffer = self._buffer
        if not self._fill(4):
            return None
        (size,) = _HEADER.unpack_from(buffer, 0)
        start = 4
        if size == -1:
            if not self._fill(12):
                return None
            (size,) = _LONG_HEADER.unpack_from(buffer, 4)
            start = 12
        end = start + size
        if size <= self._CHUNK:
            if not self._fill(end):
                return None
            frame = bytes(buffer[start:end])
            del buffer[:end]
            return frame
        large = bytearray(size)
        have = min(len(buffer) - start, size)
        large[:have] = buffer[start : start + have]
        del buffer[: start + have]
        view = memoryview(large)
        while have < size:
            count = self._sock.recv_into(view[have:])
            if count == 0:
                return None
            have += count
        return large


def _child_main(
    conn: multiprocessing.connection.Connection, index: int, nice: int, idle: bool
) -> None:
    """The backend process: answer each message in order until the frontend closes the pipe.
    ``nice`` lowers its CPU priority and ``idle`` puts it under ``SCHED_IDLE`` (the heavy lane's
    processes)."""
    if nice:
        os.nice(nice)
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as exc:  # not Linux: the nice value alone
            log.warning("backend process %d: SCHED_IDLE is not available (%s)", index, exc)
    # The frontend decides when we stop (it closes the pipe, or kills a stuck process), also
    # when a stop signal reaches the whole process group: Ctrl-C, or systemd's default
    # KillMode=control-group. Exiting here would fail the batches the frontend is draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Every request body is checked for NaN and infinity when it is decoded, so scikit-learn's
    # own check (a fifth of a small predict's time) would only repeat it.
    import sklearn

    sklearn.set_config(assume_finite=True)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.setblocking(True)
    reader = _FrameReader(sock)
    models = _Models()
    while True:
        try:
            data = reader.read()
        except OSError:
            return
        if data is None:
            return
        message = pickle.loads(data)
        del data
        op = message[0]
        reply: tuple[Any, ...]
        try:
            if op == _PREDICT:
                reply = (_OK, models.predict(message[1], message[2]))
            elif op == _LOAD:
                reply = (_OK, models.load(message[1]))
            elif op == _UNLOAD:
                models.unload(message[1])
                reply = (_OK, None)
            else:
                reply = (_OK, os.getpid())
        except errors.MMServerError as exc:
            reply = (_ERR, type(exc).__name__, exc.message)
        except Exception as exc:
            kind = "ModelLoadError" if op == _LOAD else "ModelError"
            reply = (_ERR, kind, f"{type(exc).__name__}: {exc}")
        del message
        try:
            frame = _frame(reply)
        except Exception as exc:
            frame = _frame((_ERR, "ModelError", f"the model's output cannot be sent back: {exc}"))
        try:
            _send_frame(sock, frame)
        except OSError:
            return


def _send_frame(sock: socket.socket, frame: list[bytes]) -> None:
    sent = sock.sendmsg(frame)
    total = sum(len(part) for part in frame)
    if sent < total:  # a partial write: send the rest in order
        sock.sendall(b"".join(frame)[sent:])


# ------------------------------------------------------------------------------------------------
# Frontend side of one process
# ------------------------------------------------------------------------------------------------


#: Called with ``(result, None)`` or ``(None, error)`` when a batch is answered; a batch's
#: result is a :data:`BatchResult`.
BatchCallback = Callable[[Any, BaseException | None], None]


class Runnable(Protocol):
    """What a slot's run queue holds: a worker whose model has jobs queued (see
    :mod:`mmserver.scheduling`)."""

    #: The slot's count of answered batches when the worker became ready.
    mark: int

    @property
    def cost(self) -> Cost: ...
    def waiting(self) -> bool: ...
    def begin(self, waited: int = 0) -> bool: ...


class _Pending:
    """One message sent (or to be sent) to a backend process, and who wants its reply: a
    future, or (for batches) a callback called as soon as the reply is read. ``cost`` is the
    estimated seconds it holds the process (infinite when unknown, as for a load)."""

    __slots__ = (
        "callback", "cost", "deadline", "deadline_handle", "finished", "frame", "future", "op"
    )

    def __init__(
        self,
        op: int,
        frame: list[bytes],
        future: asyncio.Future[Any] | None = None,
        callback: BatchCallback | None = None,
        cost: float = math.inf,
    ) -> None:
        self.op = op
        self.frame = frame
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


def _frame(message: tuple[Any, ...]) -> list[bytes]:
    payload = pickle.dumps(message, protocol=5)
    if len(payload) < 0x7FFFFFFF:
        return [_HEADER.pack(len(payload)), payload]
    return [_HEADER.pack(-1), _LONG_HEADER.pack(len(payload)), payload]


class _ReplyProtocol(asyncio.Protocol):
    """Parses reply frames from a backend process and hands them to its slot in order."""

    def __init__(self, slot: ProcessSlot) -> None:
        self.slot = slot
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        # Every whole frame read is parsed in place; the buffer is trimmed once, at the end.
        offset = 0
        try:
            while len(buf) - offset >= 4:
                (size,) = _HEADER.unpack_from(buf, offset)
                start = offset + 4
                if size == -1:
                    if len(buf) - offset < 12:
                        return
                    (size,) = _LONG_HEADER.unpack_from(buf, offset + 4)
                    start = offset + 12
                end = start + size
                if len(buf) < end:
                    return
                with memoryview(buf) as view:
                    reply = pickle.loads(view[start:end])
                offset = end
                self.slot._on_reply(reply)
        finally:
            del buf[:offset]
            if offset:
                self.slot._pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.slot._on_connection_lost(self)


class ProcessSlot:
    """One backend process, replaced when it dies. See the module docstring for the protocol.

    While the process is starting (or a replacement is), new messages are *held* and written
    once the models of the slot are loaded again, so they never reach a process that lacks their
    model.

    Batches are scheduled here, on the frontend: a worker with a batch to run waits in the
    slot's run queue (:meth:`ready`), and the slot admits the next one in fair order whenever
    its pipe holds little enough estimated work (:func:`~mmserver.scheduling.admits`).
    """

    def __init__(
        self,
        index: int,
        context: multiprocessing.context.ForkServerContext,
        metrics: Metrics,
        lane: Lane,
        nice: int = 0,
        idle: bool = False,
    ) -> None:
        self.index = index
        self.lane = lane
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
        self._protocol: _ReplyProtocol | None = None
        self._runq: RunQueue[Runnable] = RunQueue()
        self._pump_handle: asyncio.Handle | None = None
        self._pumping = False
        self._inflight: collections.deque[_Pending] = collections.deque()
        #: Estimated seconds of the batches in the pipe, and how many messages there have
        #: no estimate (loads, batches of models not measured yet).
        self._pipe_cost = 0.0
        self._pipe_unknown = 0
        self._watchdog: asyncio.TimerHandle | None = None
        self._held: list[_Pending] = []
        self._crashed: list[_Pending] = []
        self._holding = True
        # Frames written during one turn of the event loop go out in one system call.
        self._out: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None
        self._loaded: dict[str, LoadSpec] = {}
        self._restarting: asyncio.Task[None] | None = None
        self._stopping = False
        self._restarts: collections.deque[float] = collections.deque(maxlen=5)
        self._loop: asyncio.AbstractEventLoop  # the event loop the slot was started on

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

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
            error = exc if isinstance(exc, errors.MMServerError) else errors.BackendDied(
                f"{self.describe()} could not start: {exc}"
            )
            for pending in held:
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
            target=_child_main, args=(child, self.index, self._nice, self._idle_policy),
            name=f"mmserver-backend-{self.index}", daemon=True,
        )
        await loop.run_in_executor(None, process.start)
        child.close()
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        parent.close()
        sock.setblocking(False)
        self._process = process
        _, protocol = await loop.create_unix_connection(lambda: _ReplyProtocol(self), sock=sock)
        self._protocol = protocol
        ping: asyncio.Future[Any] = loop.create_future()
        self._write(_Pending(_PING, _frame((_PING,)), ping))
        try:
            await asyncio.wait_for(asyncio.shield(ping), _START_TIMEOUT)
        except TimeoutError:
            process.kill()
            raise errors.BackendDied(
                f"{self.describe()} did not answer within {_START_TIMEOUT:.0f} s of starting"
            ) from None

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
            await loop.run_in_executor(None, process.join, 5.0)
            if process.is_alive():
                process.kill()
                await loop.run_in_executor(None, process.join, 5.0)
        shutting_down = errors.ShuttingDown("the server is shutting down")
        for pending in [*self._crashed, *self._inflight, *self._held]:
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
        self._ensure_started()
        self._loaded[spec.key] = spec
        try:
            info: LoadInfo = await self._send((_LOAD, spec), deadline=None)
        except BaseException:
            self._loaded.pop(spec.key, None)
            raise
        return info

    # Scheduling -------------------------------------------------------------------------------

    def ready(self, worker: Runnable) -> None:
        """``worker`` has a batch to run here: it runs at once if the process is idle, otherwise
        when its turn comes (:meth:`_pump`). Its batch is taken from its queue only then."""
        worker.mark = self.answered
        cost = worker.cost
        tag = self.lane.tag(cost)
        if not self._runq and not self._pumping and not self._holding and not self._stopping:
            pipe = math.inf if self._pipe_unknown else self._pipe_cost
            if admits(len(self._inflight), pipe, cost.estimate):
                # Nobody waits and the pipe has room: it runs now, as the pump would run it.
                if worker.begin(self.admitted - worker.mark):
                    self.lane.charge(tag, cost)
                return
        self._runq.push(tag, worker)
        if not self._inflight:
            self._pump()
        elif self._pump_handle is None and not self._pumping:
            # Workers made ready in this turn of the event loop are ordered together.
            self._pump_handle = self._loop.call_soon(self._pump)

    def free(self) -> bool:
        """Nothing running or waiting here."""
        return not self._inflight and not self._runq and not self._holding

    def _pump(self) -> None:
        """Admit waiting workers' batches in fair order while the pipe has room; their frames go
        out in one system call."""
        if self._pump_handle is not None:
            self._pump_handle.cancel()
            self._pump_handle = None
        if self._holding or self._stopping or self._pumping:
            return
        runq, lane = self._runq, self.lane
        self._pumping = True
        try:
            while runq:
                tag, worker = runq.peek()
                if not worker.waiting():
                    runq.pop_first()  # it left, or was given its jobs elsewhere
                    continue
                cost = worker.cost
                pipe = math.inf if self._pipe_unknown else self._pipe_cost
                if not admits(len(self._inflight), pipe, cost.estimate):
                    break
                runq.pop_first()
                # Every batch admitted since the worker's mark ran, or runs, before its own.
                if worker.begin(self.admitted - worker.mark):
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
        message = (_PREDICT, key, requests)
        self._enqueue(
            _Pending(_PREDICT, _frame(message), callback=callback, cost=estimate), deadline
        )

    async def unload(self, key: str) -> None:
        if self._loaded.pop(key, None) is None or self._stopping:
            return
        try:
            await self._send((_UNLOAD, key), deadline=None, cost=0.0)
        except errors.MMServerError:
            pass  # a process that died holds nothing

    def _send(
        self, message: tuple[Any, ...], deadline: float | None, cost: float = math.inf
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        self._enqueue(_Pending(message[0], _frame(message), future, cost=cost), deadline)
        return future

    def _enqueue(self, pending: _Pending, deadline: float | None) -> None:
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

    def _write(self, pending: _Pending) -> None:
        """Send ``pending``'s frame: at once if the process has nothing to do, else with the
        other frames written in this turn of the event loop (one system call for all)."""
        idle = not self._inflight
        self._inflight.append(pending)
        if pending.cost < math.inf:
            self._pipe_cost += pending.cost
        else:
            self._pipe_unknown += 1
        self._out.extend(pending.frame)
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
            protocol.transport.writelines(out)

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
        if pending.op == _PREDICT:
            self.answered += 1
        if reply[0] == _OK:
            pending.succeed(reply[1])
        else:
            pending.fail(errors.from_name(reply[1], reply[2]))

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
            _time_out(pending)
            if running and not self._holding:
                log.warning("%s: a prediction timed out; replacing the process", self.describe())
                self.kill()
        if waiting and not self._stopping:
            self._watchdog = self._loop.call_later(_WATCH_S, self._watch)

    def _on_connection_lost(self, protocol: _ReplyProtocol) -> None:
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
            if running.op == _PING:  # a replacement that died while starting
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
        while not self._stopping:
            process = self._process
            exit_code: int | None = None
            if process is not None:
                await loop.run_in_executor(None, process.join, 5.0)
                exit_code = process.exitcode
            described = f"backend process {self.index} (pid {self.pid}, exit code {exit_code})"
            crashed, self._crashed = self._crashed, []
            for pending in crashed:
                pending.fail(errors.BackendDied(
                    f"{described} died while running this request; it has been replaced, "
                    "so the request can be retried"
                ))
            self._metrics.backend_restarts.inc()
            log.warning(
                "%s died; starting a replacement to reload %d model(s) and resend %d message(s)",
                described, len(self._loaded), len(self._held),
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
            reloads = [loop.create_future() for _ in self._loaded]
            for spec, reload in zip(self._loaded.values(), reloads, strict=True):
                self._write(_Pending(_LOAD, _frame((_LOAD, spec)), reload))
            held, self._held = self._held, []
            for pending in held:
                if not pending.done():
                    self._write(pending)
            self._holding = False
            self._pump()
            log.info("backend process %d replaced by pid %s", self.index, self.pid)
            break
        self._restarting = None
        for spec, result in zip(
            list(self._loaded.values()),
            await asyncio.gather(*reloads, return_exceptions=True),
            strict=False,
        ):
            if isinstance(result, BaseException):
                log.error("reloading %s into %s failed: %s", spec.key, self.describe(), result)


# ------------------------------------------------------------------------------------------------
# In-process slot (backend_processes = 0)
# ------------------------------------------------------------------------------------------------


class ThreadSlot:
    """Runs predictions in a thread pool of the frontend process (development and tests).

    A prediction that passes its deadline is answered 504, but its thread cannot be stopped; the
    pool has spare threads so the model's other workers keep serving.
    """

    def __init__(self, index: int, threads: int, lane: Lane) -> None:
        self.index = index
        self.lane = lane
        self.bound_workers = 0
        self._models = _Models(time.thread_time)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="mmserver-predict")
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"in-process backend {self.index}"

    def ready(self, worker: Runnable) -> None:
        """``worker`` has a batch to run: threads run batches side by side, so it runs now."""
        worker.mark = 0
        worker.begin()

    def free(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def load(self, spec: LoadSpec) -> LoadInfo:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._locked_load, spec)

    def _locked_load(self, spec: LoadSpec) -> LoadInfo:
        with self._lock:
            return self._models.load(spec)

    def send_batch(
        self,
        key: str,
        requests: Sequence[Request],
        deadline: float,
        callback: BatchCallback,
        estimate: float = math.inf,
    ) -> None:
        """Run a batch in the thread pool; ``callback`` as for :meth:`ProcessSlot.send_batch`,
        with :class:`errors.PredictTimeout` at ``deadline`` (the thread runs on)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(_PREDICT, [], callback=callback)
        work = loop.run_in_executor(self._executor, self._models.predict, key, requests)
        pending.deadline_handle = loop.call_at(deadline, _time_out, pending)

        def finished(work: asyncio.Future[BatchResult]) -> None:
            if work.cancelled():
                pending.fail(errors.ShuttingDown("the server is shutting down"))
            elif (error := work.exception()) is not None:
                pending.fail(error)
            else:
                pending.succeed(work.result())

        work.add_done_callback(finished)

    async def unload(self, key: str) -> None:
        self._models.unload(key)


def _time_out(pending: _Pending) -> None:
    pending.fail(
        errors.PredictTimeout("the prediction did not finish within option.predict_timeout")
    )


# ------------------------------------------------------------------------------------------------
# The pool
# ------------------------------------------------------------------------------------------------


class BackendPool:
    """The backend slots of the server, in their lanes, and the choice of slot for a new worker.

    ``processes`` slots make the light lane and start with the server; ``heavy_processes`` more,
    at ``heavy_nice`` and (with ``heavy_sched_idle``) under ``SCHED_IDLE``, make the heavy lane
    and start when a model first needs one. A model whose
    batches take more than ``heavy_batch_ms`` of CPU belongs in the heavy lane
    (:mod:`mmserver.scheduling`). With ``processes = 0`` there is one thread slot and one lane.
    """

    def __init__(
        self,
        processes: int,
        metrics: Metrics,
        threads: int = 8,
        *,
        heavy_processes: int = 0,
        heavy_nice: int = 19,
        heavy_sched_idle: bool = True,
        heavy_batch_ms: float = 2.0,
    ) -> None:
        self.slots: list[ProcessSlot | ThreadSlot]
        self.lanes = {LIGHT: Lane(LIGHT)}
        #: Above this many seconds a batch, a model moves to the heavy lane (0: no heavy lane;
        #: see :func:`~mmserver.scheduling.lane_bounds`).
        self.heavy_batch_s = 0.0
        if processes == 0:
            self.slots = [ThreadSlot(0, threads, self.lanes[LIGHT])]
            return
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        self.slots = [
            ProcessSlot(i, context, metrics, self.lanes[LIGHT]) for i in range(processes)
        ]
        if heavy_processes:
            self.heavy_batch_s = heavy_batch_ms / 1000.0
            self.lanes[HEAVY] = heavy = Lane(HEAVY)
            self.slots += [
                ProcessSlot(processes + i, context, metrics, heavy, heavy_nice, heavy_sched_idle)
                for i in range(heavy_processes)
            ]

    async def start(self) -> None:
        """Start the light lane's processes (the heavy lane's start on first use)."""
        await asyncio.gather(
            *(slot.start() for slot in self.slots if slot.lane.name == LIGHT)
        )

    async def stop(self) -> None:
        await asyncio.gather(*(slot.stop() for slot in self.slots), return_exceptions=True)

    def pick(self, taken: set[int], lane: str = LIGHT) -> ProcessSlot | ThreadSlot:
        """The slot in ``lane`` for a new worker of a model already bound to the slots in
        ``taken``: one the model is not in if any, least-loaded (fewest bound workers) first,
        lowest index on ties."""
        slots = [s for s in self.slots if s.lane.name == lane] or self.slots
        free = [s for s in slots if s.index not in taken]
        candidates = free or slots
        return min(candidates, key=lambda s: (s.bound_workers, s.index))

    def pids(self) -> list[int]:
        return [pid for s in self.slots if isinstance(s, ProcessSlot) and (pid := s.pid)]
