"""Jobs and the bounded per-model queue: how requests wait on the frontend for a batch.

An idle worker is given a batch as soon as ``batch_size`` jobs are queued, or once
``max_batch_delay`` has passed since the oldest queued job came, whichever comes first (the
model's pool decides; with the default delay of 0, whatever is queued goes at once). The batch's
requests go to the model's backend as they came (bodies, not arrays), where
:func:`mmserver.backend.batching.answer_batch` answers them; each job is settled with its own
answer (:meth:`Job.settle`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

from mmserver import errors
from mmserver.backend import Answer
from mmserver.codecs import Request


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
    """A bounded FIFO of jobs. ``put`` never blocks: a full queue raises
    :class:`errors.QueueFull` at once. Its pool takes batches from it (:meth:`take`)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: collections.deque[Job] = collections.deque()
        self._closed = False
        self._refusal: Callable[[], errors.MMServerError] = _unloading

    def __len__(self) -> int:
        return len(self._items)

    def put(self, job: Job) -> None:
        if self._closed:
            raise self._refusal()
        if len(self._items) >= self.maxsize:
            raise errors.QueueFull(
                f"the model's queue is full ({self.maxsize} jobs waiting); retry later"
            )
        self._items.append(job)

    def take(self, count: int, max_bytes: int = 0) -> list[Job]:
        """Up to ``count`` jobs from the front of the queue (at least one if any is queued),
        holding at most ``max_bytes`` of request bodies (0: no limit) unless the first alone
        holds more: it is then a batch of its own."""
        items = self._items
        if not items:
            return []
        taken = [items.popleft()]
        total = len(taken[0].request[0])
        count = max(1, count)
        while items and len(taken) < count:
            size = len(items[0].request[0])
            if max_bytes and total + size > max_bytes:
                break
            total += size
            taken.append(items.popleft())
        return taken

    def close(self, refusal: Callable[[], errors.MMServerError] | None = None) -> None:
        """Refuse new jobs with the error ``refusal`` makes (by default, the model is
        unloading); queued jobs can still be taken."""
        self._closed = True
        self._refusal = refusal or _unloading

    def reopen(self) -> None:
        """Take new jobs again."""
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


def _unloading() -> errors.MMServerError:
    return errors.ShuttingDown("the model is unloading; retry the request")


def partition_live(batch: Sequence[Job], now: float) -> list[Job]:
    """Answer the jobs that must not be computed (deadline passed, client gone, already
    answered) and return the rest, in order."""
    live: list[Job] = []
    for job in batch:
        if job.future.done():
            continue
        if job.deadline <= now:
            job.fail(
                errors.PredictTimeout(
                    "the request waited longer than option.predict_timeout and was not computed"
                )
            )
        elif job.client_gone is not None and job.client_gone():
            job.fail(errors.ClientGone("the client closed the connection before computing"))
        else:
            live.append(job)
    return live
