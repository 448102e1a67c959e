"""Worker scaling: DJL's rule as pure functions over a snapshot of one model's state.

After every enqueue a model gets one more worker when it has none, or when it has fewer than
``maxWorkers`` and its queue holds more than ``2 * batch_size`` real-time jobs. Background jobs
(asynchronous requests) do not count toward that rule: they have their own,
:func:`should_add_background_worker`, within ``option.async_max_workers``. A worker above
``minWorkers`` that has had no batch for ``max_idle_time`` seconds retires. The callers apply one
decision at a time on the event loop, so two concurrent requests can never overshoot
``maxWorkers``: the worker being added is counted before the next check runs.
"""

from __future__ import annotations

from typing import NamedTuple


class PoolSnapshot(NamedTuple):
    """What the scaling rule looks at: one model's workers, queue and limits. A tuple: one is
    made after every enqueue, and a tuple costs a fraction of a frozen dataclass to make. The
    rules unpack it: a named tuple's field read by name is a descriptor call the interpreter
    does not specialize (CPython 3.11), ~40 ns each, and the rules run twice a request."""

    workers: int
    #: Real-time jobs queued (background jobs not counted).
    queue_length: int
    min_workers: int
    max_workers: int
    batch_size: int


def should_add_worker(s: PoolSnapshot) -> bool:
    """DJL's rule, checked after every enqueue."""
    workers, queue_length, _, max_workers, batch_size = s
    if workers >= max_workers:
        return False
    return workers == 0 or queue_length > 2 * batch_size


def should_add_background_worker(
    workers: int, background_queued: int, async_max_workers: int, max_workers: int
) -> bool:
    """Whether a model's background jobs (asynchronous requests) get it one more worker: one
    per queued background job, within ``async_max_workers`` and ``maxWorkers``."""
    return workers < min(async_max_workers, max_workers) and background_queued > workers


def should_retire(s: PoolSnapshot, idle_seconds: float, max_idle_time: float) -> bool:
    """Whether a worker idle for ``idle_seconds`` retires now."""
    workers, _, min_workers, max_workers, _ = s
    if workers > max_workers:
        return True  # rescaled down: the excess goes as soon as it is idle
    return workers > min_workers and idle_seconds >= max_idle_time


def workers_to_start(s: PoolSnapshot) -> int:
    """Workers to add at once so a model reaches its ``minWorkers`` (at load or on rescale)."""
    return max(0, s.min_workers - s.workers)


def background_share(backend_processes: int) -> int:
    """The most background requests (asynchronous requests, shadow runs) submitted to their
    models at once: all the backend processes but one, so that one is always left to real-time
    requests (one in-process backend: one)."""
    return max(1, backend_processes - 1)
