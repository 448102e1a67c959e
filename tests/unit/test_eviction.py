"""The LRU victim choice, as tables."""

from __future__ import annotations

from mmserver.policy.eviction import Candidate, choose_victims

MB = 2**20


def lru(*specs: tuple[str, int, bool]) -> list[Candidate]:
    return [Candidate(name, mb * MB, busy) for name, mb, busy in specs]


def test_fits_already() -> None:
    assert (
        choose_victims(
            lru(("a", 1, False)),
            loaded=1,
            used_bytes=MB,
            need_bytes=MB,
            max_models=5,
            budget_bytes=100 * MB,
        )
        == []
    )


def test_count_limit_evicts_least_recently_used_first() -> None:
    order = lru(("old", 1, False), ("mid", 1, False), ("new", 1, False))
    assert choose_victims(
        order, loaded=3, used_bytes=3 * MB, need_bytes=MB, max_models=3, budget_bytes=100 * MB
    ) == ["old"]


def test_busy_models_are_skipped() -> None:
    order = lru(("old", 1, True), ("mid", 1, False), ("new", 1, False))
    assert choose_victims(
        order, loaded=3, used_bytes=3 * MB, need_bytes=MB, max_models=3, budget_bytes=100 * MB
    ) == ["mid"]


def test_memory_budget_evicts_until_it_fits() -> None:
    order = lru(("a", 10, False), ("b", 10, False), ("c", 10, False))
    assert choose_victims(
        order, loaded=3, used_bytes=30 * MB, need_bytes=15 * MB, max_models=0, budget_bytes=35 * MB
    ) == ["a"]
    assert choose_victims(
        order, loaded=3, used_bytes=30 * MB, need_bytes=25 * MB, max_models=0, budget_bytes=35 * MB
    ) == ["a", "b"]


def test_nothing_evictable_returns_none() -> None:
    order = lru(("a", 1, True), ("b", 1, True))
    assert (
        choose_victims(
            order, loaded=2, used_bytes=2 * MB, need_bytes=MB, max_models=2, budget_bytes=100 * MB
        )
        is None
    )


def test_model_larger_than_the_budget_never_fits() -> None:
    assert (
        choose_victims(
            lru(("a", 1, False)),
            loaded=1,
            used_bytes=MB,
            need_bytes=200 * MB,
            max_models=0,
            budget_bytes=100 * MB,
        )
        is None
    )


def test_pinned_models_are_never_victims() -> None:
    order = [Candidate("old", MB, False, pinned=True), *lru(("mid", 1, False), ("new", 1, False))]
    assert choose_victims(
        order, loaded=3, used_bytes=3 * MB, need_bytes=MB, max_models=3, budget_bytes=100 * MB
    ) == ["mid"]
    only_pinned = [Candidate("a", MB, False, pinned=True), Candidate("b", MB, False, pinned=True)]
    assert (
        choose_victims(
            only_pinned,
            loaded=2,
            used_bytes=2 * MB,
            need_bytes=MB,
            max_models=2,
            budget_bytes=100 * MB,
        )
        is None
    )
