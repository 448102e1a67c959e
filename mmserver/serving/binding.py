"""A model's copies in the backend slots, and the memory they take.

The model is loaded into a slot when one of its workers is bound there, and only there (one
load per slot, shared by the model's workers there); it is unloaded from a slot when the last of
its workers there leaves (:meth:`Copies.leave`). The memory of one copy is measured by the first
load; until then, and while no copy is loaded, what an earlier load of the model measured is
what the model is counted for (:attr:`Copies.accounted_bytes`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, cast

from mmserver.backend.placement import Slot
from mmserver.backend.wire import LoadInfo, LoadSpec
from mmserver.config.server import ModelConfig
from mmserver.procs.replies import data_loads


class CopiesHost(Protocol):
    """What the copies need of their model (implemented by its pool): its names, its files and
    its configuration as it is when a copy loads."""

    name: str
    key: str
    model_dir: Path
    config: ModelConfig


class Copies:
    """The copies of one model loaded, or loading, in backend slots (see the module docstring).

    ``loaded`` is called once, when the first copy has been measured; ``memory_changed`` with
    the change whenever :attr:`accounted_bytes` changes, once it has. Every method runs on the
    event loop."""

    __slots__ = (
        "_host",
        "_known_bytes",
        "_loaded",
        "_loads",
        "_memory_changed",
        "_paths",
        "accounted_bytes",
        "copy_bytes",
    )

    def __init__(
        self,
        host: CopiesHost,
        known_bytes: int,
        loaded: Callable[[LoadInfo], None],
        memory_changed: Callable[[int], None],
    ) -> None:
        """``known_bytes``: the memory of one copy as an earlier load measured it (0: none)."""
        self._host = host
        self._loaded = loaded
        self._memory_changed = memory_changed
        #: The load of the model in each slot it is in, by slot index (a resolved future once
        #: loaded).
        self._loads: dict[int, asyncio.Future[LoadInfo]] = {}
        self.copy_bytes = 0  # memory of one copy, known after the first load
        self._known_bytes = known_bytes
        #: The memory counted for this model by the eviction policy (see :meth:`_recount`).
        self.accounted_bytes = known_bytes
        #: What the model's first load reported of its family and predict paths, pickled.
        self._paths: bytes | None = None

    async def load(self, slot: Slot) -> LoadInfo:
        """Make sure the model is loaded in ``slot`` (one load per slot, shared by workers);
        what its load there reported."""
        loads = self._loads
        future = loads.get(slot.index)
        if future is None:
            host = self._host
            future = asyncio.ensure_future(
                slot.load(LoadSpec(host.key, host.model_dir, host.config))
            )
            loads[slot.index] = future
            self._recount()
        try:
            info = await asyncio.shield(future)
        except BaseException:
            if loads.get(slot.index) is future:
                self.leave(slot)
            raise
        if loads.get(slot.index) is future and isinstance(future, asyncio.Task):
            # Loaded: what stays is a resolved future, not the finished task and its coroutine.
            settled: asyncio.Future[LoadInfo] = asyncio.get_running_loop().create_future()
            settled.set_result(info)
            loads[slot.index] = settled
        if not self.copy_bytes:
            config = self._host.config
            self.copy_bytes = (
                int(config.required_memory_mb * 2**20)
                if config.required_memory_mb is not None
                else info.memory_bytes
            )
            self._recount()
            self._paths = info.paths
            self._loaded(info)
        return info

    def leave(self, slot: Slot, unload: bool = True) -> asyncio.Task[None] | None:
        """The model leaves ``slot``: it is unloaded there (the task doing it), or at the end of
        its load there if that is still running in the process."""
        load = self._loads.pop(slot.index, None)
        if load is None:
            return None
        self._recount()
        if not load.done():
            load.add_done_callback(lambda _: self._leave_loaded(slot, load, unload))
            return None
        return self._leave_loaded(slot, load, unload)

    def _leave_loaded(
        self, slot: Slot, load: asyncio.Future[LoadInfo], unload: bool
    ) -> asyncio.Task[None] | None:
        if load.cancelled() or load.exception() is not None:
            return None  # nothing loaded there (and the error is retrieved: no one waits for it)
        if not unload or slot.index in self._loads:  # loaded there again since
            return None
        return asyncio.get_running_loop().create_task(
            slot.unload(self._host.key), name=f"mmserver-unload-{self._host.name}"
        )

    async def leave_all(self, slots: Iterable[Slot], unload: bool) -> None:
        """Leave every slot of ``slots`` the model is in, and wait for its unloads there (none
        unless ``unload``)."""
        by_index = {slot.index: slot for slot in slots}
        unloads = [self.leave(by_index[index], unload) for index in list(self._loads)]
        await asyncio.gather(*(u for u in unloads if u is not None))

    @property
    def memory_bytes(self) -> int:
        """The memory of the copies loaded or loading."""
        return self.copy_bytes * len(self._loads)

    def _recount(self) -> None:
        """Recount :attr:`accounted_bytes`: the copies loaded, or, with none loaded (scaled to
        zero, or before the first load is measured), one copy's known size."""
        now = self.memory_bytes or self.copy_bytes or self._known_bytes
        change = now - self.accounted_bytes
        if change:
            self.accounted_bytes = now
            self._memory_changed(change)

    @property
    def paths(self) -> dict[str, Any] | None:
        """The family and predict paths the model's first load reported (``None``: a custom
        handler, or not loaded yet)."""
        # Made in a backend process, which may run a model's own code: read as data only.
        return None if self._paths is None else cast(dict[str, Any], data_loads(self._paths))
