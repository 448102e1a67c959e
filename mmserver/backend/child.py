"""Inside a backend process: the models loaded there and the loop that answers the frontend's
messages strictly in order (:func:`child_main`, the process's target)."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.batching import answer_batch
from mmserver.backend.wire import BatchResult, LoadInfo, LoadSpec
from mmserver.codecs.requests import Request
from mmserver.ops import heap, logs
from mmserver.policy.scheduling import CPU_CLOCK_ABOVE_S
from mmserver.procs.framing import FrameReader, frame, send_frame
from mmserver.store.local import tree_size

log = logging.getLogger(__name__)

#: The most warnings a load reports (each once).
MAX_LOAD_WARNINGS = 20

#: A batch of more rows than this may leave freed memory the next load would reuse: that load
#: trims the heap first.
LARGE_BATCH_ROWS = 256

#: A load that grew the process by this much or more ends with a trim of the heap, so that the
#: pages its own work freed do not count as its cost. A smaller one leaves less than this in the
#: allocator's free lists (which the next loads reuse, and which the frontend counts as the
#: process's unaccounted memory): a trim walks the whole heap, and in a stream of cold loads of
#: small models into a process holding thousands it cost more than the load (0.5 ms at 2,500).
TRIM_AFTER_BYTES = 1 << 20


def rss_bytes() -> int:
    """The process's resident bytes (0 where they are not known).

    Read two or three times a load: ``/proc/self/statm`` is opened once per process (a forked
    child opens its own: the inherited file is its parent's) and read again in place
    (``pread``), 1 µs a read where opening it each time cost 8.5 (measured here)."""
    pid, fd = _statm
    try:
        if pid != (me := os.getpid()):  # (an inherited file is left open: its number may be reused)
            fd = os.open("/proc/self/statm", os.O_RDONLY)
            _statm[:] = [me, fd]
        return int(os.pread(fd, 64, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


#: The process that opened ``/proc/self/statm``, and the open file (-1: none yet).
_statm = [0, -1]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_wait_seconds() -> float:
    """The seconds the calling thread has spent waiting for a CPU, runnable but not running
    (Linux's ``schedstat``; 0.0 where it is not known).

    Read twice a long batch: the file is opened once per thread and read again in place
    (``pread``), 6 µs a read where opening it each time cost 43 (measured here)."""
    fd = getattr(_schedstat, "fd", None)
    try:
        if fd is None:
            fd = _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        return int(os.pread(fd, 64, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        _schedstat.fd = -1  # not known here: 0.0 from now on, without trying again
        return 0.0


#: Each thread's open ``/proc/thread-self/schedstat`` (the file names the thread that opened it).
_schedstat = threading.local()


class Models:
    """The models loaded in one slot, and the three operations on them (runs in the backend).

    ``clock`` measures the CPU time of a long batch: the whole process's in a backend process
    (a model may compute in threads of its own), the calling thread's in a thread slot."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.predictors: dict[str, Any] = {}
        self._clock = clock
        self._pid = os.getpid()
        self._long: set[str] = set()  # models whose last batch was long
        #: The model the process runs now, or ran last: what its log lines name.
        self.running: str | None = None
        #: Whether the heap was trimmed since it last freed much: after a load or an unload
        #: (each ends with a trim), until a failed load or a large batch.
        self._trimmed = False

    def load(self, spec: LoadSpec) -> LoadInfo:
        from mmserver.execution.families import collecting_warnings  # imported where they run
        from mmserver.execution.predictor import load_predictor, signature

        existing = self.predictors.get(spec.key)
        if existing is not None:
            return LoadInfo(0)
        name = self.running = spec.key.split("#")[0]
        started = time.perf_counter()
        # Measured from a trimmed heap: freed pages that the allocator kept (from models
        # unloaded, batches answered) would otherwise be reused by this load, which would then
        # seem to cost nothing. An unload and a large load end with a trim (a small one leaves
        # less than TRIM_AFTER_BYTES kept), so one is needed first only after a failed load or
        # a large batch.
        if not self._trimmed:
            heap.release_freed()
        self._trimmed = False
        before = rss_bytes()
        # Warnings go to the frontend with the load's answer (the model's log line and its
        # describe), not to the process's stderr, once each.
        with warnings.catch_warnings(record=True) as caught, collecting_warnings() as files:
            warnings.simplefilter("always")
            predictor = load_predictor(spec.model_dir, spec.config, name)
            probe = self._probe(predictor)  # what its first predictions keep counts too
            self.predictors[spec.key] = predictor
        if probe is None:
            # Nothing is known of its cost: its first batch is timed by the CPU clock, since the
            # frontend takes that batch's time as its cost (its wall time, on a busy machine,
            # would make a light model heavy).
            self._long.add(spec.key)
        raised = tuple(
            dict.fromkeys([*files, *(f"{w.category.__name__}: {w.message}" for w in caught)])
        )
        grew = rss_bytes() - before
        if grew >= TRIM_AFTER_BYTES:
            heap.release_freed()
            grew = rss_bytes() - before
        self._trimmed = True
        measured = max(0, grew)
        # A page-granular RSS delta of zero means "too small to see", not "free".
        memory = measured or int(1.2 * tree_size(spec.model_dir)[0])
        describe = getattr(predictor, "describe", None)
        return LoadInfo(
            memory,
            probe,
            pickle.dumps(describe(), pickle.HIGHEST_PROTOCOL) if describe else None,
            signature(predictor),
            time.perf_counter() - started,
            raised[:MAX_LOAD_WARNINGS],
        )

    def _probe(self, predictor: Any) -> float | None:
        """Seconds of predicting one row of zeros (the second of two calls: the first pays for
        warming up), so that the frontend knows the model's cost before its first batch."""
        from mmserver.execution.predictor import EstimatorPredictor

        width = getattr(predictor, "n_features", None)
        if not isinstance(predictor, EstimatorPredictor) or not width:
            return None  # a custom handler's predict may have effects of its own
        row = predictor.sample()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                predictor.predict(row)
                # Timed by the wall clock: a backend process's CPU clock (a system call) cost
                # more than the two predictions together in a stream of cold loads. One row
                # takes microseconds, seldom preempted; a time past CPU_CLOCK_ABOVE_S (a
                # preemption, or a model that is slow) is taken again by the CPU clock, so that
                # a preempted probe does not make a light model look heavy.
                started = time.perf_counter()
                predictor.predict(row)
                took = time.perf_counter() - started
                if took > CPU_CLOCK_ABOVE_S:
                    cpu = self._clock()
                    predictor.predict(row)
                    took = min(took, self._clock() - cpu)
                return took
        except Exception as exc:
            if isinstance(exc, ValueError) and not isinstance(exc, AttributeError):
                return None  # the row's values (a logarithm of 0, say): requests bring theirs
            # Not the values: the model fails whatever it is sent (a class whose attributes
            # changed in another version, an estimator not fitted: scikit-learn's
            # NotFittedError is both errors). Served, every request would fail.
            said = str(exc).strip().splitlines()
            detail = f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__
            raise errors.ModelLoadError(
                f"its own {predictor.method} fails on a row of plain values at load ({detail}); "
                "it is not served, every request would fail"
            ) from None

    def predict(self, key: str, requests: Sequence[Request]) -> BatchResult:
        """The batch's answers, the CPU and wall seconds they took, the rows predicted, the
        predict path and the batch's times here (:data:`~mmserver.ops.traces.BackendTimes`:
        the frontend makes a sampled request's spans of them)."""
        name = key.split("#")[0]
        predictor = self.predictors.get(key)
        if predictor is None:
            raise errors.BackendDied(f"model {name} is not loaded in this backend")
        self.running = name
        rows = 0
        predicted = 0.0

        def predict(batch: Any, output: str | None = None) -> Any:
            nonlocal rows, predicted
            rows += len(batch)
            outputs = (
                predictor.predict(batch) if output is None else predictor.output(output, batch)
            )
            predicted = time.perf_counter()  # what follows the model's last call is encoding
            return outputs

        # The CPU clock costs a system call, twice a batch: it is read for the models whose
        # last batch was long; a short batch's CPU time is taken as its wall time (the two
        # equal: the frontend does not count one found long as CPU time). A long
        # batch's wall time leaves out what it spent waiting for a CPU: on a busy machine other
        # processes' work would otherwise count as the model's (and make a light one heavy).
        timed = key in self._long
        cpu = self._clock() if timed else 0.0
        waited = cpu_wait_seconds() if timed else 0.0
        started = time.perf_counter()
        try:
            if predictor.inputs.raw:
                answers: list[Any] = predictor.answer_raw(requests)
                rows = len(requests)
            else:
                answers = answer_batch(requests, predict, predictor.inputs, name, predictor.outputs)
        except errors.MMServerError:
            raise
        except Exception as exc:
            raise errors.ModelError(f"{type(exc).__name__}: {exc}") from None
        ended = time.perf_counter()
        wall = ended - started
        if timed:
            cpu = self._clock() - cpu
            held = wall - (cpu_wait_seconds() - waited)
        else:
            cpu = held = wall
        if wall > CPU_CLOCK_ABOVE_S:
            self._long.add(key)
        elif timed:
            self._long.discard(key)
        if rows > LARGE_BATCH_ROWS:
            self._trimmed = False  # what it freed may be kept for reuse by the next load
        times = (self._pid, started, predicted or ended, ended)
        return answers, cpu, held, rows, getattr(predictor, "last_path", "own"), times

    def unload(self, key: str) -> None:
        if self.predictors.pop(key, None) is not None:
            heap.release_freed()  # the process shrinks by what the model held
            self._trimmed = True
        self._long.discard(key)


def child_main(
    conn: multiprocessing.connection.Connection, index: int, nice: int, idle: bool, lane: str
) -> None:
    """The backend process: answer each message in order until the frontend closes the pipe.
    ``nice`` lowers its CPU weight (the heavy lane's processes) and ``idle`` puts it under
    ``SCHED_IDLE`` instead (the heavy lane with ``heavy_sched_idle``). ``ps`` shows it as
    ``mmserver: backend LANE INDEX``."""
    try:
        import setproctitle  # a model environment may lack it: the process keeps its name
    except ImportError:
        pass
    else:
        setproctitle.setproctitle(f"mmserver: backend {lane} {index}")
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
    # Every request body is checked for infinities when it is decoded, and for NaN where the
    # model does not take missing values (found at load, with the check on: mmserver.codecs.schema),
    # so scikit-learn's own check (a fifth of a small predict's time) would only repeat it.
    import sklearn

    sklearn.set_config(assume_finite=True)
    heap.tune_collector()  # no full collections of every model behind batches (mmserver.ops.heap)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    sock.setblocking(True)
    reader = FrameReader(sock)
    models = Models()
    logs.setup_backend(lambda: models.running)  # as the server's log, each line naming the model
    # The frontend may write several messages in one frame (the batches of one turn of its
    # event loop); each is answered as soon as it is done. Holding a reply for the next
    # batch's, to send both in one system call, cost 8 to 11 % of the closed loop's requests a
    # second (scripts/bench --only closed,hot,uniform --runs 5, against a build without it).
    while True:
        try:
            data = reader.read()
        except OSError:
            return
        if data is None:
            return
        message = pickle.loads(data)
        del data
        for each in message[1] if message[0] == wire.MANY else (message,):
            if not _send(sock, _answer(models, each)):
                return
        del message


def _send(sock: socket.socket, reply: tuple[Any, ...]) -> bool:
    """Send ``reply`` in one frame: whether the frontend is still there."""
    try:
        send_frame(sock, _frame(reply))
    except OSError:
        return False
    return True


def _frame(reply: tuple[Any, ...]) -> list[bytes]:
    """One reply's frame; if its answer cannot be pickled, the error that says so."""
    try:
        return frame(reply)
    except Exception as exc:
        return frame(
            (wire.ERR, "ModelError", f"the model's output cannot be sent back: {exc}", None)
        )


def _answer(models: Models, message: tuple[Any, ...]) -> tuple[Any, ...]:
    """The reply to one message of the frontend."""
    op = message[0]
    try:
        if op == wire.PREDICT:
            return (wire.OK, models.predict(message[1], message[2]))
        if op == wire.LOAD:
            return (wire.OK, models.load(message[1]))
        if op == wire.UNLOAD:
            models.unload(message[1])
            return (wire.OK, None)
        return (wire.OK, os.getpid())
    except errors.MMServerError as exc:
        return (wire.ERR, type(exc).__name__, exc.message, exc.model)
    except Exception as exc:
        kind = "ModelLoadError" if op == wire.LOAD else "ModelError"
        return (wire.ERR, kind, f"{type(exc).__name__}: {exc}", None)
