"""The catalog: every model the server knows of, one :class:`~mmserver.lifecycle.record.ModelRecord`
each, and what it knows of models it does not hold now.

It owns the records (made on a model's first mention, dropped once nothing of them must outlive
the model's unload, :attr:`~mmserver.lifecycle.record.ModelRecord.kept`), the registrations of
``POST /models``, the remembered failures (bounded, oldest forgotten first), what loads measured
of each model (bounded, least recently loaded forgotten first), and the store's names for
listing (:class:`~mmserver.store.index.StoreIndex`). It answers lookups in the store, listings and
describe; it loads nothing (:mod:`mmserver.lifecycle.loading`) and counts no memory
(:mod:`mmserver.lifecycle.room`).

What it returns is data (:class:`ModelView`, :class:`ModelListing`); the API renders it in each
protocol's shapes.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from cachetools import LRUCache

from mmserver import errors
from mmserver.config.server import RESCALABLE, ModelConfig, ServerConfig
from mmserver.config.trust import matching
from mmserver.execution.families import wanted_files
from mmserver.lifecycle.record import Failure, ModelRecord, ModelStatus
from mmserver.ops.metrics import Metrics
from mmserver.policy.scheduling import Cost
from mmserver.serving.pool import Measured, ModelPool
from mmserver.store.index import StoreIndex, suffix_of
from mmserver.store.local import tree_size
from mmserver.store.names import normalize_name, normalize_target, split_version
from mmserver.store.source import ModelSource, StoreEntry

log = logging.getLogger(__name__)

#: Failed loads remembered at most (each answers its model's requests until its retry time).
MAX_FAILURES = 1000
#: Models whose measured size and cost are remembered after they unload, at most.
MAX_REMEMBERED = 10_000


@dataclass(frozen=True)
class WorkerView:
    """One worker of a loaded model, for describe."""

    id: int
    start_time: float
    status: str
    backend: int
    lane: str


@dataclass(frozen=True)
class ModelView:
    """What the server knows of one model, for describe (rendered by the API)."""

    name: str
    url: str
    status: ModelStatus
    config: ModelConfig
    startup: bool
    #: Never evicted (``pinned_models``, ``PUT /models/NAME?pinned=true``).
    pinned: bool = False
    queued: int = 0
    workers: tuple[WorkerView, ...] = ()
    #: Of a loaded model: its memory, lane, measured cost, and the predict paths its first load
    #: chose with the batches each took (``None`` for a custom handler).
    memory_bytes: int | None = None
    lane: str | None = None
    cost: Cost | None = None
    paths: dict[str, Any] | None = None
    path_batches: dict[str, int] | None = None
    error: str | None = None
    #: The named columns a loaded model takes (:mod:`mmserver.codecs.schema`); ``None`` for a model
    #: that takes rows of numbers.
    inputs: list[dict[str, Any]] | None = None
    #: What the model's files or configuration may have wrong: warnings its load raised, keys
    #: of its serving.properties that look mistyped.
    warnings: tuple[str, ...] = ()
    #: The format of the file it loaded from (``pickle``, ``skops``, a family's own; ``python``
    #: for a custom handler), once loaded.
    file_format: str | None = None
    #: The library versions that made the model and those serving it, when they differ.
    trained_with: dict[str, str] | None = None
    served_with: dict[str, str] | None = None
    #: The example input saved with the model (an MLflow folder's), as JSON.
    input_example: Any = None
    #: The model environment it runs in (its id, state, requirements, versions); ``None`` for
    #: the server's own.
    environment: dict[str, Any] | None = None


class ModelListing(NamedTuple):
    """One row of a listing: a model's name, url and status, and for a model loaded across a
    version gap (``on_version_skew=warn``) what made it and what serves it."""

    name: str
    url: str
    status: ModelStatus
    skew: str = ""


def skew_of(signature: dict[str, Any] | None) -> str:
    """``scikit-learn 1.3.2, served by 1.9.1`` for a model loaded across a version gap (from
    its load's signature); empty otherwise."""
    if not signature or not signature.get("trained_with"):
        return ""
    served = signature.get("served_with") or {}
    return "; ".join(
        f"made by {library} {version}, served by {served.get(library, 'another version')}"
        for library, version in signature["trained_with"].items()
    )


class Catalog:
    """The records of the models the server knows of, their registrations, failures and
    measurements, and the store's names. Only the event loop changes it."""

    def __init__(self, config: ServerConfig, store: ModelSource, metrics: Metrics) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        #: The per-model defaults every model's configuration starts from.
        self.defaults = config.model_defaults()
        #: Every model the server knows of now (see ModelRecord).
        self.records: dict[str, ModelRecord] = {}
        #: The models whose failure is remembered, the oldest failure first (MAX_FAILURES).
        self.failed: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: The registered models' names (their records hold the entries), so that a listing's
        #: pages merge them without a pass over every record.
        self._registered: set[str] = set()
        # What loads measured, remembered across unloads for the next load's estimate and lane;
        # bounded, least recently loaded forgotten.
        self._remembered: LRUCache[str, Measured] = LRUCache(MAX_REMEMBERED)
        #: The store's names, for listing (:mod:`mmserver.store.index`).
        self.index = StoreIndex(store, max_age_s=config.store_index_max_age)

    # Records ----------------------------------------------------------------------------------

    def get(self, name: str) -> ModelRecord | None:
        return self.records.get(name)

    def record(self, name: str) -> ModelRecord:
        """The record of ``name``, made if the server did not know the model yet."""
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = ModelRecord(name)
            measured = self._remembered.get(name)
            if measured is not None:
                record.measured = measured
        return record

    def drop_if_unkept(self, record: ModelRecord) -> None:
        if not record.kept and self.records.get(record.name) is record:
            del self.records[record.name]

    def loaded(
        self,
        record: ModelRecord,
        pool: ModelPool,
        signature: dict[str, Any] | None,
        raised: tuple[str, ...] = (),
    ) -> None:
        """The model's first copy is loaded: remember its size, keep what its load told (and
        log the warnings it raised, in one line)."""
        record.measured.copy_bytes = pool.copy_bytes
        self._remembered[record.name] = record.measured
        record.signature = signature
        record.warnings = raised
        if raised:
            log.warning(
                "model %s: %d warning(s) while it loaded: %s",
                record.name,
                len(raised),
                " | ".join(raised),
                extra={"model": record.name},
            )

    def unloaded(self, record: ModelRecord, pool: ModelPool) -> None:
        """The model's pool has stopped (UNLOADED): remember what its batches cost, and forget
        the rest of the load."""
        record.source = None
        record.signature = None
        record.warnings = ()
        if pool.cost.hold is not None:  # its lane, when it loads again
            record.measured.hold = pool.cost.single
            self._remembered[record.name] = record.measured
        self.release_series(record)
        self.drop_if_unkept(record)

    def release_series(self, record: ModelRecord) -> None:
        """Remove the metric series of the model unless it is loading or loaded, or its failure
        is still remembered (then its requests count under its name)."""
        if record.status in (ModelStatus.UNLOADED, ModelStatus.UNLOADING):
            self.metrics.forget_model(record.name)

    # Failures ---------------------------------------------------------------------------------

    def fail(self, record: ModelRecord, error: errors.MMServerError, at: float) -> None:
        """LOADING → FAILED: remember why (bounded: the oldest failure is forgotten first, with
        its series)."""
        record.load = None
        record.failure = Failure(error, at)
        record.become(ModelStatus.FAILED)
        failed = self.failed
        failed.pop(record.name, None)
        failed[record.name] = None
        while len(failed) > MAX_FAILURES:
            oldest, _ = failed.popitem(last=False)
            forgotten = self.records.get(oldest)
            if forgotten is not None:
                self.forget_failure(forgotten)

    def clear_failure(self, record: ModelRecord) -> bool:
        """Forget why the model's last load failed (FAILED → UNLOADED); whether it had."""
        if record.failure is None:
            return False
        record.failure = None
        self.failed.pop(record.name, None)
        if record.status is ModelStatus.FAILED:
            record.become(ModelStatus.UNLOADED)
        return True

    def forget_failure(self, record: ModelRecord) -> None:
        """:meth:`clear_failure`, and the model's series and record unless something else
        holds them."""
        if self.clear_failure(record):
            self.release_series(record)
            self.drop_if_unkept(record)

    # The store --------------------------------------------------------------------------------

    async def find(self, record: ModelRecord) -> StoreEntry:
        """The store entry of the model (a file-system or object-store lookup, in a thread), or
        :class:`errors.ModelNotFound`."""
        name = record.name
        return self.found(name, record.registered or await self.lookup(name))

    def found(self, name: str, entry: StoreEntry | None) -> StoreEntry:
        """``entry``, or :class:`errors.ModelNotFound` when the lookup found no model."""
        if entry is None:
            root = self.store.root
            base, version = split_version(name)
            if version is not None:
                raise errors.ModelNotFound(
                    f"model {base} has no version {version} in the model store ({root}); add "
                    f"{name}/ (or {name}.tar.gz) to the model's folder"
                )
            if isinstance(root, Path) and _is_hollow(root, name):
                raise errors.ModelNotFound(
                    f"model {name} has no model file: its folder in the model store holds no "
                    f"file. A model folder holds {wanted_files(None)}, or a model.py handler"
                )
            raise errors.ModelNotFound(
                f"model {name} is not in the model store ({root}) and is not "
                f"registered; add {name}.tar.gz (or a folder {name}/) to the store, or register "
                "it with POST /models"
            )
        return entry

    async def lookup(self, name: str) -> StoreEntry | None:
        """The store's entry of ``name`` now (in a thread); the answer goes into the index."""
        entry = await asyncio.to_thread(self.store.find, name)
        self.note(name, entry)
        return entry

    def note(self, name: str, entry: StoreEntry | None) -> None:
        """Tell the index what a lookup of ``name`` found (the index lists models, not their
        versions)."""
        if "/" not in name:
            self.index.note(name, None if entry is None else entry_suffix(entry))

    # Registration -----------------------------------------------------------------------------

    def register(
        self,
        name: str,
        entry: StoreEntry,
        url: str,
        overrides: dict[str, Any],
        trusted: bool = False,
    ) -> None:
        """Register ``entry`` as model ``name`` (given by ``url``), with its management
        overrides, its files fully trusted if ``trusted``; :class:`errors.ModelExists` while one
        is registered or loaded."""
        record = self.records.get(name)
        if record is not None and (
            record.registered is not None
            or record.status in (ModelStatus.READY, ModelStatus.LOADING)
        ):
            raise errors.ModelExists(f"model {name} is already registered; DELETE it first")
        self.check_overrides(overrides)
        record = self.record(name)
        record.registered = entry
        record.url = url
        self._registered.add(name)
        self.clear_failure(record)  # its series stay: the new load counts on in them
        record.trusted = trusted
        if overrides:
            record.overrides = dict(overrides)

    def forget(self, name: str) -> None:
        """Forget the model's registration, overrides, start-up naming and failure."""
        record = self.records.get(name)
        if record is None:
            return
        record.startup = False
        record.pinned = False
        record.registered = None
        self._registered.discard(name)
        record.overrides = None
        record.trusted = False
        record.url = None
        self.forget_failure(record)
        self.drop_if_unkept(record)

    def check_overrides(self, overrides: dict[str, Any]) -> None:
        """:class:`errors.InvalidInput` unless ``overrides`` are settings a management call may
        change, with values a model may take."""
        unknown = set(overrides) - set(RESCALABLE)
        if unknown:
            raise errors.InvalidInput(f"unknown setting(s): {', '.join(sorted(unknown))}")
        self.defaults.requested(**overrides)
        too_many = self.config.check_workers(
            overrides.get("min_workers", 0), overrides.get("max_workers", 0)
        )
        if too_many is not None:
            raise errors.InvalidInput(too_many)

    def configured(self, record: ModelRecord, config: ModelConfig | None) -> ModelConfig:
        """The model's configuration (``None``: the defaults) with its management overrides,
        checked against the server's worker limit."""
        config = self.trusted(record.name, record, config or self.defaults)
        overrides = record.overrides
        if overrides:
            config = config.replace(**overrides)
        too_many = self.config.check_workers(config.min_workers, config.max_workers)
        if too_many is not None:
            raise errors.ConfigError(
                f"model {record.name}: serving.properties: {too_many}", model=record.name
            )
        return config

    def trusted(self, name: str, record: ModelRecord | None, config: ModelConfig) -> ModelConfig:
        """``config`` with the trust the operator gave model ``name``: its registration with
        ``trusted=true``, or ``trusted_models`` by its name."""
        trust = config.trust
        if record is not None and record.trusted:
            trust = trust if trust.full else trust.granted("POST /models trusted=true")
        else:
            trust = trust.of(name)
        return config if trust is config.trust else config.replace(trust=trust)

    # Listing and describe ---------------------------------------------------------------------

    async def list_page(self, after: str | None, limit: int) -> tuple[list[ModelListing], bool]:
        """Up to ``limit`` models after the name ``after``, of the store and registered, sorted
        by name, and whether more follow. From the store index: O(log n + limit)."""
        stored, more = await self.index.page(after, limit)
        records = self.records
        if self._registered:
            names = sorted(self._registered)
            start = bisect.bisect_right(names, after) if after else 0
            extra = [(n, _registered_url(records[n])) for n in names[start : start + limit]]
            more = more or start + limit < len(names)
            merged = dict(stored)
            merged.update(extra)
            rows = sorted(merged.items())
            more = more or len(rows) > limit
            stored = rows[:limit]
        listing = []
        for name, url in stored:
            record = records.get(name)
            if record is None:
                listing.append(ModelListing(name, url, ModelStatus.UNLOADED))
            else:
                skew = skew_of(record.signature)
                listing.append(ModelListing(name, record.url or url, record.status, skew))
        return listing, more

    async def list_models(self) -> list[ModelListing]:
        """Every model of the store and every registered one, sorted by name."""
        models: list[ModelListing] = []
        after: str | None = None
        while True:
            page, more = await self.list_page(after, 10_000)
            models += page
            if not more or not page:
                return models
            after = page[-1].name

    async def describe(self, name: str) -> ModelView:
        """What the server knows of model ``name``: its configuration and status, and of a
        loaded model its workers, memory, cost and predict paths; the last load's error."""
        name = normalize_target(name)
        record = self.records.get(name)
        pool = record.pool if record is not None else None
        entry = record.registered if record is not None else None
        if pool is None and entry is None:
            entry = await self.lookup(name)
            if entry is None:
                raise errors.ModelNotFound(f"model {name} is not in the store nor registered")
            record = self.records.get(name)  # the lookup awaited: it may have changed
            pool = record.pool if record is not None else None
        overrides = (record.overrides if record is not None else None) or {}
        config = (
            pool.config
            if pool is not None
            else self.trusted(name, record, self.defaults.replace(**overrides))
        )
        source = entry.url if entry is not None else record.source if record is not None else None
        url = (record.url if record is not None else None) or str(source)
        failure = record.failure if record is not None else None
        signed = (record.signature if record is not None else None) or {}
        view = ModelView(
            name=name,
            url=url,
            status=record.status if record is not None else ModelStatus.UNLOADED,
            config=config,
            startup=record.startup if record is not None else False,
            pinned=(record is not None and record.pinned)
            or matching(self.config.pinned, name) is not None,
            error=failure.error.message if failure is not None else None,
            inputs=signed.get("inputs"),
            warnings=record.warnings if record is not None else (),
            file_format=signed.get("format"),
            trained_with=signed.get("trained_with"),
            served_with=signed.get("served_with"),
            input_example=signed.get("input_example"),
            environment=(
                record.environment.describe()
                if record is not None and record.environment is not None
                else None
            ),
        )
        if pool is None:
            return view
        return dataclasses.replace(
            view,
            queued=len(pool.queue),
            workers=tuple(
                WorkerView(w.id, w.start_time, w.state.value, w.slot.index, w.slot.lane.name)
                for w in pool.workers.values()
            ),
            memory_bytes=pool.memory_bytes,
            lane=pool.lane,
            cost=pool.cost,
            paths=pool.paths,
            path_batches=pool.path_batches(),
        )


def _registered_url(record: ModelRecord) -> str:
    """Where a registered model comes from, as its store entry says."""
    if record.registered is None:
        raise AssertionError(f"model {record.name} is listed as registered without an entry")
    return record.registered.url


def entry_suffix(entry: StoreEntry) -> str:
    """The suffix of a store entry's file name (``""`` for a folder, else the archive's)."""
    return suffix_of(entry.url.rsplit("/", 1)[-1], entry.name)


def _is_hollow(root: Path, name: str) -> bool:
    """Whether the store ``root`` has a folder for ``name`` that holds no file (the store does
    not take it for a model: it may be being copied in)."""
    try:
        folder = root / normalize_name(name)
        return folder.is_dir() and tree_size(folder)[1] == 0
    except (errors.InvalidModelName, OSError):
        return False
