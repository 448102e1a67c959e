"""One model as the WorkLoadManager knows it: its status, with the transitions it may take, and
everything that goes with the model while it is known (its pool, its load, its last failure,
its registration).

::

    UNLOADED ──► LOADING ──► READY ──► UNLOADING ──► UNLOADED
                   │  ▲
                   ▼  │ (a request after the retry delay)
                  FAILED ──► UNLOADED (forgotten)

LOADING also goes back to UNLOADED when the load ends for a reason that is not the model's
(no room, shutdown, cancelled). A record whose model is unloaded is dropped unless something
of it must outlive the load: a registration, management overrides, the remembered failure,
or its naming by ``load_models`` (:attr:`ModelRecord.kept`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserver import errors
from mmserver.envs.registry import Environment
from mmserver.serving.pool import Measured

if TYPE_CHECKING:
    from mmserver.serving.pool import ModelPool
    from mmserver.store.source import StoreEntry


class ModelStatus(enum.Enum):
    UNLOADED = "UNLOADED"
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    FAILED = "FAILED"


#: The transitions a model's status may take.
TRANSITIONS: dict[ModelStatus, frozenset[ModelStatus]] = {
    ModelStatus.UNLOADED: frozenset({ModelStatus.LOADING}),
    ModelStatus.LOADING: frozenset({ModelStatus.READY, ModelStatus.FAILED, ModelStatus.UNLOADED}),
    ModelStatus.READY: frozenset({ModelStatus.UNLOADING}),
    ModelStatus.UNLOADING: frozenset({ModelStatus.UNLOADED}),
    ModelStatus.FAILED: frozenset({ModelStatus.LOADING, ModelStatus.UNLOADED}),
}


class TransitionError(RuntimeError):
    """A status change the model's lifecycle does not allow: a bug, never a client's doing."""


@dataclass
class Failure:
    """Why the model's last load failed, and when (on the WorkLoadManager's clock)."""

    error: errors.MMServerError
    at: float


@dataclass(eq=False, slots=True)
class ModelRecord:
    """One model the WorkLoadManager knows of. Only the event loop changes it; ``status`` is
    also read from the store's threads (one attribute read)."""

    name: str
    status: ModelStatus = ModelStatus.UNLOADED
    #: The loaded model's pool: set exactly while READY or UNLOADING.
    pool: ModelPool | None = None
    #: The load under way (LOADING), which every request for the model waits for.
    load: asyncio.Task[ModelPool] | None = None
    #: The unload under way (UNLOADING); a request waits for it, then loads anew.
    unload: asyncio.Task[None] | None = None
    #: The last load's failure, kept until a load succeeds or it is forgotten.
    failure: Failure | None = None
    #: The store entry of a model registered with POST /models, and the url it was given by.
    registered: StoreEntry | None = None
    url: str | None = None
    #: Where the loaded model came from (a store entry's url), for describe.
    source: str | None = None
    #: Settings changed with the management API, applied at every load (``None``: none).
    overrides: dict[str, Any] | None = None
    #: Registered with ``trusted=true`` (POST /models): its files are fully trusted.
    trusted: bool = False
    #: What the model's load told of it (:func:`mmserver.execution.predictor.signature`).
    signature: dict[str, Any] | None = None
    #: The warnings its load raised (a pickle of another library version, say).
    warnings: tuple[str, ...] = ()
    #: Named by ``load_models``: loaded at start.
    startup: bool = False
    #: Pinned by a management call (``PUT /models/NAME?pinned=true``): never evicted.
    pinned: bool = False
    #: What its loads measured (shared with the catalog's memory of models it forgot).
    measured: Measured = field(default_factory=Measured)
    #: The model environment its requirement set asked for at its last load (``None``: the
    #: server's own environment), shown while it builds and after it failed.
    environment: Environment | None = None

    def become(self, status: ModelStatus) -> None:
        """Move to ``status``; :class:`TransitionError` if the lifecycle has no such step."""
        if status not in TRANSITIONS[self.status]:
            raise TransitionError(
                f"model {self.name}: no transition from {self.status.value} to {status.value}"
            )
        self.status = status

    @property
    def kept(self) -> bool:
        """Whether the record must outlive its model's unload (see the module docstring)."""
        return (
            self.status is not ModelStatus.UNLOADED
            or self.failure is not None
            or self.registered is not None
            or bool(self.overrides)
            or self.startup
            or self.pinned
        )
