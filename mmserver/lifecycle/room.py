"""Room: the loaded models, least recently used first, and the memory they may take.

The room owns the loaded models' pools in their LRU order, which of them are pinned (never
evicted: ``pinned_models`` patterns and management pins; their memory is counted first), the
counts kept as they change (how many are loaded, the memory counted for them, the models in each
lane, the jobs queued), the memory budget, the room reserved by loads under way, and the memory
watch. It makes room for a load by unloading least recently used idle models that are not pinned
(the choice is :func:`~mmserver.policy.eviction.choose_victims`, a pure function: a new eviction
policy goes there), and unloads a model
(READY → UNLOADING → UNLOADED). It hears of each pool's changes through
:class:`~mmserver.serving.pool.PoolEvents`, which it implements.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
from collections.abc import Iterable, Iterator

from mmserver import errors
from mmserver.backend.placement import BackendPool
from mmserver.backend.wire import LoadInfo
from mmserver.config.server import ServerConfig
from mmserver.config.trust import matching
from mmserver.lifecycle.catalog import Catalog
from mmserver.lifecycle.record import ModelRecord, ModelStatus
from mmserver.ops import capacity
from mmserver.ops.capacity import Limit
from mmserver.ops.metrics import Metrics
from mmserver.policy.eviction import Candidate, choose_victims
from mmserver.serving.jobs import HIGH, LOW, NORMAL, Tally
from mmserver.serving.pool import ModelPool

log = logging.getLogger(__name__)

#: Seconds between two readings of the backend processes' resident memory (a read of
#: ``/proc/PID/statm`` each, ~10 µs), and after a load ends: how long what a model's predictions
#: keep, or a leak, may stay over the budget before models are evicted or a process replaced.
MEMORY_WATCH_S = 1.0
#: The least time between two looks of the memory watch.
MEMORY_CHECK_GAP_S = 0.01


class Room:
    """The loaded models and their memory budget. Implements
    :class:`~mmserver.serving.pool.PoolEvents`.
    Only the event loop changes it."""

    def __init__(
        self,
        config: ServerConfig,
        catalog: Catalog,
        backend: BackendPool,
        metrics: Metrics,
        *,
        wait_seconds: float,
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.backend = backend
        self.metrics = metrics
        #: How long a load waits for a busy model to go idle before it gives up (NoCapacity).
        self.wait_seconds = wait_seconds
        #: The memory budget of loaded models (MiB) and where it came from; measured again
        #: once the backend processes run (:meth:`measure_budget`).
        self.budget = config.memory_budget(capacity.rss_bytes([os.getpid()]))
        self.budget_bytes = self.budget.value * 2**20
        #: The loaded (READY) models' pools, least recently used first.
        self.loaded: collections.OrderedDict[str, ModelPool] = collections.OrderedDict()
        #: The sum of their pools' accounted_bytes.
        self._loaded_bytes = 0
        #: Loads and unloads so far: a change of the set of loaded models changes it.
        self.changes = 0
        #: The loaded models that are never evicted (:meth:`pins`).
        self.pinned: set[str] = set()
        #: The loaded models whose last request came with a priority other than normal (its
        #: tenant's), and that priority: under memory pressure low ones go first, high last.
        self.ranks: dict[str, int] = {}
        self._pins = config.pinned
        #: The jobs queued for every model, and the loaded models in each lane (the metrics'
        #: server-wide gauges, kept as they change).
        self.queued = Tally()
        self.lanes: collections.Counter[str] = collections.Counter()
        #: Room reserved by loads under way (bytes, and how many loads).
        self._reserved_bytes = 0
        self._reserved_count = 0
        #: Set when room may have been made: a load ended or a loaded model went idle.
        self._changed = asyncio.Event()
        #: Set when a load ended: the memory watch reads the backends' memory then.
        self._loaded_one = asyncio.Event()
        #: The memory watch's next tick (:meth:`watch_memory`).
        self._ticker: asyncio.TimerHandle | None = None
        #: Set by :meth:`close`: loads stop waiting for room.
        self._closed = False

    def measure_budget(self, extra_processes: int) -> None:
        """Measure the budget again with the backend processes running: what the server holds
        before any model is the frontend and its backend processes, and as much again as a
        backend for each process started on first use (the heavy lane's, and
        ``extra_processes`` more)."""
        if self.config.max_memory_mb:
            return
        started = self.backend.pids()
        own = capacity.rss_bytes([os.getpid(), *started])
        later = len(self.backend.slots) - len(started) + extra_processes
        if started and later:
            own += later * max(capacity.rss_bytes([pid]) for pid in started)
        self.set_budget(self.config.memory_budget(own))

    def set_budget(self, budget: Limit) -> None:
        self.budget = budget
        self.budget_bytes = budget.value * 2**20

    def close(self) -> None:
        """Loads waiting for room give up the next time they look (the server is shutting
        down: it cancels them)."""
        self._closed = True
        self._changed.set()

    # The loaded models ------------------------------------------------------------------------

    def admit(self, pool: ModelPool) -> None:
        """A model is loaded (READY): count it, the most recently used."""
        self.loaded[pool.name] = pool
        self.loaded.move_to_end(pool.name)
        self.changes += 1
        if self.pins(pool.name):
            self.pinned.add(pool.name)
        self.lanes[pool.lane] += 1
        self._loaded_bytes += pool.accounted_bytes
        self.metrics.models_loaded.set(len(self.loaded))

    def pins(self, name: str) -> bool:
        """Whether model ``name`` is pinned: by a ``pinned_models`` pattern, or by a management
        call (its record says so)."""
        if matching(self._pins, name) is not None:
            return True
        record = self.catalog.get(name)
        return record is not None and record.pinned

    def unpin(self, name: str) -> None:
        """Take back a management call's pin of model ``name`` (a pattern's stays)."""
        record = self.catalog.get(name)
        if record is not None:
            record.pinned = False
            self.catalog.drop_if_unkept(record)
        if not self.pins(name):
            self.pinned.discard(name)

    def pinned_bytes(self) -> int:
        """The memory counted for the pinned models."""
        return sum(self.loaded[name].accounted_bytes for name in self.pinned)

    def pin(self, name: str) -> None:
        """Pin loaded model ``name`` (its record says so already), or raise
        :class:`errors.InsufficientMemory` when the pinned models would pass
        ``max_loaded_models`` or the memory budget."""
        pool = self.loaded[name]
        total = self.pinned_bytes() + (0 if name in self.pinned else pool.accounted_bytes)
        why = self.too_many_pins(name)
        if why is None and total > self.budget_bytes:
            why = (
                f"the pinned models would take {total / 2**20:.0f} MiB, over the memory budget "
                f"of {self.budget_bytes / 2**20:.0f} MiB"
            )
        if why is not None:
            raise errors.InsufficientMemory(f"model {name} cannot be pinned: {why}")
        self.pinned.add(name)

    def too_many_pins(self, name: str) -> str | None:
        """Why model ``name`` cannot be pinned with the models pinned now, counting them (or
        ``None``)."""
        pins = len(self.pinned | {name})
        limit = self.config.max_loaded_models
        if limit and pins > limit:
            return f"{pins} pinned models would pass max_loaded_models={limit}"
        return None

    def used_bytes(self) -> int:
        """The memory counted for the loaded models: the sum of their ``accounted_bytes``,
        kept as they change (O(1) a load, however many models are loaded)."""
        return self._loaded_bytes

    def unaccounted(self) -> int:
        """What the backend processes hold beyond their start and their models' measured
        loads (:meth:`~mmserver.backend.ProcessSlot.unaccounted_bytes`): counted against the
        budget with the models."""
        return sum(slot.unaccounted_bytes() for slot in self.backend.slots)

    def forget_all(self) -> None:
        """The server has stopped every pool (:meth:`WorkLoadManager.stop`)."""
        self.loaded.clear()
        self.pinned.clear()
        self.ranks.clear()
        self._loaded_bytes = 0
        self.lanes.clear()

    # PoolEvents -------------------------------------------------------------------------------

    def pool_loaded(self, pool: ModelPool, info: LoadInfo) -> None:
        record = self.catalog.get(pool.name)
        if record is not None:
            self.catalog.loaded(record, pool, info.signature, info.warnings)

    def pool_idle(self, pool: ModelPool) -> None:
        self._changed.set()

    def pool_memory_changed(self, pool: ModelPool, change: int) -> None:
        if self.loaded.get(pool.name) is pool:
            self._loaded_bytes += change

    def pool_moved(self, pool: ModelPool, old_lane: str) -> None:
        if self.loaded.get(pool.name) is pool:
            self.lanes[old_lane] -= 1
            self.lanes[pool.lane] += 1

    # Making room ------------------------------------------------------------------------------

    async def reserve(self, name: str, need: int) -> None:
        """Unload least recently used idle models until ``need`` more bytes and one more model
        fit, and reserve that room until :meth:`release`. While every loaded model is busy,
        wait (up to ``wait_seconds``) for one to go idle or for another load to end; then give
        up with :class:`errors.NoCapacity`."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.wait_seconds
        while True:
            victims = choose_victims(
                self._candidates(),
                loaded=len(self.loaded) + self._reserved_count,
                used_bytes=self.used_bytes() + self._reserved_bytes + self.unaccounted(),
                need_bytes=need,
                max_models=self.config.max_loaded_models,
                budget_bytes=self.budget_bytes,
            )
            remaining = give_up_at - loop.time()
            if victims is not None or remaining <= 0 or self._closed:
                break
            self._changed.clear()
            try:
                # wait_for's extra task matters: a load that has just ended wakes the requests
                # waiting for it before this loop looks again, so its model is busy by then
                # and not taken as a victim straight away. A stop that its return swallows
                # ends the loop anyway (the room is closed first).
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        if victims is None:
            pinned = f" or pinned ({len(self.pinned)} pinned)" if self.pinned else ""
            raise errors.NoCapacity(
                f"no room to load model {name}: {len(self.loaded)} model(s) loaded, all busy"
                f"{pinned} "
                f"(max_loaded_models={self.config.max_loaded_models or 'unlimited'}, "
                f"memory budget {self.budget_bytes // 2**20} MiB)"
            )
        # Reserved before any await, so concurrent loads cannot claim the same room.
        self._reserved_bytes += need
        self._reserved_count += 1
        for victim in victims:
            await self.unload(victim, reason=f"evicted (least recently used) to load {name}")
            self.metrics.model_evictions.inc()

    def _candidates(self) -> Iterable[Candidate]:
        """The loaded models as eviction sees them, in the order it takes them: least recently
        used first; with models of ranked tenants loaded, those last called with a low priority
        before the others, and those called with a high one after them."""
        pinned, loaded, ranks = self.pinned, self.loaded, self.ranks

        def of(level: int | None) -> Iterator[Candidate]:
            for name, pool in loaded.items():
                if level is None or ranks.get(name, NORMAL) == level:
                    yield Candidate(name, pool.memory_bytes, pool.busy, name in pinned)

        if not ranks:
            return of(None)
        return itertools.chain(of(LOW), of(NORMAL), of(HIGH))

    def fits(self, need: int) -> bool:
        """Whether one more model of ``need`` bytes fits now without unloading any, the loads
        under way counted (the warm set's restore evicts none,
        :mod:`mmserver.lifecycle.warmset`)."""
        victims = choose_victims(
            (),
            loaded=len(self.loaded) + self._reserved_count,
            used_bytes=self.used_bytes() + self._reserved_bytes + self.unaccounted(),
            need_bytes=need,
            max_models=self.config.max_loaded_models,
            budget_bytes=self.budget_bytes,
        )
        return victims == []

    def release(self, need: int) -> None:
        """A load that reserved ``need`` bytes has ended (loaded or not)."""
        self._reserved_bytes -= need
        self._reserved_count -= 1
        self._changed.set()
        self._loaded_one.set()

    async def watch_memory(self) -> None:
        """Every :data:`MEMORY_WATCH_S`, and after each load, keep the backends' memory in the
        budget (:meth:`keep_in_budget`). One timer ticks the seconds: a timeout around each wait
        would be made and unmade after every load."""
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self._loaded_one.set()
            self._ticker = loop.call_later(MEMORY_WATCH_S, tick)

        self._ticker = loop.call_later(MEMORY_WATCH_S, tick)
        try:
            while True:
                await self._loaded_one.wait()
                self._loaded_one.clear()
                try:
                    await self.keep_in_budget()
                except Exception:
                    log.exception("the memory watch failed; it goes on")
                # The loads that end meanwhile are looked at together: each load reserved its
                # room first (reserve), and in a stream of cold loads a look after every one
                # cost more than the loads' own bookkeeping.
                await asyncio.sleep(MEMORY_CHECK_GAP_S)
        finally:
            self._ticker.cancel()

    async def keep_in_budget(self) -> None:
        """Replace each backend process that holds more than its share of the budget
        (the budget over the processes running) beyond what its models' loads measured, once
        it is idle; then, while the loaded models and what the processes hold beyond them pass
        the budget, unload the least recently used idle model (an unload gives its pages back,
        and with them what its predictions kept)."""
        budget = self.budget_bytes
        slots = self.backend.slots
        # A share is at least the budget over every slot: the processes running are counted
        # (a system call each) only when a process holds more than that.
        least_share = budget // max(1, len(slots))
        share: int | None = None
        extras = [slot.unaccounted_bytes() for slot in slots]
        unaccounted = sum(extras)
        for slot, extra in zip(slots, extras, strict=True):
            if extra <= least_share:
                continue
            if share is None:
                share = budget // max(1, len(self.backend.pids()))
            if extra > share:
                slot.recycle(
                    f"it held {extra / 2**20:.0f} MiB beyond its models' measured loads, more "
                    f"than its share of the memory budget ({share / 2**20:.0f} MiB)"
                )
                unaccounted = self.unaccounted()  # a process replaced holds nothing beyond
        for _ in range(len(self.loaded)):
            used = self.used_bytes() + self._reserved_bytes + unaccounted
            if used <= budget:
                return
            victim = next((c.name for c in self._candidates() if not c.busy and not c.pinned), None)
            if victim is None:
                return
            await self.unload(
                victim,
                reason=f"evicted (least recently used): the models and the backend processes held "
                f"{used / 2**20:.0f} MiB ({unaccounted / 2**20:.0f} MiB of it beyond the models' "
                f"measured loads), over the memory budget of {budget / 2**20:.0f} MiB",
            )
            self.metrics.model_evictions.inc()
            unaccounted = self.unaccounted()

    # Unloading --------------------------------------------------------------------------------

    async def unload(self, name: str, reason: str, drain_timeout: float | None = None) -> None:
        """READY → UNLOADING → UNLOADED: the pool leaves the loaded models at once, then stops
        (answering what it has queued, up to ``drain_timeout``); logged with ``reason``."""
        record = self.catalog.get(name)
        if record is None or record.pool is None:
            return
        pool, record.pool = record.pool, None
        record.become(ModelStatus.UNLOADING)
        del self.loaded[name]
        self.changes += 1
        self.pinned.discard(name)
        self.ranks.pop(name, None)
        self.lanes[pool.lane] -= 1
        self._loaded_bytes -= pool.accounted_bytes
        self.metrics.models_loaded.set(len(self.loaded))
        task = asyncio.get_running_loop().create_task(
            self._stop_pool(record, pool, reason, drain_timeout), name=f"mmserver-unload-{name}"
        )
        record.unload = task
        await asyncio.shield(task)

    async def _stop_pool(
        self, record: ModelRecord, pool: ModelPool, reason: str, drain_timeout: float | None
    ) -> None:
        try:
            await pool.stop(drain_timeout)
        finally:
            record.unload = None
            record.become(ModelStatus.UNLOADED)
            self.catalog.unloaded(record, pool)
        log.info(
            "model %s unloaded: %s (%d loaded)",
            record.name,
            reason,
            len(self.loaded),
            extra={"model": record.name},
        )

    # Metrics ----------------------------------------------------------------------------------

    def refresh_metrics(self) -> None:
        """Set the gauges from the current state (called before a scrape; free on the hot
        path)."""
        m = self.metrics
        if m.workers.labelled:
            for name, pool in self.loaded.items():
                m.queue_length.labels(name).set(len(pool.queue))
                m.workers.labels(name).set(len(pool.workers))
                m.model_lane.labels(name, pool.lane).set(1)
        else:
            # Kept as they change: a scrape does not walk the loaded models on the event loop.
            m.queue_length.set(self.queued.jobs)
            m.workers.set(sum(slot.bound_workers for slot in self.backend.slots))
            for lane in self.backend.lanes:
                m.model_lane.labels("", lane).set(self.lanes[lane])
        m.models_loaded.set(len(self.loaded))
        m.model_memory_bytes.set(self.used_bytes())
        m.backend_unaccounted_bytes.set(self.unaccounted())
        m.memory_budget_bytes.set(self.budget_bytes)
