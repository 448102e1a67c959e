"""The unpacked copies of an object store in its cache directory, and their disk budget.

A copy is the folder ``NAME-KEY`` (``KEY``: 16 hex digits naming one version of the object) in
which :class:`mmserver.store.s3.ObjectStore` unpacks an archive. When the copies pass
``max_bytes``, the least recently used are removed (:func:`choose_cache_victims`), never the copy
of a model that is loading, loaded or being unloaded (as ``in_use`` tells) nor one being
prepared. A copy's folder's modification time is its last use, for another process sharing the
cache or after a restart.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mmserver.store.local import tree_size
from mmserver.store.names import MODEL_NAME_RE, VERSION_RE, key_of_stem

log = logging.getLogger(__name__)

_COPY_RE = re.compile(
    r"(?P<name>" + MODEL_NAME_RE.pattern + r"(?:@" + VERSION_RE.pattern + r")?)-[0-9a-f]{16}"
)
# A temporary folder this old belongs to a process that died: no download takes a day.
_STALE_TMP_SECONDS = 24 * 3600


@dataclass(frozen=True)
class CachedCopy:
    """One unpacked copy in the cache, as the eviction choice sees it."""

    key: str  # its folder's name
    size_bytes: int
    last_used: float
    protected: bool


def choose_cache_victims(
    copies: Iterable[CachedCopy], budget_bytes: int, incoming_bytes: int = 0
) -> list[str]:
    """The copies to remove, least recently used first, so that the cache plus
    ``incoming_bytes`` fits ``budget_bytes``. Protected copies are never chosen, so the result
    may not be enough when the rest is protected."""
    ordered = sorted(copies, key=lambda c: (c.last_used, c.key))
    total = sum(c.size_bytes for c in ordered) + incoming_bytes
    victims: list[str] = []
    for copy in ordered:
        if total <= budget_bytes:
            break
        if not copy.protected:
            victims.append(copy.key)
            total -= copy.size_bytes
    return victims


@dataclass
class _Copy:
    size_bytes: int
    last_used: float


class CopyCache:
    """The copies in ``cache_dir``, kept under ``max_bytes`` (0: no limit).

    Called from the store's threads, several at once. A model's copies are prepared, removed and
    evicted under that model's lock (:meth:`name_lock`), which the caller of :meth:`preparing`,
    :meth:`used` and :meth:`evict` holds. ``in_use(name)`` (called from those threads, so it must
    be thread-safe) tells whether a model still needs its files; without it, the current copy of
    every model prepared is kept.
    """

    def __init__(
        self, cache_dir: Path, max_bytes: int, in_use: Callable[[str], bool] | None = None
    ) -> None:
        self.cache_dir = cache_dir
        self.max_bytes = max_bytes
        self._in_use = in_use
        self._lock = threading.Lock()  # guards the fields below
        self._name_locks: dict[str, threading.Lock] = {}
        self._current: dict[str, str] = {}  # model name -> folder of the copy last prepared
        self._copies: dict[str, _Copy] | None = None  # folder -> copy; read from disk once
        self._swept = False

    def name_lock(self, name: str) -> threading.Lock:
        """The lock of model ``name``'s copies."""
        with self._lock:
            return self._name_locks.setdefault(name, threading.Lock())

    def preparing(self, name: str, folder: str) -> None:
        """``folder`` is now the copy of model ``name``: it stays while the model needs it."""
        with self._lock:
            self._current[name] = folder

    def used(self, folder: str, path: Path, *, new: bool = False) -> None:
        """Mark a copy used now; ``new``: it was just unpacked."""
        now = time.time()
        try:
            # The folder's mtime is its last use for another process, or after a restart.
            os.utime(path, (now, now))
        except OSError:
            pass
        if not self.max_bytes:
            return
        size = tree_size(path)[0] if new else None
        with self._lock:
            index = self._index()
            known = index.get(folder)
            if size is None:
                size = known.size_bytes if known is not None else tree_size(path)[0]
            index[folder] = _Copy(size, now)

    def remove(self, name: str) -> None:
        """Delete the copies of model ``name`` (best effort)."""
        try:
            with os.scandir(self.cache_dir) as it:
                folders = [i.name for i in it if _COPY_RE.fullmatch(i.name)]
        except OSError:
            return
        with self.name_lock(name):
            for folder in folders:
                if _copy_name(folder) != name:
                    continue
                with self._lock:
                    self._current.pop(name, None)
                    if self._copies is not None:
                        self._copies.pop(folder, None)
                shutil.rmtree(self.cache_dir / folder, ignore_errors=True)

    def sweep_once(self) -> None:
        """Remove the temporary folders that dead processes left (once per cache)."""
        if self._swept:
            return
        self._swept = True
        try:
            with os.scandir(self.cache_dir) as it:
                items = [i for i in it if i.name.startswith(".tmp-")]
        except OSError:
            return
        for item in items:
            try:
                age = time.time() - item.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if age > _STALE_TMP_SECONDS:
                shutil.rmtree(item.path, ignore_errors=True)

    def _index(self) -> dict[str, _Copy]:
        """The copies in the cache (called with ``_lock`` held), read from disk the first
        time."""
        if self._copies is None:
            self._copies = {}
            try:
                with os.scandir(self.cache_dir) as it:
                    items = list(it)
            except OSError:
                items = []
            for item in items:
                try:
                    if not item.is_dir(follow_symlinks=False):
                        continue
                    mtime = item.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                if _COPY_RE.fullmatch(item.name):
                    self._copies[item.name] = _Copy(tree_size(Path(item.path))[0], mtime)
        return self._copies

    def _protected(self, holding: str) -> set[str]:
        """Folders that must stay (``_lock`` held): the copy being prepared and the copies of
        the models still using their files."""
        keep = {
            folder
            for name, folder in self._current.items()
            if name == holding or self._in_use is None or self._in_use(name)
        }
        return keep

    def evict(self, holding: str, incoming_bytes: int = 0) -> None:
        """Remove least recently used copies until the cache fits its budget. ``holding`` is
        the model whose lock the caller holds."""
        if not self.max_bytes:
            return
        with self._lock:
            index = self._index()
            protected = self._protected(holding)
            snapshot = [
                CachedCopy(folder, c.size_bytes, c.last_used, folder in protected)
                for folder, c in index.items()
            ]
        victims = choose_cache_victims(snapshot, self.max_bytes, incoming_bytes)
        for folder in victims:
            name = _copy_name(folder)
            lock = self.name_lock(name)
            # A model being prepared in another thread keeps all its copies for now.
            if name != holding and not lock.acquire(blocking=False):
                continue
            try:
                with self._lock:
                    if folder in self._protected(holding):
                        continue  # loaded since the snapshot
                    copy = index.pop(folder, None)
                shutil.rmtree(self.cache_dir / folder, ignore_errors=True)
                log.info(
                    "model %s: removed its cached copy %s (%d bytes, least recently used) to "
                    "keep the cache under max_cache_mb",
                    name,
                    folder,
                    copy.size_bytes if copy is not None else 0,
                )
            finally:
                if name != holding:
                    lock.release()


def _copy_name(folder: str) -> str:
    match = _COPY_RE.fullmatch(folder)
    assert match is not None
    return key_of_stem(match.group("name"))
