"""A slot that runs predictions in a thread pool of the frontend process
(``backend_processes = 0``: development and tests)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.child import Models
from mmserver.backend.slot import BatchCallback, Pending, Runnable, time_out
from mmserver.backend.wire import BatchResult, LoadInfo, LoadSpec
from mmserver.codecs.requests import Request
from mmserver.policy.scheduling import Lane


class ThreadSlot:
    """Runs predictions in a thread pool of the frontend process (development and tests).

    A prediction that passes its deadline is answered 504, but its thread cannot be stopped; the
    pool has spare threads so the model's other workers keep serving.
    """

    def __init__(self, index: int, threads: int, lane: Lane) -> None:
        self.index = index
        self.lane = lane
        self.bound_workers = 0
        self._models = Models(time.thread_time)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="mmserver-predict")
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"in-process backend {self.index}"

    def ready(self, worker: Runnable) -> None:
        """``worker`` has a batch to run: threads run batches side by side, so it runs now."""
        worker.begin()

    def free(self) -> bool:
        return True

    def unaccounted_bytes(self) -> int:
        """0: the models' memory is the frontend's own, which has no baseline of its own."""
        return 0

    def recycle(self, reason: str) -> bool:
        """A thread pool is never replaced."""
        return False

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
        pending = Pending((wire.PREDICT,), callback=callback)
        work = loop.run_in_executor(self._executor, self._models.predict, key, requests)
        pending.deadline_handle = loop.call_at(deadline, time_out, pending)

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
