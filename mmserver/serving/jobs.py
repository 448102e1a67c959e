"""Jobs and the bounded per-model queue: how requests wait on the frontend for a batch.

An idle worker is given a batch as soon as ``batch_size`` jobs are queued, or once
``max_batch_delay`` has passed since the oldest queued job came, whichever comes first (the
model's pool asks :func:`cut_batch`; with the default delay of 0, whatever is queued goes at
once). The worker takes its batch from the queue when its slot gives it a turn: up to
``batch_size`` jobs from the front holding at most ``max_batch_bytes`` (:func:`batch_length`).
The batch's requests go to the model's backend as they came (bodies, not arrays), where
:func:`mmserver.backend.batching.answer_batch` answers them; each job is settled with its own
answer (:meth:`Job.settle`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from mmserver import errors
from mmserver.backend.batching import Answer
from mmserver.codecs.requests import Request
from mmserver.ops.traces import Passage

#: A request's priority (its tenant's ``priority``): who is shed first when a queue is full.
LOW, NORMAL, HIGH = 0, 1, 2
PRIORITY = {"high": HIGH, "normal": NORMAL, "low": LOW}


class Job:
    """One request on its way to a model, and the future of its answer. A *background* job
    (an asynchronous request's) does not count toward its model's real-time scale-up. A
    sampled request's job records its way in its ``trace`` (:mod:`mmserver.ops.traces`)."""

    __slots__ = (
        "background",
        "client_gone",
        "deadline",
        "enqueued_at",
        "future",
        "priority",
        "request",
        "trace",
    )

    def __init__(
        self,
        request: Request,
        future: asyncio.Future[Any],
        enqueued_at: float,
        deadline: float,
        client_gone: Callable[[], bool] | None = None,
        background: bool = False,
        priority: int = NORMAL,
        trace: Passage | None = None,
    ) -> None:
        self.request = request
        self.future = future
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.client_gone = client_gone
        self.background = background
        self.priority = priority
        self.trace = trace

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def settle(self, answer: Answer) -> None:
        """Answer with what :func:`answer_batch` made for this job."""
        if type(answer) is bytes:
            future = self.future
            if not future.done():
                future.set_result(answer)
        else:
            self.fail(errors.from_name(*answer))


class Tally:
    """The jobs queued in many queues together (the server's, for its metrics), kept as they
    come and go, so that reading it costs nothing however many queues there are; ``background``
    of them are background jobs. ``arrived`` counts the real-time jobs ever queued."""

    __slots__ = ("arrived", "background", "jobs")

    def __init__(self) -> None:
        self.jobs = 0
        self.background = 0
        self.arrived = 0


class JobQueue:
    """A bounded FIFO of jobs. ``put`` never blocks: a full queue raises
    :class:`errors.QueueFull` at once, unless it holds a real-time job of a lower priority than
    the new one's: the newest of the lowest priority is then answered 503 and the new job takes
    its place (low goes first, high last). Its pool takes batches from it (:meth:`take`). Its
    jobs count in ``tally`` too.

    ``jobs`` (oldest first) and ``closed`` are there to be read, not changed: the methods change
    them. (Plain attributes: ``len(queue.jobs)`` is a quarter of ``len(queue)``'s time, 12
    against 46 ns, and a pool asks it several times a request.)"""

    __slots__ = ("_refusal", "background", "closed", "jobs", "maxsize", "ranked", "tally")

    def __init__(self, maxsize: int, tally: Tally | None = None) -> None:
        self.maxsize = maxsize
        self.tally = tally if tally is not None else Tally()
        #: The queued jobs, oldest first.
        self.jobs: collections.deque[Job] = collections.deque()
        #: The background jobs among those queued.
        self.background = 0
        #: The queued jobs of a priority other than normal.
        self.ranked = 0
        #: Whether it refuses new jobs (:meth:`close`).
        self.closed = False
        self._refusal: Callable[[], errors.MMServerError] = _unloading

    def __len__(self) -> int:
        return len(self.jobs)

    def put(self, job: Job) -> None:
        if self.closed:
            raise self._refusal()
        if len(self.jobs) >= self.maxsize and not self._shed_for(job):
            raise errors.QueueFull(
                f"the model's queue is full ({self.maxsize} jobs waiting); retry later"
            )
        self.jobs.append(job)
        if job.priority != NORMAL:
            self.ranked += 1
        tally = self.tally
        tally.jobs += 1
        if job.background:
            self._count_background(1)
        else:
            tally.arrived += 1

    def _shed_for(self, job: Job) -> bool:
        """Answer 503 the newest queued real-time job of the lowest priority below ``job``'s,
        to make its place (whether there was one)."""
        if job.priority == LOW or (job.priority == NORMAL and not self.ranked):
            return False
        shed: Job | None = None
        for queued in reversed(self.jobs):
            if (
                not queued.background
                and queued.priority < job.priority
                and (shed is None or queued.priority < shed.priority)
            ):
                shed = queued
                if shed.priority == LOW:
                    break
        if shed is None:
            return False
        self.jobs.remove(shed)
        self._gone([shed])
        shed.fail(
            errors.QueueFull(
                f"the model's queue is full ({self.maxsize} jobs waiting) and a request of a "
                "higher priority took this one's place; retry later"
            )
        )
        return True

    def _gone(self, jobs: list[Job]) -> None:
        """Count ``jobs``, taken out, as no longer queued."""
        self.tally.jobs -= len(jobs)
        if self.background:
            self._uncount(jobs)
        if self.ranked:
            self.ranked -= sum(1 for job in jobs if job.priority != NORMAL)

    def _count_background(self, change: int) -> None:
        self.background += change
        self.tally.background += change

    def _uncount(self, jobs: Iterable[Job]) -> None:
        """Count background jobs among ``jobs``, taken out, as gone. Called only while any is
        queued (``if self.background``, at the call): the real-time path makes no call."""
        gone = sum(1 for job in jobs if job.background)
        if gone:
            self._count_background(-gone)

    def take(self, count: int, max_bytes: int = 0) -> list[Job]:
        """Up to ``count`` jobs from the front of the queue (at least one if any is queued),
        holding at most ``max_bytes`` of request bodies (0: no limit) unless the first alone
        holds more: it is then a batch of its own (:func:`batch_length`)."""
        items = self.jobs
        length = batch_length((len(job.request[0]) for job in items), count, max_bytes)
        taken = [items.popleft() for _ in range(length)]
        self._gone(taken)
        return taken

    def close(self, refusal: Callable[[], errors.MMServerError] | None = None) -> None:
        """Refuse new jobs with the error ``refusal`` makes (by default, the model is
        unloading); queued jobs can still be taken."""
        self.closed = True
        self._refusal = refusal or _unloading

    def reopen(self) -> None:
        """Take new jobs again."""
        self.closed = False

    def drain(self) -> list[Job]:
        """Take every queued job out (to answer them with an error)."""
        items = list(self.jobs)
        self.jobs.clear()
        self._gone(items)
        return items

    def expire(self, now: float) -> tuple[list[Job], float | None]:
        """Take out the jobs whose deadline has passed at ``now`` (to answer them 504), and
        the earliest deadline of those left (``None`` when none is left)."""
        items = self.jobs
        expired = [job for job in items if job.deadline <= now]
        if expired:
            kept = [job for job in items if job.deadline > now]
            items.clear()
            items.extend(kept)
            self._gone(expired)
        return expired, min((job.deadline for job in items), default=None)

    def oldest_enqueued_at(self) -> float | None:
        return self.jobs[0].enqueued_at if self.jobs else None


class Cut(NamedTuple):
    """What a pool does with its queue now (:func:`cut_batch`): give a worker a batch of up to
    ``take`` jobs, or, when ``take`` is 0, wait until ``wait_until`` for more jobs to come
    (``None``: nothing is queued, nothing to wait for)."""

    take: int
    wait_until: float | None = None


#: Nothing queued: no batch, and no time to wait for.
NOTHING_QUEUED = Cut(0)


def cut_batch(
    queued: int,
    oldest_enqueued_at: float | None,
    now: float,
    batch_size: int,
    max_delay_s: float,
) -> Cut:
    """Whether a batch goes now, from a snapshot of a queue holding ``queued`` jobs, the oldest
    queued at ``oldest_enqueued_at``, at ``now`` (the same clock). A full batch (``batch_size``
    jobs) goes at once; fewer wait for more until ``max_delay_s`` has passed since the oldest
    came (the wait ends at that instant), then go as they are. With ``max_delay_s`` 0 whatever
    is queued goes at once. The jobs the batch then holds are counted when it is taken
    (:func:`batch_length`)."""
    if not queued:
        return NOTHING_QUEUED
    if max_delay_s > 0 and queued < batch_size:
        due = (oldest_enqueued_at or 0.0) + max_delay_s
        if due > now:
            return Cut(0, due)
    # Made by tuple's own __new__: the named tuple's is a Python call (once a batch).
    return _new_tuple(Cut, (queued if queued < batch_size else batch_size, None))


_new_tuple = tuple.__new__


def batch_length(sizes: Iterable[int], batch_size: int, max_bytes: int) -> int:
    """How many jobs from the front of a queue make its next batch, given the sizes of their
    request bodies in queue order: up to ``batch_size`` (at least one when any is queued),
    holding at most ``max_bytes`` (0: no limit) unless the first alone holds more: it is then a
    batch of its own. A job that would pass the limit ends the batch, even if a later, smaller
    one would fit. ``sizes`` is read only as far as the batch goes."""
    limit = max(1, batch_size)
    length = total = 0
    for size in sizes:
        if length and max_bytes and total + size > max_bytes:
            break
        total += size
        length += 1
        if length >= limit:
            break
    return length


def _unloading() -> errors.MMServerError:
    return errors.ShuttingDown("the model is unloading; retry the request")


def waited_too_long() -> errors.PredictTimeout:
    """The answer of a job whose deadline passed before it was computed."""
    return errors.PredictTimeout(
        "the request waited longer than option.predict_timeout and was not computed"
    )


def partition_live(batch: Sequence[Job], now: float) -> list[Job]:
    """Answer the jobs that must not be computed (deadline passed, client gone, already
    answered) and return the rest, in order."""
    live: list[Job] = []
    for job in batch:
        if job.future.done():
            continue
        if job.deadline <= now:
            job.fail(waited_too_long())
        elif job.client_gone is not None and job.client_gone():
            job.fail(errors.ClientGone("the client closed the connection before computing"))
        else:
            live.append(job)
    return live
