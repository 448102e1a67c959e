"""Jobs, the bounded per-model queue, and batches: collect on the frontend, answer where the model
runs.

A worker waits for one job, then keeps taking jobs until it has ``batch_size`` of them or
``max_batch_delay`` has passed since the first one was queued, whichever comes first; with
``batch_size = 1`` there is no wait. The batch's requests go to the model's backend as they came
(bodies, not arrays): :func:`answer_batch` runs there, decodes each body, makes one call to the
model for all the valid rows, and encodes one answer per request. A body that does not decode, or
has the wrong number of features, gets its own error; the others in its batch are answered.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmserver import errors
from mmserver.codecs import Request, decode_as, encode_as

#: One request's answer from :func:`answer_batch`: the encoded body, or the name of an
#: :class:`~mmserver.errors.MMServerError` class and its message.
Answer = bytes | tuple[str, str]


class Job:
    """One request on its way to a model, and the future of its answer."""

    __slots__ = ("client_gone", "deadline", "enqueued_at", "future", "request")

    def __init__(
        self,
        request: Request,
        future: asyncio.Future[Any],
        enqueued_at: float,
        deadline: float,
        client_gone: Callable[[], bool] | None = None,
    ) -> None:
        self.request = request
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

    def settle(self, answer: Answer) -> None:
        """Answer with what :func:`answer_batch` made for this job."""
        if type(answer) is bytes:
            self.answer(answer)
        else:
            self.fail(errors.from_name(*answer))


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


def answer_batch(
    requests: Sequence[Request],
    predict: Callable[[np.ndarray], Any],
    n_features: int | None,
    name: str,
) -> list[Answer]:
    """Decode each request, predict every valid row in one call, and encode each answer.

    A request that does not decode, or whose rows do not have ``n_features`` values, is answered
    with its error and left out of the call. When the model does not say how many features it
    takes, requests of different widths go to it in one call per width. An exception from
    ``predict``, or outputs that do not match the rows, is the whole batch's and is raised."""
    answers: list[Answer] = [b""] * len(requests)
    groups: dict[int, list[tuple[int, np.ndarray]]] = {}
    for i, (body, kind, _) in enumerate(requests):
        try:
            rows = decode_as(body, kind)
            if n_features is not None and rows.shape[1] != n_features:
                raise feature_error(name, n_features, rows.shape[1])
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)
            continue
        groups.setdefault(rows.shape[1], []).append((i, rows))
    for group in groups.values():
        outputs = predict(merge([rows for _, rows in group]))
        pieces = split(outputs, [len(rows) for _, rows in group])
        for (i, _), piece in zip(group, pieces, strict=True):
            try:
                answers[i] = encode_as(piece, requests[i][2])
            except errors.MMServerError as exc:
                answers[i] = (type(exc).__name__, exc.message)
    return answers


def feature_error(name: str, expected: int, got: int) -> errors.InvalidInput:
    return errors.InvalidInput(f"model {name} expects {expected} feature(s) per row, got {got}")


def merge(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The rows of every part, in order, as one 2-D array."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts, axis=0)


def split(outputs: Any, counts: Sequence[int]) -> list[Any]:
    """Cut ``outputs`` (one entry per input row) back into one piece per request."""
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
