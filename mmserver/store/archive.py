"""Safe unpacking of model archives (``.tar.gz``/``.tgz``) into the cache.

Every member is checked before anything is written: no absolute paths, no ``..``, no links
leaving the archive, no device files, at most :data:`MAX_MEMBERS` members, no extended header
over :data:`MAX_HEADER_BYTES`, and at most ``max_unpacked_bytes`` in total. Links are never
created on disk (a link to a file of the archive is unpacked as a copy of it), and nothing is
ever written outside the cache. Both stores unpack with :func:`unpack_archive`.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path
from typing import IO

from mmserver.errors import ModelLoadError, ModelNotFound, UnsafeArchive
from mmserver.store.names import file_stem

log = logging.getLogger(__name__)

MAX_MEMBERS = 10_000
#: The largest extended header (a GNU long name or link, a pax header) read from an archive:
#: tarfile reads one whole into memory before any member check, so a small compressed archive
#: could otherwise declare gigabytes of header. Real ones are a few hundred bytes.
MAX_HEADER_BYTES = 64 * 1024
_CHUNK = 1 << 20


def unpack_archive(archive: Path, target: Path, max_unpacked_bytes: int, name: str) -> Path:
    """Unpack ``archive`` into the folder ``target`` (in the cache) unless it exists already,
    and return the model's directory in it. Blocking.

    Every member is checked before anything is written (see the module docstring). The archive
    is unpacked into a temporary folder beside ``target`` and renamed into place, so a reader
    never sees a partial copy and two processes racing both end up with the same complete one.
    """
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        stem = file_stem(name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{stem}-", dir=target.parent))
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


def model_root(unpacked: Path) -> Path:
    """``unpacked`` itself, or its only entry when the archive held a single top-level folder."""
    children = list(unpacked.iterdir())
    if len(children) == 1 and children[0].is_dir() and not children[0].is_symlink():
        return children[0]
    return unpacked


def _member_path(member: tarfile.TarInfo) -> str:
    """The normalised relative path of a member; refuses absolute paths and ``..``."""
    # A backslash is a separator to some packers; treat it as one so it cannot hide a "..".
    name = member.name.replace("\\", "/")
    if name.startswith("/"):
        raise UnsafeArchive(f"member {shown(member.name)} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"member {shown(member.name)} leaves the archive ('..')")
    return "/".join(parts)


def _check_members(tar: tarfile.TarFile, limit: int) -> list[tarfile.TarInfo]:
    """Read every member header and refuse the archive before anything is written."""
    members: list[tarfile.TarInfo] = []
    declared = 0
    for member in tar:
        if len(members) >= MAX_MEMBERS:
            raise UnsafeArchive(f"more than {MAX_MEMBERS} members")
        path = _member_path(member)
        if member.ischr() or member.isblk() or member.isfifo():
            raise UnsafeArchive(f"member {shown(member.name)} is a device or fifo")
        if member.issym() or member.islnk():
            _link_source(member, path)  # refuses a link leaving the archive
        elif not (member.isreg() or member.isdir()):
            raise UnsafeArchive(f"member {shown(member.name)} has an unsupported type")
        if member.isreg():
            declared += member.size
            if declared > limit:
                raise UnsafeArchive(
                    f"unpacked size exceeds the limit of {limit} bytes "
                    f"(at member {shown(member.name)}, {member.size} bytes)"
                )
        members.append(member)
    return members


def _link_source(member: tarfile.TarInfo, path: str) -> str:
    """The archive path a link refers to; refused when it leaves the archive. Links are never
    created on disk: a link to a file of the archive is unpacked as a copy of that file."""
    target = member.linkname.replace("\\", "/")
    kind = "symbolic link" if member.issym() else "hard link"
    if target.startswith("/"):
        raise UnsafeArchive(
            f"member {shown(member.name)} is a {kind} to {shown(member.linkname)} "
            "outside the archive"
        )
    # A symbolic link is relative to its folder; a hard link to the archive root.
    base = posixpath.dirname(path) if member.issym() else ""
    joined = posixpath.normpath(posixpath.join(base, target))
    if joined in (".", ""):
        raise UnsafeArchive(f"member {shown(member.name)} is a {kind} to the archive's top folder")
    if joined == ".." or joined.startswith("../"):
        raise UnsafeArchive(
            f"member {shown(member.name)} is a {kind} to {shown(member.linkname)} "
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
            members = _check_members(tar, limit)
            _extract(tar, members, dest, limit)
    except UnsafeArchive as exc:
        raise UnsafeArchive(f"{what}: {exc.message}", model=name) from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        if isinstance(exc, FileNotFoundError) and exc.filename == str(archive):
            raise ModelNotFound(
                f"model {name}: {archive.name} no longer exists", model=name
            ) from None
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ModelLoadError(
            f"{what} cannot be unpacked: {type(exc).__name__}: {reason}", model=name
        ) from None


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path, limit: int) -> None:
    written = 0
    files: dict[str, Path] = {}
    root = str(dest)
    for member in members:
        rel = _member_path(member)
        if not rel:
            continue
        out = Path(root, rel)
        if member.isdir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if member.issym() or member.islnk():
            source = files.get(_link_source(member, rel))
            if source is None:
                raise UnsafeArchive(
                    f"member {shown(member.name)} links to {shown(member.linkname)}, "
                    "which is not a file earlier in the archive"
                )
            with open(source, "rb") as src:
                written = _write(src, out, written, limit, member, 0o644)
        else:
            src_obj = tar.extractfile(member)
            if src_obj is None:  # pragma: no cover - regular members always have data
                raise UnsafeArchive(f"member {shown(member.name)} has no data")
            mode = 0o755 if member.mode & 0o111 else 0o644
            with src_obj:
                written = _write(src_obj, out, written, limit, member, mode)
        files[rel] = out


def _write(
    src: IO[bytes],
    out: Path,
    written: int,
    limit: int,
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
                    f"unpacked size exceeds the limit of {limit} bytes "
                    f"(while unpacking member {shown(member.name)})"
                )
            dst.write(chunk)
    return written
