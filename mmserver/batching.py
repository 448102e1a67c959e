"""Jobs, the bounded per-model queue, and batches: collect, merge into one call, split back.

A worker waits for one job, then keeps taking jobs until it has ``batch_size`` of them or
``max_batch_delay`` has passed since the first one was queued, whichever comes first; with
``batch_size = 1`` there is no wait. The rows of all jobs go to the model in one call and the
outputs are split back in order (:func:`merge` and :func:`split` are pure).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmserver import errors


class Job:
    """One request's rows on their way to a model, and the future of its answer."""

    __slots__ = ("client_gone", "deadline", "enqueued_at", "future", "rows")

    def __init__(
        self,
        rows: np.ndarray,
        future: asyncio.Future[Any],
        enqueued_at: float,
        deadline: float,
        client_gone: Callable[[], bool] | None = None,
    ) -> None:
        self.rows = rows
        self.future = future
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.client_gone = client_gone

    def answer(self, result: Any) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class JobQueue:
    """A bounded FIFO of jobs with cheap waiting (one future per wait, no task).

    ``put`` never blocks: a full queue raises :class:`errors.QueueFull` at once.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: collections.deque[Job] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, job: Job) -> None:
        if self._closed:
            raise errors.ShuttingDown("the model is unloading; retry the request")
        if len(self._items) >= self.maxsize:
            raise errors.QueueFull(
                f"the model's queue is full ({self.maxsize} jobs waiting); retry later"
            )
        self._items.append(job)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def get_nowait(self) -> Job | None:
        return self._items.popleft() if self._items else None

    async def get(self, timeout: float | None) -> Job | None:
        """The next job, or ``None`` when ``timeout`` seconds pass first or the queue closes."""
        if self._items:
            return self._items.popleft()
        if self._closed:
            return None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        handle = None
        if timeout is not None:
            handle = loop.call_later(max(0.0, timeout), _expire, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if self._items and waiter.done() and not waiter.cancelled():
                self._wake_one()  # pass the wake-up on: another worker takes the job
            raise
        finally:
            if handle is not None:
                handle.cancel()
        if self._items:
            return self._items.popleft()
        return None

    def close(self) -> None:
        """Refuse new jobs and wake every waiter (queued jobs can still be taken)."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def reopen(self) -> None:
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def drain(self) -> list[Job]:
        """Take every queued job out (to answer them with an error)."""
        items = list(self._items)
        self._items.clear()
        return items

    def oldest_enqueued_at(self) -> float | None:
        return self._items[0].enqueued_at if self._items else None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def collect_batch(
    queue: JobQueue, batch: list[Job], batch_size: int, delay_s: float, clock: Callable[[], float]
) -> None:
    """Grow ``batch`` (which holds its first job) with queued jobs until it has ``batch_size``
    jobs or ``delay_s`` has passed since its first job was queued, whichever comes first.

    ``batch`` is the caller's list, so the jobs already taken are the caller's to answer if this
    is cancelled."""
    if batch_size <= 1:
        return
    until = batch[0].enqueued_at + delay_s
    while len(batch) < batch_size:
        job = queue.get_nowait()
        if job is None:
            remaining = until - clock()
            if remaining <= 0:
                return
            job = await queue.get(remaining)
            if job is None:
                return
        batch.append(job)


def partition_live(batch: Sequence[Job], now: float) -> list[Job]:
    """Answer the jobs that must not be computed (deadline passed, client gone, already
    answered) and return the rest, in order."""
    live: list[Job] = []
    for job in batch:
        if job.future.done():
            continue
        if job.deadline <= now:
            job.fail(errors.PredictTimeout(
                "the request waited longer than option.predict_timeout and was not computed"
            ))
        elif job.client_gone is not None and job.client_gone():
            job.fail(errors.ClientGone("the client closed the connection before computing"))
        else:
            live.append(job)
    return live


def merge(batch: Sequence[Job]) -> np.ndarray:
    """The rows of every job of ``batch``, in order, as one 2-D array."""
    if len(batch) == 1:
        return batch[0].rows
    return np.concatenate([job.rows for job in batch], axis=0)


def split(outputs: Any, counts: Sequence[int]) -> list[Any]:
    """Cut ``outputs`` (one entry per input row) back into one piece per job."""
    total = sum(counts)
    if len(outputs) != total:
        raise errors.ModelError(f"the model returned {len(outputs)} outputs for {total} rows")
    if len(counts) == 1:
        return [outputs]
    pieces = []
    start = 0
    for count in counts:
        pieces.append(outputs[start : start + count])
        start += count
    return pieces
