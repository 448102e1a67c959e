"""The store index's freshness rules, over a fake store and clocks the tests move."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest

from mmserver.store.index import SETTLE_S, StoreIndex


class FakeSource:
    """A store whose entries, version and scan the test controls; counts scans."""

    def __init__(self, names: list[str], versioned: bool = True) -> None:
        self.entries = {name: ".tar.gz" for name in names}
        self.versioned = versioned
        self.token = 0
        self.changed_at = 0.0
        self.scans = 0
        self.gate: asyncio.Event | None = None

    def change(self, at: float, **entries: str | None) -> None:
        for name, suffix in entries.items():
            if suffix is None:
                self.entries.pop(name, None)
            else:
                self.entries[name] = suffix
        self.token += 1
        self.changed_at = at

    def scan(self) -> list[tuple[str, str]]:
        self.scans += 1
        return sorted(self.entries.items())

    def version(self) -> tuple[Hashable, float] | None:
        return (self.token, self.changed_at) if self.versioned else None

    def url_of(self, name: str, suffix: str) -> str:
        return f"/store/{name}{suffix}"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def names(index: StoreIndex, after: str | None = None, limit: int = 100) -> list[str]:
    rows, _ = await index.page(after, limit)
    return [name for name, _ in rows]


async def test_pages_and_urls() -> None:
    source = FakeSource([f"m{i:03d}" for i in range(250)])
    index = StoreIndex(source, clock=Clock(), wall_clock=Clock())
    rows, more = await index.page(None, 2)
    assert rows == [("m000", "/store/m000.tar.gz"), ("m001", "/store/m001.tar.gz")] and more
    rows, more = await index.page("m247", 5)
    assert [n for n, _ in rows] == ["m248", "m249"] and not more
    assert await index.page("zzz", 5) == ([], False)
    assert source.scans == 1


async def test_a_versioned_store_is_scanned_when_its_version_changes() -> None:
    wall = Clock()
    source = FakeSource(["a", "b"])
    index = StoreIndex(source, clock=Clock(), wall_clock=wall)
    assert await names(index) == ["a", "b"]
    assert await names(index) == ["a", "b"]
    assert source.scans == 1
    wall.now += 10
    source.change(wall.now - 5, c=".tgz", a=None)
    assert await names(index) == ["b", "c"]
    assert index.url("c") == "/store/c.tgz"
    assert source.scans == 2


async def test_a_version_read_too_soon_after_a_change_is_checked_once_more() -> None:
    """A second change in the same timestamp tick leaves the version as it was: a version read
    within SETTLE_S of its change is trusted only until then, and then scanned once more."""
    wall = Clock()
    source = FakeSource(["a"])
    source.change(wall.now, b=".tar.gz")
    index = StoreIndex(source, clock=Clock(), wall_clock=wall)
    assert await names(index) == ["a", "b"]
    source.entries["c"] = ".tar.gz"  # same tick: the token does not move
    assert await names(index) == ["a", "b"]
    wall.now += SETTLE_S
    assert await names(index) == ["a", "b", "c"]
    assert await names(index) == ["a", "b", "c"]
    assert source.scans == 2


async def test_a_store_without_version_ages_out_and_pages_meanwhile() -> None:
    clock = Clock()
    source = FakeSource(["a"], versioned=False)
    index = StoreIndex(source, max_age_s=10, clock=clock, wall_clock=Clock())
    assert await names(index) == ["a"]
    source.entries["b"] = ".tar.gz"
    clock.now += 9
    assert await names(index) == ["a"]
    assert source.scans == 1
    clock.now += 1
    # Past its age: the listing that notices starts a scan and answers from the old index.
    assert await names(index) == ["a"]
    await index.wait()
    assert await names(index) == ["a", "b"]
    assert source.scans == 2


async def test_lookups_update_the_index() -> None:
    index = StoreIndex(FakeSource(["b", "d"]), clock=Clock(), wall_clock=Clock())
    await index.refresh()
    index.note("c", "")
    index.note("a", ".tgz")
    index.note("d", None)
    index.note("zz", None)
    index.note("b", "")
    assert index.names_after(None, 10) == ["a", "b", "c"]
    assert index.url("b") == "/store/b" and index.url("d") is None
    assert [name in index for name in ("a", "b", "c", "d", "zz", "")] == [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match="unknown entry suffix"):
        index.note("e", ".zip")


async def test_concurrent_listings_share_one_scan() -> None:
    source = FakeSource([f"m{i}" for i in range(10)])
    index = StoreIndex(source, clock=Clock(), wall_clock=Clock())
    results = await asyncio.gather(*(names(index) for _ in range(20)))
    assert all(r == results[0] for r in results)
    assert source.scans == 1
