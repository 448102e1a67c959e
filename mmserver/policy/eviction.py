"""Which loaded models to unload to make room: least recently used first, never a busy or a
pinned one.

A pure function over a snapshot, so the policy is tested with tables; the WorkLoadManager applies
its answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """A loaded model as eviction sees it."""

    name: str
    memory_bytes: int
    busy: bool  # has queued or running jobs
    pinned: bool = False  # never evicted (pinned_models, PUT /models/NAME?pinned=true)


def choose_victims(
    lru_order: Iterable[Candidate],
    *,
    loaded: int,
    used_bytes: int,
    need_bytes: int,
    max_models: int,
    budget_bytes: int,
) -> list[str] | None:
    """The models to unload, least recently used first, so that one more model of
    ``need_bytes`` fits under ``max_models`` (0 = no limit) and ``budget_bytes``.

    Returns ``[]`` when it fits already and ``None`` when it cannot fit even after unloading
    every idle model that is not pinned. ``lru_order`` starts with the least recently used model.
    """

    def fits(count: int, used: int) -> bool:
        if max_models and count + 1 > max_models:
            return False
        return used + need_bytes <= budget_bytes

    if fits(loaded, used_bytes):
        return []
    victims: list[str] = []
    for candidate in lru_order:
        if candidate.busy or candidate.pinned:
            continue
        victims.append(candidate.name)
        loaded -= 1
        used_bytes -= candidate.memory_bytes
        if fits(loaded, used_bytes):
            return victims
    return None
