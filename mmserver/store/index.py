"""The store's names in memory: listing pages and lookups cost O(log n + page), not O(store).

:class:`StoreIndex` keeps the sorted names of the store's models and, for each, the suffix of its
entry (a folder, ``.tar.gz`` or ``.tgz``), which is all a listing shows. It is filled by a scan of
the store (:meth:`IndexSource.scan`, in a thread) and kept fresh cheaply:

- a store with a version (a local directory: its modification time, which changes when an entry
  is added, removed or renamed) is scanned again when the version changed, or, once, when it was
  read too soon after a change to trust it (a second change within the file system's timestamp
  granularity leaves the time as it was): by the first listing :data:`SETTLE_S` after the
  change;
- a store without one (S3) is scanned again when the index is older than ``max_age_s``; until
  that scan ends, pages come from the previous index;
- every lookup of a request (:meth:`note`) puts its answer into the index at once: a model
  dropped into the store is found on its first request (the lookup itself goes to the store,
  :meth:`mmserver.store.source.ModelSource.find`) and listed from then on, and a removed one
  leaves it.

A server on a local store scans it once when it starts: a name the index lists is then looked up
where its files are prepared (an unpacking process), in one request; any other name is looked up
on its own first (:meth:`mmserver.manager.wlm.WorkLoadManager._load`).

One scan runs at a time, off the event loop; callers that need it wait for the same one.
Concurrency contract: every method but the source's runs on the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

log = logging.getLogger(__name__)

#: Entry suffixes: a folder, then the archive suffixes (one shared string each).
SUFFIXES = ("", ".tar.gz", ".tgz")
#: A version read less than this many seconds after it changed may hide a second change made
#: within the same timestamp tick: the index is scanned again on the next listing.
SETTLE_S = 1.0


class IndexSource(Protocol):
    """What the index needs of a store; the methods block (callers run them in threads)."""

    def scan(self) -> Sequence[tuple[str, str]]:
        """``(name, suffix)`` of every model of the store, sorted by name; ``suffix`` is one of
        :data:`SUFFIXES`. Loads and unpacks nothing."""
        ...

    def version(self) -> tuple[Hashable, float] | None:
        """A token that changes whenever the listing may have, and when it last changed (wall
        clock); ``None`` when the store has no such token (then the index ages out)."""
        ...

    def url_of(self, name: str, suffix: str) -> str:
        """Where the entry ``name + suffix`` is, as shown to users."""
        ...


class StoreIndex:
    """The sorted names of a store, refreshed as the module docstring says."""

    def __init__(
        self,
        source: IndexSource,
        *,
        max_age_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.max_age_s = max_age_s
        self._clock = clock
        self._wall = wall_clock
        self._names: list[str] = []
        self._suffixes: list[str] = []  # parallel to _names: items of SUFFIXES
        self._version: Hashable | None = None
        self._settled = False
        self._settle_at = 0.0
        self._scanned_at: float | None = None
        self._scan: asyncio.Task[None] | None = None
        self.scans = 0

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: str) -> bool:
        """Whether the index lists ``name`` now (no refresh: as it holds it)."""
        return self._position(name) is not None

    def _position(self, name: str) -> int | None:
        """Where ``name`` is in the sorted names, or ``None`` when they do not hold it."""
        names = self._names
        i = bisect.bisect_left(names, name)
        return i if i < len(names) and names[i] == name else None

    # Reading ----------------------------------------------------------------------------------

    async def page(self, after: str | None, limit: int) -> tuple[list[tuple[str, str]], bool]:
        """Up to ``limit`` ``(name, url)`` after the name ``after`` (from the start when
        ``None``), and whether more follow. Fresh as the module docstring says."""
        await self.refresh()
        names = self._names
        start = bisect.bisect_right(names, after) if after else 0
        end = min(start + limit, len(names))
        url_of, suffixes = self.source.url_of, self._suffixes
        rows = [(names[i], url_of(names[i], suffixes[i])) for i in range(start, end)]
        return rows, end < len(names)

    def names_after(self, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` names after ``after``, as the index holds them now."""
        start = bisect.bisect_right(self._names, after) if after else 0
        return self._names[start : start + limit]

    def url(self, name: str) -> str | None:
        """The listed url of ``name``, or ``None`` when the index does not hold it."""
        i = self._position(name)
        return None if i is None else self.source.url_of(name, self._suffixes[i])

    # Freshness --------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Scan the store again if the index may be stale (one scan at a time)."""
        if self._scan is not None:
            if self._scanned_at is None:
                await asyncio.shield(self._scan)  # the first scan: nothing to serve before it
            return
        if self._scanned_at is not None:
            version = await asyncio.to_thread(self.source.version)
            if version is None:
                if self._clock() - self._scanned_at < self.max_age_s:
                    return
                self._start_scan(None)  # pages come from the previous index meanwhile
                return
            if version[0] == self._version and (self._settled or self._wall() < self._settle_at):
                return
        else:
            version = None
        self._start_scan(version)
        assert self._scan is not None
        await asyncio.shield(self._scan)

    def _start_scan(self, version: tuple[Hashable, float] | None) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run_scan(version), name="mmserver-store-index"
        )
        self._scan = task
        task.add_done_callback(_retrieve)

    async def _run_scan(self, version: tuple[Hashable, float] | None) -> None:
        try:
            started = self._clock()
            # The version is read before the scan: a change made during it shows next time.
            if version is None:
                version = await asyncio.to_thread(self.source.version)
            found = await asyncio.to_thread(self.source.scan)
            self._names = [name for name, _ in found]
            self._suffixes = [_shared(suffix) for _, suffix in found]
            if version is not None:
                self._version = version[0]
                self._settled = self._wall() - version[1] >= SETTLE_S
                self._settle_at = version[1] + SETTLE_S
            self._scanned_at = self._clock()
            self.scans += 1
            log.debug(
                "store index: %d model(s) in %.1f ms", len(found), (self._clock() - started) * 1e3
            )
        except Exception as exc:
            if self._scanned_at is None:
                raise  # the first scan: the listing that waits for it answers the error
            # Pages keep coming from the previous index; the next listing tries again.
            log.warning("store index: scan of %s failed: %s", self.source, exc)
        finally:
            self._scan = None

    async def wait(self) -> None:
        """Wait for the scan under way, if any, to end."""
        task = self._scan
        if task is not None:
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    async def stop(self) -> None:
        """Cancel a scan under way and wait for it."""
        task = self._scan
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # Lookups ------------------------------------------------------------------------------------

    def note(self, name: str, suffix: str | None) -> None:
        """What a lookup of ``name`` found now: the entry's suffix, or ``None`` when the store
        has no such model (then it leaves the index)."""
        names = self._names
        i = bisect.bisect_left(names, name)
        present = i < len(names) and names[i] == name
        if suffix is None:
            if present:
                del names[i]
                del self._suffixes[i]
        elif present:
            self._suffixes[i] = _shared(suffix)
        else:
            names.insert(i, name)
            self._suffixes.insert(i, _shared(suffix))


def _retrieve(task: asyncio.Task[None]) -> None:
    # Whoever waited got the error; a scan nobody waits for any more must not warn at exit.
    if not task.cancelled():
        task.exception()


def _shared(suffix: str) -> str:
    """The one string object of ``suffix`` (each name refers to one of three strings)."""
    for known in SUFFIXES:
        if suffix == known:
            return known
    raise ValueError(f"unknown entry suffix {suffix!r}")


def suffix_of(filename: str, name: str) -> str:
    """The suffix of the entry file name ``filename`` of model ``name``."""
    return _shared(filename[len(name) :])
