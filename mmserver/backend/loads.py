"""The models of one process slot (:class:`SlotLoads`): those loaded or being loaded in its
process, which a replacement reloads; the loads waiting for their turn in the slot's run queue
(:class:`LoadTurn`) and what a load costs there; and the memory the loads measured."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.slot import Pending
from mmserver.backend.wire import LoadInfo, LoadSpec
from mmserver.ops import capacity
from mmserver.policy.scheduling import PIPELINE_BUDGET_S, Cost


class LoadMessage(Pending):
    """A load's message, which knows its model (a replacement process resends it, and reloads
    only the models whose load is not among the messages it resends)."""

    __slots__ = ("spec",)

    def __init__(self, spec: LoadSpec, future: asyncio.Future[LoadInfo]) -> None:
        super().__init__((wire.LOAD, spec), future)
        self.spec = spec


class LoadTurn:
    """A load waiting in its slot's run queue
    (:meth:`~mmserver.backend.process_slot.ProcessSlot.load`), written to the pipe when its turn
    comes, behind whatever the pipe holds. A batch whose turn came first waits for the pipe to
    drain with the loads behind it held back: a stream of cold loads keeps a loaded model's batch
    waiting only for the loads written before its turn came, and busy models do not hold back a
    load."""

    __slots__ = ("charge", "cost", "loads", "pending", "spec")

    def __init__(self, loads: SlotLoads, pending: LoadMessage) -> None:
        self.loads = loads
        self.spec = pending.spec
        self.pending = pending
        #: Unknown: no batch goes behind it in the pipe.
        self.cost = Cost()
        #: The loads' share of the slot moves by their own cost (:meth:`SlotLoads.turn`).
        self.charge = loads.cost.estimate

    def waiting(self) -> bool:
        return self.loads.turns.get(self.spec.key) is self and not self.pending.done()

    def begin(self, waited: int = 0) -> bool:
        loads, key = self.loads, self.spec.key
        del loads.turns[key]
        loads.loaded[key] = self.spec
        loads.write(self.pending)
        return True


#: Seconds a process's resident memory, once read, stands for it: every load asks for it (to
#: make room, then to keep the budget), and a stream of cold loads would otherwise read
#: ``/proc`` several times a load (a tenth of the frontend's time at 200 loads a second).
RSS_FRESH_S = 0.05


class SlotLoads:
    """What one process slot knows of the models in its process: which are loaded (or being
    loaded), the loads waiting for their turn, what a load costs, and what each load measured.

    The loads take turns with the models' batches as one more model: each load's start tag
    follows where the loads' share of the slot has got to, and a load is expected to hold the
    process :attr:`cost` (the moving average of the seconds the loads held it; the pipeline
    budget until one was measured). ``write`` sends a load's message when its turn comes.
    """

    def __init__(self, write: Callable[[Pending], None]) -> None:
        self.write = write
        #: The models loaded (or being loaded) in the process, which a replacement reloads.
        self.loaded: dict[str, LoadSpec] = {}
        #: Loads waiting in the run queue for their turn, by model key.
        self.turns: dict[str, LoadTurn] = {}
        self.cost = Cost(PIPELINE_BUDGET_S)
        #: Where the loads' share of the slot has got to (their last finish tag).
        self._vfinish = 0.0
        #: What each model loaded here measured at its load, their sum, and the process's
        #: resident bytes once it had started, with no model (:meth:`unaccounted_bytes`).
        self._charged: dict[str, int] = {}
        self._charged_total = 0
        self._baseline = 0
        #: The process's resident bytes as last read, and when (time.monotonic()).
        self._rss = (0, -RSS_FRESH_S)

    def turn(
        self, spec: LoadSpec, future: asyncio.Future[LoadInfo], vtime: float
    ) -> tuple[float, LoadTurn]:
        """A turn for the load of ``spec`` (answered through ``future``) and its start tag on
        a lane whose clock reads ``vtime``; the loads' share moves on by one load."""
        turn = LoadTurn(self, LoadMessage(spec, future))
        self.turns[spec.key] = turn
        tag = max(self._vfinish, vtime)
        self._vfinish = tag + self.cost.estimate
        return tag, turn

    def failed(self, turn: LoadTurn) -> None:
        """``turn``'s load failed or was cancelled: its model is not in the process."""
        key = turn.spec.key
        if self.turns.get(key) is turn:
            del self.turns[key]
        self.loaded.pop(key, None)

    def answered(self, key: str, info: LoadInfo) -> None:
        """The load of ``key`` answered ``info``: count what it took."""
        if info.seconds > 0:
            self.cost.observe(info.seconds, info.seconds, 1)
        self.charge(key, info)

    def unload(self, key: str) -> bool:
        """Forget ``key`` (a load still waiting for its turn fails); whether the process has it
        (or is loading it)."""
        turn = self.turns.pop(key, None)
        if turn is not None:  # never sent: nothing to unload
            name = key.split("#")[0]
            turn.pending.fail(errors.ShuttingDown(f"model {name} was unloaded before it loaded"))
        return self.loaded.pop(key, None) is not None

    def take_turns(self) -> list[Pending]:
        """The messages of the loads waiting for their turn, which no longer wait."""
        turns, self.turns = list(self.turns.values()), {}
        return [turn.pending for turn in turns]

    def reloads(self, resent: Iterable[Pending]) -> list[LoadSpec]:
        """The models a replacement process loads again: those loaded here whose load is not
        among the messages ``resent`` to it (a load the dead process had not begun)."""
        keys = {p.spec.key for p in resent if isinstance(p, LoadMessage)}
        return [spec for key, spec in self.loaded.items() if key not in keys]

    # Memory ---------------------------------------------------------------------------------------

    def restarted(self, baseline: int) -> None:
        """A new process holds ``baseline`` resident bytes with no model loaded."""
        self._baseline = baseline
        self._rss = (0, -RSS_FRESH_S)
        self._charged.clear()
        self._charged_total = 0

    def charge(self, key: str, info: LoadInfo) -> None:
        """Count what the load of ``key`` measured here (a load of a model already loaded
        measures 0 and changes nothing)."""
        if key in self.loaded and info.memory_bytes and key not in self._charged:
            self._charged[key] = info.memory_bytes
            self._charged_total += info.memory_bytes

    def uncharge(self, key: str) -> None:
        """The process has let ``key`` go: its pages are no longer its load's."""
        self._charged_total -= self._charged.pop(key, 0)

    def unaccounted_bytes(self, pid: Callable[[], int | None]) -> int:
        """Resident bytes the process (``pid()``: its id while it runs, asked only when its
        memory is read again) holds beyond what it held at start and what its models' loads
        measured; 0 for no process."""
        if not self._baseline:
            return 0
        rss, read_at = self._rss
        now = time.monotonic()
        if now - read_at >= RSS_FRESH_S:
            live = pid()
            rss = capacity.rss_bytes([live]) if live is not None else 0
            self._rss = (rss, now)
        return max(0, rss - self._baseline - self._charged_total) if rss else 0
