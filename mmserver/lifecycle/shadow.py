"""Shadow runs: a request that named no version also runs on its model's shadow version, after
its own answer, and the two answers are compared.

The shadow run never delays nor fails the answer: it begins once the answer's future is done
(the door's own callbacks, which send the answer, were registered on it before or run first),
only for an answer that succeeded, and only in spare capacity: when no real-time request is
queued for any model and fewer than ``limit`` shadow runs are under way (all the backend
processes but one, as for asynchronous requests, :func:`~mmserver.policy.scaling.background_share`);
otherwise it is skipped (counted ``skipped``), never queued. Its job is a
*background* job of the shadow version, which does not count toward the version's real-time
scale-up. At most :data:`MAX_WAITING` requests wait for their answer with a shadow run to
follow; past them a run is skipped too.

The answers are compared by value (:func:`same_answers`): JSON numbers within
:data:`TOLERANCE` (relative or absolute), everything else exactly, the version an Open
Inference Protocol answer names left out. ``mmserver_shadow_comparisons_total{model,result}``
counts ``same``, ``different``, ``error`` (the shadow failed) and ``skipped``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from mmserver.codecs.explanations import content_type_of
from mmserver.codecs.requests import Request
from mmserver.ops.capture import Capture, Record
from mmserver.ops.metrics import Metrics

log = logging.getLogger(__name__)

#: Shadow runs waiting for a turn or running, at most.
MAX_WAITING = 256
#: Two numbers of the answers are the same when they differ by at most this much, relatively
#: or absolutely (float32 against float64 models, another library version's rounding).
TOLERANCE = 1e-6
#: Answers larger than this are compared in a thread, not on the event loop.
_INLINE_BYTES = 64 * 1024

#: Runs ``request`` on a version (its key) as a background job: the answer's body.
Submit = Callable[[str, Request], Awaitable[bytes]]


def same_answers(primary: bytes, shadow: bytes, tolerance: float = TOLERANCE) -> bool:
    """Whether two answers to one request say the same: as JSON, equal with numbers within
    ``tolerance`` and an Open Inference Protocol answer's ``model_version`` left out; otherwise
    byte for byte."""
    if primary == shadow:
        return True
    try:
        first, second = json.loads(primary), json.loads(shadow)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    if isinstance(first, dict) and isinstance(second, dict):
        first.pop("model_version", None)
        second.pop("model_version", None)
    return _close(first, second, tolerance)


def _close(first: Any, second: Any, tolerance: float) -> bool:
    if isinstance(first, bool) or isinstance(second, bool):
        return first is second
    if isinstance(first, (int, float)) and isinstance(second, (int, float)):
        return math.isclose(first, second, rel_tol=tolerance, abs_tol=tolerance)
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(
            _close(a, b, tolerance) for a, b in zip(first, second, strict=True)
        )
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(
            _close(first[k], second[k], tolerance) for k in first
        )
    return bool(first == second)


class Run(NamedTuple):
    """One shadow run: the model, the key of the version that answered and of its shadow, and
    the request."""

    model: str
    primary: str
    shadow: str
    request: Request


class Shadows:
    """The shadow runs of the server (see the module docstring); their owner: it keeps their
    tasks and cancels them on :meth:`stop`."""

    def __init__(
        self, submit: Submit, limit: int, real_time_queued: Callable[[], int], metrics: Metrics
    ) -> None:
        self._submit = submit
        #: Shadow runs under way at once, at most; and how many are.
        self.limit = limit
        self.running = 0
        self._real_time_queued = real_time_queued
        self._metrics = metrics
        #: Where a shadow answer that differs is captured with the primary's (``None``: no
        #: data capture).
        self.capture: Capture | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Runs offered whose request is not answered yet.
        self.pending = 0
        self._stopped = False

    def offer(
        self,
        model: str,
        primary: str,
        shadow: str,
        request: Request,
        answer: asyncio.Future[bytes],
    ) -> None:
        """Run ``request`` on version ``shadow`` of ``model`` once ``answer`` (of version
        ``primary``) is done, if it succeeded, and compare the answers."""
        if self._stopped or self.pending >= MAX_WAITING:
            self._count(model, "skipped")
            return
        self.pending += 1
        run = Run(model, primary, shadow, request)
        answer.add_done_callback(functools.partial(self._answered, run))

    def _answered(self, run: Run, answer: asyncio.Future[bytes]) -> None:
        self.pending -= 1
        if self._stopped or answer.cancelled() or answer.exception() is not None:
            return  # no answer to compare with: the request failed
        if self.running >= self.limit or self._real_time_queued():
            self._count(run.model, "skipped")  # no spare capacity now
            return
        self.running += 1
        task = asyncio.get_running_loop().create_task(
            self._run(run, answer.result()), name=f"mmserver-shadow-{run.shadow}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, run: Run, primary: bytes) -> None:
        model = run.model
        try:
            answer = await self._submit(run.shadow, run.request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("model %s: shadow version %s failed: %s", model, run.shadow, exc)
            self._count(model, "error")
            return
        finally:
            self.running -= 1
        if len(primary) + len(answer) > _INLINE_BYTES:
            same = await asyncio.to_thread(same_answers, primary, answer)
        else:
            same = same_answers(primary, answer)
        self._count(model, "same" if same else "different")
        capture = self.capture
        if not same and capture is not None:
            body, content_type, csv = run.request
            answer_type = "text/csv" if csv else "application/json"
            capture.offer(
                Record(
                    run.primary,
                    time.time(),
                    f"shadow-{uuid.uuid4()}",
                    body,
                    content_type_of(content_type) or "application/json",
                    primary,
                    answer_type,
                    answer,
                    run.shadow,
                )
            )

    def _count(self, model: str, result: str) -> None:
        self._metrics.shadow_comparisons.labels(model, result).inc()

    async def stop(self) -> None:
        """Take no more runs; cancel those under way and wait for them."""
        self._stopped = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
