"""The model store: a directory of models, each a folder ``NAME/`` or an archive ``NAME.tar.gz``.

The store only lists entries and unpacks archives; it never loads a model. Archives are unpacked
into a cache directory, once per archive version, with every member checked first: no absolute
paths, no ``..``, no links leaving the archive, no device files, at most :data:`MAX_MEMBERS`
members and at most ``max_unpacked_bytes`` in total. Nothing is ever written outside the cache.

:class:`ModelSource` is what the WorkLoadManager needs of a store; :class:`ModelStore` (a local
directory) and :class:`mmserver.objectstore.ObjectStore` (``s3://bucket/prefix``) provide it, and
both unpack with :func:`unpack_archive`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Protocol
from urllib.parse import unquote, urlsplit

from mmserver.errors import (
    ConfigError,
    Forbidden,
    InvalidInput,
    InvalidModelName,
    ModelLoadError,
    ModelNotFound,
    UnsafeArchive,
)

log = logging.getLogger(__name__)

MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
MAX_MEMBERS = 10_000
#: The largest extended header (a GNU long name or link, a pax header) read from an archive:
#: tarfile reads one whole into memory before any member check, so a small compressed archive
#: could otherwise declare gigabytes of header. Real ones are a few hundred bytes.
MAX_HEADER_BYTES = 64 * 1024
_CHUNK = 1 << 20
# A directory entry walk stops counting here: the size only feeds the memory estimate, and a
# store folder with more files than this is not a model anyway.
_MAX_DIR_FILES = 10_000


def is_model_name(base: str) -> bool:
    """Whether ``base`` is a model name: it matches :data:`MODEL_NAME_RE` and does not itself end
    with ``.tar.gz``/``.tgz`` (else ``NAME.tar.gz`` would name two models: ``NAME`` and itself)."""
    return MODEL_NAME_RE.fullmatch(base) is not None and not base.endswith(ARCHIVE_SUFFIXES)


def normalize_name(name: str) -> str:
    """The model name for ``name``: a trailing ``.tar.gz``/``.tgz`` is dropped, then the result
    must be a model name (:func:`is_model_name`). Checked before any file-system access."""
    if not isinstance(name, str):
        raise InvalidModelName(f"model name must be a string, not {type(name).__name__}")
    base = name
    for suffix in ARCHIVE_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    if not is_model_name(base):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidModelName(
            f"invalid model name {shown!r}: a name is 1 to 128 characters of letters, digits, "
            "'.', '_' and '-', starting with a letter or digit, optionally followed by one "
            ".tar.gz or .tgz"
        )
    return base


@dataclass(frozen=True)
class StoreEntry:
    """One model of the store: a directory of files, an archive to unpack, or an archive object
    of an object store (``path`` is then where its unpacked copy goes in the local cache)."""

    name: str
    path: Path
    kind: Literal["directory", "archive", "object"]
    size_bytes: int
    #: The object's ``s3://`` URL and version (its ETag), for an entry of an object store.
    object_url: str | None = None
    etag: str | None = None

    @property
    def url(self) -> str:
        """Where the model comes from, as shown to users: the object URL or the local path."""
        return self.object_url or str(self.path)


#: Unpacks an archive into a cache folder and returns the model's directory: the signature of
#: :func:`unpack_archive` (archive, target folder, byte limit, model name). Blocking.
Unpacker = Callable[[Path, Path, int, str], Path]


class ModelSource(Protocol):
    """What the WorkLoadManager needs of a model store.

    :meth:`list`, :meth:`find` and :meth:`prepare` may block (on disk or network I/O): callers
    run them in threads, several at once. Their errors are :class:`mmserver.errors.MMServerError`
    confined to the model asked for, or :class:`mmserver.errors.ServiceUnavailable` when the
    store itself cannot be reached.
    """

    @property
    def root(self) -> Path | str:
        """The store's location, for messages: a directory or an ``s3://`` URL."""
        ...

    def list(self) -> list[StoreEntry]:
        """Every model of the store, sorted by name, without downloading or unpacking any."""
        ...

    def find(self, name: str) -> StoreEntry | None:
        """The current entry of model ``name`` (``NAME`` or ``NAME.tar.gz``), or ``None``."""
        ...

    def scan(self) -> Sequence[tuple[str, str]]:
        """``(name, suffix)`` of every model, sorted by name, for the store index
        (:class:`mmserver.storeindex.IndexSource`)."""
        ...

    def version(self) -> tuple[Hashable, float] | None:
        """A token that changes when the listing may have, and when; ``None``: no such token."""
        ...

    def url_of(self, name: str, suffix: str) -> str:
        """The url of the entry ``name + suffix``, as :attr:`StoreEntry.url` shows it."""
        ...

    def entry_for_path(self, path: Path, name: str) -> StoreEntry:
        """An entry for a model registered from a local path inside the allowed roots."""
        ...

    def prepare(self, entry: StoreEntry) -> Path:
        """The local directory holding the entry's files, fetched and unpacked if needed."""
        ...

    #: What :meth:`prepare` unpacks archives with: :func:`unpack_archive` in the calling
    #: thread by default; the server hands this to processes of their own (:mod:`unpacking`).
    unpack: Unpacker

    def remove_unpacked(self, name: str) -> None:
        """Delete the cached copies of model ``name`` (best effort)."""
        ...


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
        (:mod:`mmserver.storeindex`): the rules of :meth:`list` without measuring sizes (a
        folder counts once a file is found in it)."""
        return scan_directory(self.root, self._is_cache, self._links_out)

    def version(self) -> tuple[Hashable, float] | None:
        """The store directory's modification time (it changes when an entry is added, removed
        or renamed), and that time on the wall clock."""
        return directory_version(self.root)

    def url_of(self, name: str, suffix: str) -> str:
        return os.path.join(self._root_text, name + suffix)

    def find(self, name: str) -> StoreEntry | None:
        """The entry for ``name`` (``sklearn-7`` or ``sklearn-7.tar.gz``), looked up now, so an
        entry added while the server runs is found. Raises :class:`InvalidModelName`."""
        base = normalize_name(name)
        folder = self.root / base
        if folder.is_dir() and not self._is_cache(str(folder)):
            if self._links_out(str(folder)):
                raise self._refuse_link(base)
            size = _dir_size(folder)
            if size is not None:
                return StoreEntry(base, folder, "directory", size)
        for suffix in ARCHIVE_SUFFIXES:
            path = self.root / (base + suffix)
            try:
                st = path.stat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                if self._links_out(str(path)):
                    raise self._refuse_link(base)
                return StoreEntry(base, path, "archive", st.st_size)
        return None

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
        base = normalize_name(name)
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
        raise ModelLoadError(f"model {entry.name}: {entry.url} is not a local file")
    try:
        st = entry.path.stat()
    except FileNotFoundError:
        raise ModelNotFound(f"model {entry.name}: {entry.path} no longer exists") from None
    target = cache_dir / f"{entry.name}-{_cache_key(st)}"
    if target.is_dir():
        return model_root(target)
    return (unpack or unpack_archive)(entry.path, target, max_unpacked_bytes, entry.name)


def unpack_archive(archive: Path, target: Path, max_unpacked_bytes: int, name: str) -> Path:
    """Unpack ``archive`` into the folder ``target`` (in the cache) unless it exists already,
    and return the model's directory in it. Blocking.

    Every member is checked before anything is written (see the module docstring). The archive
    is unpacked into a temporary folder beside ``target`` and renamed into place, so a reader
    never sees a partial copy and two processes racing both end up with the same complete one.
    """
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
        try:
            _safe_extract(archive, tmp, max_unpacked_bytes, name)
            tmp.chmod(0o755)
            try:
                os.rename(tmp, target)
            except OSError:
                # Another process renamed its copy first; use that one.
                if not target.is_dir():
                    raise
            else:
                log.debug("model %s: unpacked %s into %s", name, archive, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model_root(target)


_OBJECT_URL = re.compile(r"s3://([^/]*)(?:/(.*))?", re.IGNORECASE | re.DOTALL)
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def split_object_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as ``(bucket, prefix)``; the prefix is empty or ends with ``/``.
    Raises :class:`ConfigError`."""
    match = _OBJECT_URL.fullmatch(url.strip())
    if match is None:
        raise ConfigError(f"model store {url!r} is not an s3://bucket/prefix URL")
    bucket, prefix = match.group(1), (match.group(2) or "").rstrip("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"model store {url!r}: {bucket!r} is not a valid bucket name")
    if "\x00" in prefix:
        raise ConfigError(f"model store {url!r}: the prefix holds a NUL character")
    return bucket, prefix + "/" if prefix else ""


def archive_name(filename: str) -> str | None:
    """The model name of an archive file name (``NAME.tar.gz`` or ``NAME.tgz``), or ``None``."""
    for suffix in ARCHIVE_SUFFIXES:
        if filename.endswith(suffix):
            base = filename[: -len(suffix)]
            return base if is_model_name(base) else None
    return None


def model_root(unpacked: Path) -> Path:
    """``unpacked`` itself, or its only entry when the archive held a single top-level folder."""
    children = list(unpacked.iterdir())
    if len(children) == 1 and children[0].is_dir() and not children[0].is_symlink():
        return children[0]
    return unpacked


def _member_path(member: tarfile.TarInfo, what: str) -> str:
    """The normalised relative path of a member; refuses absolute paths and ``..``."""
    # A backslash is a separator to some packers; treat it as one so it cannot hide a "..".
    name = member.name.replace("\\", "/")
    if name.startswith("/"):
        raise UnsafeArchive(f"{what}: member {shown(member.name)} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"{what}: member {shown(member.name)} leaves the archive ('..')")
    return "/".join(parts)


def _check_members(tar: tarfile.TarFile, limit: int, what: str) -> list[tarfile.TarInfo]:
    """Read every member header and refuse the archive before anything is written."""
    members: list[tarfile.TarInfo] = []
    declared = 0
    for member in tar:
        if len(members) >= MAX_MEMBERS:
            raise UnsafeArchive(f"{what}: more than {MAX_MEMBERS} members")
        path = _member_path(member, what)
        if member.ischr() or member.isblk() or member.isfifo():
            raise UnsafeArchive(f"{what}: member {shown(member.name)} is a device or fifo")
        if member.issym() or member.islnk():
            _link_source(member, path, what)  # refuses a link leaving the archive
        elif not (member.isreg() or member.isdir()):
            raise UnsafeArchive(f"{what}: member {shown(member.name)} has an unsupported type")
        if member.isreg():
            declared += member.size
            if declared > limit:
                raise UnsafeArchive(
                    f"{what}: unpacked size exceeds the limit of {limit} bytes "
                    f"(at member {shown(member.name)}, {member.size} bytes)"
                )
        members.append(member)
    return members


def _link_source(member: tarfile.TarInfo, path: str, what: str) -> str:
    """The archive path a link refers to; refused when it leaves the archive. Links are never
    created on disk: a link to a file of the archive is unpacked as a copy of that file."""
    target = member.linkname.replace("\\", "/")
    kind = "symbolic link" if member.issym() else "hard link"
    if target.startswith("/"):
        raise UnsafeArchive(
            f"{what}: member {shown(member.name)} is a {kind} to {shown(member.linkname)} "
            "outside the archive"
        )
    # A symbolic link is relative to its folder; a hard link to the archive root.
    base = posixpath.dirname(path) if member.issym() else ""
    joined = posixpath.normpath(posixpath.join(base, target))
    if joined in (".", ""):
        raise UnsafeArchive(
            f"{what}: member {shown(member.name)} is a {kind} to the archive's top folder"
        )
    if joined == ".." or joined.startswith("../"):
        raise UnsafeArchive(
            f"{what}: member {shown(member.name)} is a {kind} to {shown(member.linkname)} "
            "outside the archive"
        )
    return joined


class _BoundedTarInfo(tarfile.TarInfo):
    """A member header that refuses an extended header (long name or link, pax) larger than
    :data:`MAX_HEADER_BYTES` before tarfile reads it into memory."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED_HEADERS and self.size > MAX_HEADER_BYTES:
            raise UnsafeArchive(
                f"an extended header (long name or pax) of {self.size} bytes, over the limit "
                f"of {MAX_HEADER_BYTES}"
            )
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member


_EXTENDED_HEADERS = frozenset(
    {
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
    }
)


def shown(name: str, limit: int = 160) -> str:
    """``name`` quoted, and shortened in the middle past ``limit`` characters (error messages
    and log lines quote member names an archive chose)."""
    text = repr(name)
    if len(text) <= limit:
        return text
    half = (limit - 20) // 2
    return f"{text[:half]}...({len(name)} characters)...{text[-half:]}"


def _safe_extract(archive: Path, dest: Path, limit: int, name: str) -> None:
    what = f"model {name}: archive {archive.name}"
    try:
        with tarfile.open(archive, "r:gz", tarinfo=_BoundedTarInfo) as tar:
            members = _check_members(tar, limit, what)
            _extract(tar, members, dest, limit, what)
    except UnsafeArchive as exc:
        if exc.message.startswith(what):
            raise
        raise UnsafeArchive(f"{what}: {exc.message}") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        if isinstance(exc, FileNotFoundError) and exc.filename == str(archive):
            raise ModelNotFound(f"model {name}: {archive.name} no longer exists") from None
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ModelLoadError(f"{what} cannot be unpacked: {type(exc).__name__}: {reason}") from None


def _extract(
    tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path, limit: int, what: str
) -> None:
    written = 0
    files: dict[str, Path] = {}
    root = str(dest)
    for member in members:
        rel = _member_path(member, what)
        if not rel:
            continue
        out = Path(root, rel)
        if member.isdir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if member.issym() or member.islnk():
            source = files.get(_link_source(member, rel, what))
            if source is None:
                raise UnsafeArchive(
                    f"{what}: member {shown(member.name)} links to {shown(member.linkname)}, "
                    "which is not a file earlier in the archive"
                )
            with open(source, "rb") as src:
                written = _write(src, out, written, limit, what, member, 0o644)
        else:
            src_obj = tar.extractfile(member)
            if src_obj is None:  # pragma: no cover - regular members always have data
                raise UnsafeArchive(f"{what}: member {shown(member.name)} has no data")
            mode = 0o755 if member.mode & 0o111 else 0o644
            with src_obj:
                written = _write(src_obj, out, written, limit, what, member, mode)
        files[rel] = out


def _write(
    src: IO[bytes],
    out: Path,
    written: int,
    limit: int,
    what: str,
    member: tarfile.TarInfo,
    mode: int,
) -> int:
    # O_NOFOLLOW: never write through a link; none are created, this is the second lock.
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as dst:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > limit:
                raise UnsafeArchive(
                    f"{what}: unpacked size exceeds the limit of {limit} bytes "
                    f"(while unpacking member {shown(member.name)})"
                )
            dst.write(chunk)
    return written


# ------------------------------------------------------------------------------------------------
# Model URLs of the management API
# ------------------------------------------------------------------------------------------------

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")

#: The extensions DJL Serving drops from an archive's name to name its model, in the order it
#: tries them (``ai.djl.repository.FilenameUtils.getNamePart``; only ``.tar.gz`` in any case).
_DJL_EXTENSIONS = (".tar.z", ".tgz", ".zip", ".tar", ".mar", ".gz", ".z")
_NON_WORD = re.compile(r"\W", re.ASCII)


def name_from_url(url: str) -> str:
    """The name DJL Serving gives a model registered from ``url`` without ``model_name``
    (``ModelInfo.inferModelNameFromUrl``): the last segment of the url's path, less its archive
    extension unless the url ends with ``/``, with each character that is not an ASCII letter,
    digit or ``_`` replaced by ``_`` (``my-model.tar.gz`` names ``my_model``)."""
    path = unquote(urlsplit(url.strip()).path)
    directory = path.endswith("/")
    name = path.rstrip("/").rpartition("/")[2] if directory else path.rpartition("/")[2]
    if not directory:
        if name.lower().endswith(".tar.gz"):
            name = name[: -len(".tar.gz")]
        else:
            for extension in _DJL_EXTENSIONS:
                if name.endswith(extension):
                    name = name[: -len(extension)]
                    break
    return _NON_WORD.sub("_", name)


def resolve_model_url(url: str, allowed_roots: Sequence[Path]) -> Path:
    """The local path named by ``url`` (a path or a ``file://`` URL; relative paths are taken
    from the first root), which must be a folder or a ``.tar.gz``/``.tgz`` inside one of
    ``allowed_roots`` once symbolic links are resolved. No other scheme is accepted."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput("model url is empty: give a local path under the allowed model roots")
    if not allowed_roots:
        raise Forbidden("no model roots are allowed on this server")
    url = url.strip()
    scheme = _SCHEME.match(url)
    if scheme is not None:
        if scheme.group(1).lower() != "file":
            raise InvalidInput(
                f"model url {url!r}: scheme {scheme.group(1)!r} is not supported; only local "
                "paths under the allowed model roots are accepted"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidInput(
                f"model url {url!r}: only local paths under the allowed model roots are accepted"
            )
        raw = unquote(parts.path)
    else:
        raw = url
    if "\x00" in raw:
        raise InvalidInput(f"model url {url!r} is not a valid path")
    roots = [Path(r).resolve() for r in allowed_roots]
    path = Path(raw)
    if not path.is_absolute():
        path = roots[0] / path
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        raise Forbidden(
            f"model url {url!r} is outside the allowed model roots "
            f"({', '.join(str(r) for r in roots)}); put the model there or add its directory "
            "to allowed_model_roots"
        )
    if resolved in roots:
        raise InvalidInput(f"model url {url!r} names a model root itself, not a model in it")
    if not resolved.exists():
        raise ModelNotFound(f"model url {url!r}: {resolved} does not exist")
    if resolved.is_dir():
        return resolved
    if resolved.is_file() and resolved.name.endswith(ARCHIVE_SUFFIXES):
        return resolved
    raise InvalidInput(
        f"model url {url!r}: {resolved} must be a directory or a .tar.gz/.tgz archive"
    )
