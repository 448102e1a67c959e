"""Submission: a request queued for its model, every protocol's one way in.

A request to a loaded model is queued at once, with no coroutine of its own: the loaded pools
are looked up by name (:attr:`Room.loaded <mmserver.lifecycle.room.Room.loaded>`), the model is
marked most recently used, and the pool queues the job. A request to a model with versions whose
rollout is known goes the same way to the loaded version it routes to
(:meth:`Versions.route <mmserver.lifecycle.versions.Versions.route>`). Any other request waits in a
task of its own for the version it goes to (:meth:`Versions.resolve
<mmserver.lifecycle.versions.Versions.resolve>`) and the model's load (:meth:`Loader.get_pool
<mmserver.lifecycle.loading.Loader.get_pool>`), then is queued. A per-model admission rule (a rate
limit, say) goes in :meth:`Submitter.submit`, before the pool's queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mmserver import errors
from mmserver.codecs.requests import Request
from mmserver.lifecycle.loading import Loader
from mmserver.lifecycle.room import Room
from mmserver.lifecycle.shadow import Shadows
from mmserver.lifecycle.versions import Versions
from mmserver.ops.metrics import ModelRequests
from mmserver.ops.traces import Trace
from mmserver.serving.jobs import NORMAL
from mmserver.serving.pool import ModelPool
from mmserver.store.names import normalize_target


class Submission:
    """What :meth:`Submitter.submit` gives back: the future of the answer's body, and the
    model's series to count the answer in, known once the request has reached a loaded model
    (at once for a loaded one)."""

    __slots__ = ("answer", "pool", "requests")

    answer: asyncio.Future[bytes]
    requests: ModelRequests | None
    #: The loaded model (or version) the request went to, once known.
    pool: ModelPool | None

    def __init__(self, answer: asyncio.Future[bytes], pool: ModelPool | None) -> None:
        self.answer = answer
        self.pool = pool
        self.requests = pool.requests if pool is not None else None


class Submitter:
    """Queues requests for their models, loading a model first if needed."""

    def __init__(self, room: Room, loader: Loader, versions: Versions) -> None:
        self._loaded = room.loaded
        # Bound once: the pools' table is an OrderedDict, whose methods the interpreter does
        # not specialize where they are looked up (two a request).
        self._loaded_get = room.loaded.get
        self._touch = room.loaded.move_to_end
        self._ranks = room.ranks
        self._loader = loader
        self._versions = versions
        #: Where requests routed to a model's versions also run on its shadow (set by the
        #: WorkLoadManager, which owns it).
        self.shadows: Shadows | None = None

    def submit(
        self,
        name: str,
        request: Request,
        client_gone: Callable[[], bool] | None,
        deadline: float | None,
        background: bool = False,
        routing: str | None = None,
        priority: int = NORMAL,
        trace: Trace | None = None,
    ) -> Submission:
        """Queue ``request`` for model ``name`` (any spelling). A loaded model named exactly
        ``name`` gets it queued at once; otherwise a task finds (or loads) the model, then
        queues it. Every error is the submission's future's. A ``background`` request (an
        asynchronous one) does not count toward the model's real-time scale-up. ``priority``:
        its tenant's (:data:`~mmserver.serving.jobs.PRIORITY`), who is shed first from a full
        queue, and whose models are evicted first (the room's ``ranks``). A sampled request's
        ``trace`` records its cold load, if it waits for one, and its job's way."""
        pool = self._loaded_get(name)
        shadow = None
        if pool is None:
            routed = self._versions.route(name, routing)
            if routed is not None:
                shadow = self._versions.shadow_of(name, routing)
                model, name = name, routed
                pool = self._loaded_get(name)
        if pool is not None:
            self._touch(name)
            if priority != NORMAL:
                self._ranks[name] = priority
            elif self._ranks:
                self._ranks.pop(name, None)
            try:
                answer = pool.submit(
                    request, deadline, client_gone, None, background, priority, trace
                )
            except errors.MMServerError as exc:  # the model's queue is full
                answer = asyncio.get_running_loop().create_future()
                answer.set_exception(exc)
            if shadow is not None and self.shadows is not None:
                self.shadows.offer(model, name, shadow, request, answer)
            return Submission(answer, pool)
        submission = Submission.__new__(Submission)
        submission.requests = None
        submission.pool = None
        submission.answer = asyncio.get_running_loop().create_task(
            self._after_load(
                name,
                request,
                deadline,
                client_gone,
                submission,
                background,
                routing,
                priority,
                trace,
            )
        )
        return submission

    async def _after_load(
        self,
        name: str,
        request: Request,
        deadline: float | None,
        client_gone: Callable[[], bool] | None,
        submission: Submission,
        background: bool,
        routing: str | None,
        priority: int,
        trace: Trace | None,
    ) -> bytes:
        arrived = asyncio.get_running_loop().time()  # the load it waits for counts
        versions = self._versions
        target = await versions.resolve(name, routing)
        if trace is not None and normalize_target(target) not in self._loaded:
            began = time.perf_counter()
            pool = await self._loader.get_pool(target)
            trace.load = (began, time.perf_counter())
        else:
            pool = await self._loader.get_pool(target)
        submission.pool = pool
        if self.shadows is not None and not background and versions.rollouts:
            model = normalize_target(name)
            shadow = versions.shadow_of(model, routing)
            if shadow is not None:
                self.shadows.offer(model, pool.name, shadow, request, submission.answer)
        submission.requests = pool.requests
        if priority != NORMAL:
            self._ranks[pool.name] = priority
        return await pool.submit(
            request, deadline, client_gone, arrived, background, priority, trace
        )
