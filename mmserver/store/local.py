"""The store on the local file system: a directory of models, each a folder ``NAME/`` or an
archive ``NAME.tar.gz`` (or ``NAME.tgz``); a folder holding entries named by numbers
(``NAME/1/``, ``NAME/2.tar.gz``) is a model with versions, each of them found as ``NAME/2``.

:class:`ModelStore` lists entries and unpacks archives into a cache directory, once per archive
version (:func:`prepare_local`, with :func:`mmserver.store.archive.unpack_archive`); it never
loads a model. An entry that is a symbolic link is served only when it leads into the store or
the roots ``POST /models`` may load from.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

from mmserver.errors import Forbidden, InvalidInput, ModelLoadError, ModelNotFound
from mmserver.store.archive import model_root, unpack_archive
from mmserver.store.names import (
    ARCHIVE_SUFFIXES,
    archive_name,
    entry_version,
    file_stem,
    is_model_name,
    normalize_name,
    normalize_target,
    split_version,
)
from mmserver.store.properties import read_properties
from mmserver.store.source import StoreEntry, Unpacker

# A directory entry walk stops counting here: the size only feeds the memory estimate, and a
# store folder with more files than this is not a model anyway.
_MAX_DIR_FILES = 10_000
#: The file a model folder's versions inherit settings from.
PROPERTIES_FILE = "serving.properties"


def tree_size(path: Path) -> tuple[int, int]:
    """Total bytes and number of the regular files under ``path`` (links not followed; at most
    ``_MAX_DIR_FILES`` files are counted)."""
    total = 0
    files = 0
    stack = [str(path)]
    while stack and files < _MAX_DIR_FILES:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    return total, files


def _dir_size(path: Path) -> int | None:
    """Total size of the regular files under ``path``, or ``None`` when it holds no file."""
    total, files = tree_size(path)
    return total if files else None


def _cache_key(st: os.stat_result) -> str:
    # Size and mtime identify an archive version: a replaced archive unpacks again.
    return hashlib.sha1(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


class ModelStore:
    """Lists the models under ``root`` and unpacks archives into ``cache_dir``.

    :meth:`list` and :meth:`find` only look at the file system; :meth:`prepare` is blocking
    (callers run it in a thread) and is safe when several processes prepare the same archive.
    """

    def __init__(
        self,
        root: Path,
        cache_dir: Path,
        max_unpacked_bytes: int,
        allowed_roots: Sequence[Path] = (),
    ) -> None:
        self.root = Path(root)
        self.cache_dir = Path(cache_dir)
        self.max_unpacked_bytes = max_unpacked_bytes
        self.unpack: Unpacker = unpack_archive
        self._cache_resolved = os.path.realpath(self.cache_dir)
        self._root_text = str(self.root)
        #: Where an entry that is a symbolic link may lead: the store and the roots
        #: ``POST /models`` may load from (one policy for both).
        self._roots = tuple(os.path.realpath(r) for r in (self.root, *allowed_roots))

    def portable(self) -> ModelStore:
        """The same store for another process (an unpacking process): it unpacks archives where
        it runs, with :func:`~mmserver.store.archive.unpack_archive`."""
        roots = [Path(r) for r in self._roots[1:]]  # the allowed roots, resolved
        return ModelStore(self.root, self.cache_dir, self.max_unpacked_bytes, roots)

    def _links_out(self, path: str) -> bool:
        """Whether the entry at ``path`` is a symbolic link that resolves outside the store and
        the allowed model roots."""
        if not os.path.islink(path):
            return False
        real = os.path.realpath(path)
        return not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self._roots)

    def _refuse_link(self, name: str) -> Forbidden:
        return Forbidden(
            f"model {name}: its store entry is a symbolic link leading outside the model store "
            "and allowed_model_roots; add its target's folder to allowed_model_roots to serve it"
        )

    # Listing ------------------------------------------------------------------------------------

    def _is_cache(self, path: str) -> bool:
        # Only an entry with the cache's name can be it: skip the realpath for the others.
        return (
            os.path.basename(path) == self.cache_dir.name
            and os.path.realpath(path) == self._cache_resolved
        )

    def list(self) -> list[StoreEntry]:
        """Every model of the store, sorted by name. A folder wins over an archive of the same
        name, and ``.tar.gz`` over ``.tgz``."""
        dirs: dict[str, StoreEntry] = {}
        archives: dict[str, StoreEntry] = {}
        try:
            scan = os.scandir(self.root)
        except FileNotFoundError:
            return []
        with scan:
            for item in scan:
                if item.name.startswith("."):
                    continue
                try:
                    if item.is_symlink() and self._links_out(item.path):
                        continue
                    if item.is_dir():
                        if not is_model_name(item.name) or self._is_cache(item.path):
                            continue
                        size = _dir_size(Path(item.path))
                        if size is not None:
                            dirs[item.name] = StoreEntry(
                                item.name, Path(item.path), "directory", size
                            )
                    elif item.is_file():
                        name = archive_name(item.name)
                        if name is None:
                            continue
                        known = archives.get(name)
                        if known is not None and known.path.name.endswith(".tar.gz"):
                            continue
                        archives[name] = StoreEntry(
                            name, Path(item.path), "archive", item.stat().st_size
                        )
                except OSError:
                    continue  # removed while listing
        merged = {**archives, **dirs}
        return [merged[name] for name in sorted(merged)]

    def scan(self) -> Sequence[tuple[str, str]]:
        """``(name, suffix)`` of every model, sorted by name, for the store index
        (:mod:`mmserver.store.index`): the rules of :meth:`list` without measuring sizes (a
        folder counts once a file is found in it)."""
        return scan_directory(self.root, self._is_cache, self._links_out)

    def version(self) -> tuple[Hashable, float] | None:
        """The store directory's modification time (it changes when an entry is added, removed
        or renamed), and that time on the wall clock."""
        return directory_version(self.root)

    def url_of(self, name: str, suffix: str) -> str:
        return os.path.join(self._root_text, name + suffix)

    def find(self, name: str) -> StoreEntry | None:
        """The entry for ``name`` (``sklearn-7``, ``sklearn-7.tar.gz``, or a version's key
        ``sklearn-7/2``), looked up now, so an entry added while the server runs is found.
        Raises :class:`InvalidModelName`."""
        key = normalize_target(name)
        base, version = split_version(key)
        folder = self.root / base
        if version is not None:
            if not folder.is_dir() or self._is_cache(str(folder)):
                return None
            if self._links_out(str(folder)):
                raise self._refuse_link(base)
            return self._find_in(folder, str(version), key)
        return self._find_in(self.root, base, key)

    def _find_in(self, parent: Path, filename: str, key: str) -> StoreEntry | None:
        """The entry of ``key`` in ``parent``: the folder ``filename`` or its archive."""
        folder = parent / filename
        if folder.is_dir() and not self._is_cache(str(folder)):
            if self._links_out(str(folder)):
                raise self._refuse_link(key)
            size = _dir_size(folder)
            if size is not None:
                versions = () if "/" in key else folder_versions(folder)
                return StoreEntry(key, folder, "directory", size, versions=versions)
        for suffix in ARCHIVE_SUFFIXES:
            path = parent / (filename + suffix)
            try:
                st = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                if self._links_out(str(path)):
                    raise self._refuse_link(key)
                return StoreEntry(key, path, "archive", st.st_size)
        return None

    def model_properties(self, name: str) -> dict[str, str]:
        """The keys of ``NAME/serving.properties``, which the versions of ``NAME`` inherit."""
        path = self.root / normalize_name(name) / PROPERTIES_FILE
        return read_properties(path) if path.is_file() else {}

    def entry_for_path(self, path: Path, name: str) -> StoreEntry:
        """An entry for a registered model whose files are at ``path`` (a folder or an archive
        already checked to be inside the allowed roots)."""
        return local_entry(path, name)

    # Unpacking ----------------------------------------------------------------------------------

    def prepare(self, entry: StoreEntry) -> Path:
        """The directory holding the model's files. Blocking.

        A folder is returned as is. An archive is unpacked into ``cache_dir/<name>-<key>``
        (``key`` from its size and mtime) unless that exists already: it is unpacked into a
        temporary folder first and renamed into place, so a reader never sees a partial copy and
        two processes racing both end up with the same complete one.
        """
        return prepare_local(entry, self.cache_dir, self.max_unpacked_bytes, self.unpack)

    def remove_unpacked(self, name: str) -> None:
        """Delete the unpacked copies of model ``name`` (best effort)."""
        base = file_stem(normalize_target(name))
        pattern = re.compile(re.escape(base) + r"-[0-9a-f]{16}")
        try:
            with os.scandir(self.cache_dir) as it:
                paths = [item.path for item in it if pattern.fullmatch(item.name)]
        except OSError:
            return
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


def scan_directory(
    root: Path, is_cache: Callable[[str], bool], links_out: Callable[[str], bool] | None = None
) -> list[tuple[str, str]]:
    """``(name, suffix)`` of the models in the directory ``root``, sorted by name: folders
    holding a file (``suffix`` ``""``; not hidden, not the cache, not a link ``links_out``
    refuses) win over archives, and ``.tar.gz`` over ``.tgz``. One ``scandir`` of ``root``; a
    folder is opened only to find its first file."""
    found: dict[str, str] = {}
    try:
        scan = os.scandir(root)
    except FileNotFoundError:
        return []
    with scan:
        for item in scan:
            filename = item.name
            if filename.startswith("."):
                continue
            try:
                if links_out is not None and item.is_symlink() and links_out(item.path):
                    continue
                if item.is_dir():
                    if is_model_name(filename) and not is_cache(item.path) and _has_file(item.path):
                        found[filename] = ""
                elif item.is_file():
                    name = archive_name(filename)
                    if name is None or found.get(name) in ("", ".tar.gz"):
                        continue
                    found[name] = filename[len(name) :]
            except OSError:
                continue  # removed while listing
    return sorted(found.items())


def directory_version(root: Path) -> tuple[Hashable, float] | None:
    """``root``'s identity and modification time, and that time in seconds; a missing
    directory has a version too (it changes when the directory is made)."""
    try:
        st = os.stat(root)
    except OSError:
        return (None, 0.0)
    return ((st.st_dev, st.st_ino, st.st_mtime_ns), st.st_mtime)


def _has_file(path: str) -> bool:
    """Whether the folder ``path`` holds a regular file (links not followed), looking no
    further than the first one and at most ``_MAX_DIR_FILES`` folders."""
    stack = [path]
    seen = 0
    while stack and seen < _MAX_DIR_FILES:
        seen += 1
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_file(follow_symlinks=False):
                            return True
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                    except OSError:
                        continue
        except OSError:
            continue
    return False


def folder_versions(folder: Path) -> tuple[int, ...]:
    """The versions the model folder ``folder`` holds (entries ``1/``, ``2.tar.gz``...), sorted;
    empty when it holds none (it is then a model of its own files)."""
    found: set[int] = set()
    try:
        with os.scandir(folder) as it:
            for item in it:
                version = entry_version(item.name)
                if version is None:
                    continue
                try:
                    if item.is_dir() or (item.is_file() and item.name != str(version)):
                        found.add(version)
                except OSError:
                    continue
    except OSError:
        return ()
    return tuple(sorted(found))


def local_entry(path: Path, name: str) -> StoreEntry:
    """The entry of model ``name`` whose files are at the local ``path`` (a folder or an
    archive)."""
    base = normalize_name(name)
    path = Path(path)
    if path.is_dir():
        return StoreEntry(base, path, "directory", _dir_size(path) or 0)
    if path.is_file() and archive_name(path.name) is not None:
        return StoreEntry(base, path, "archive", path.stat().st_size)
    if not path.exists():
        raise ModelNotFound(f"model {base}: {path} does not exist")
    raise InvalidInput(f"model {base}: {path} is neither a directory nor a .tar.gz archive")


def prepare_local(
    entry: StoreEntry, cache_dir: Path, max_unpacked_bytes: int, unpack: Unpacker | None = None
) -> Path:
    """The directory holding the files of a local entry: a folder as is, an archive unpacked
    (by ``unpack``, :func:`unpack_archive` by default) into ``cache_dir/<name>-<key>`` (``key``
    from its size and mtime) unless that is there already. Blocking."""
    if entry.kind == "directory":
        if not entry.path.is_dir():
            raise ModelNotFound(f"model {entry.name}: {entry.path} no longer exists")
        return entry.path
    if entry.kind != "archive":
        raise ModelLoadError(
            f"model {entry.name}: {entry.url} is not a local file", model=entry.name
        )
    try:
        st = entry.path.stat()
    except FileNotFoundError:
        raise ModelNotFound(f"model {entry.name}: {entry.path} no longer exists") from None
    target = cache_dir / f"{file_stem(entry.name)}-{_cache_key(st)}"
    if target.is_dir():
        return model_root(target)
    return (unpack or unpack_archive)(entry.path, target, max_unpacked_bytes, entry.name)
