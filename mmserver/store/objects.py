"""Bodies at a location: an ``s3://bucket/key`` object or a local file (a path or a ``file://``
URL), read and written whole. Asynchronous inference reads its inputs and writes its answers
here, and so does a batch transform.

Objects are read and written with the model store's S3 client settings
(:func:`mmserver.store.client.make_client`: the endpoint, region and credentials from the usual AWS
variables and files), one client made on first use and shared by the threads that call (boto3's
clients are thread-safe). A body written appears whole or not at all: a local file is written
beside its place, synced, renamed into place and its folder synced; an object is one
``put_object`` (or one upload, in parts for a large file, that appears once complete).

Every method blocks: callers run them in threads. Failures are :class:`LocationError`, which
says whether nothing is there (``missing``) and whether the object store failed (``remote``),
for the caller to word in its own terms.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import stat
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mmserver.errors import MMServerError
from mmserver.store.urls import split_object_url

#: How :func:`write_whole` creates its temporary file (as ``open(path, "xb")`` does).
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC

#: The S3 error codes that say nothing is at a location.
NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchBucket"})


class LocationError(Exception):
    """A location that cannot be read or written, and why (``reason``). ``missing``: nothing
    is there; ``remote``: the object store failed or refused (a server-side trouble, not the
    caller's)."""

    def __init__(
        self, location: str, reason: str, *, missing: bool = False, remote: bool = False
    ) -> None:
        super().__init__(f"{location}: {reason}")
        self.location = location
        self.reason = reason
        self.missing = missing
        self.remote = remote


def is_object(location: str) -> bool:
    """Whether ``location`` names an object (``s3://``) rather than a local file."""
    return location[:5].lower() == "s3://"


def local_path(location: str) -> Path:
    """The path of a ``file://`` URL or a plain path. Raises :class:`LocationError` for a
    ``file://`` URL naming another host."""
    if location[:7].lower() == "file://":
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise LocationError(location, "only local file:// URLs are accepted")
        return Path(unquote(parts.path))
    return Path(location)


def bucket_key(location: str) -> tuple[str, str]:
    """``s3://bucket/key`` as ``(bucket, key)``, the key as written. Raises
    :class:`LocationError` for a malformed URL."""
    try:
        bucket, _ = split_object_url(location)
    except MMServerError as exc:
        raise LocationError(location, exc.message.replace("model store", "location")) from None
    return bucket, location.strip()[5:].partition("/")[2]


def error_code(exc: Any) -> str:
    """The S3 error code of a botocore ``ClientError``."""
    return str(exc.response.get("Error", {}).get("Code", ""))


@contextlib.contextmanager
def failures(location: str) -> Iterator[None]:
    """Reading or writing ``location``: boto3's and the file system's errors as
    :class:`LocationError`."""
    try:
        yield
    except Exception as exc:
        error = _location_error(location, exc)
        if error is None:
            raise
        raise error from None


def _location_error(location: str, exc: Exception) -> LocationError | None:
    # botocore is looked at only once something imported it: none of its errors is raised
    # before, and a job on local files does not pay its import (~8 ms of its start-up).
    boto = sys.modules.get("botocore.exceptions")
    if boto is not None and isinstance(exc, boto.ClientError):
        missing = error_code(exc) in NOT_FOUND
        return LocationError(location, str(exc), missing=missing, remote=not missing)
    if boto is not None and isinstance(exc, boto.BotoCoreError):
        return LocationError(location, str(exc), remote=True)
    if isinstance(exc, FileNotFoundError):
        return LocationError(location, "no such file", missing=True)
    if isinstance(exc, OSError):
        return LocationError(location, exc.strerror or str(exc))
    return None


class Objects:
    """Reads and writes whole bodies at locations (module docstring)."""

    def __init__(self, client: Any = None) -> None:
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The one S3 client, made on first use."""
        with self._lock:
            if self._client is None:
                from mmserver.store.client import make_client  # boto3 only for a use of S3

                self._client = make_client()
            return self._client

    def read(self, location: str) -> bytes:
        """The whole body at ``location``."""
        with failures(location):
            if is_object(location):
                bucket, key = bucket_key(location)
                return bytes(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
            return local_path(location).read_bytes()

    def read_unless_larger(self, location: str, most: int) -> bytes | int:
        """The whole body at ``location``, or its size when it is larger than ``most`` bytes
        (0: read it whatever its size). One call for an object: the body is not read when the
        answer's length is too large (its connection is dropped instead)."""
        with failures(location):
            if is_object(location):
                bucket, key = bucket_key(location)
                found = self.client.get_object(Bucket=bucket, Key=key)
                stream = found["Body"]
                try:
                    size = int(found["ContentLength"])
                    if most and size > most:
                        return size
                    return bytes(stream.read())
                finally:
                    stream.close()
            with open(local_path(location), "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if most and size > most:
                    return size
                return file.read()

    def open(self, location: str) -> Any:
        """A stream of the body at ``location`` (``read(n)``, ``close()``; the caller closes
        it)."""
        with failures(location):
            if is_object(location):
                bucket, key = bucket_key(location)
                return self.client.get_object(Bucket=bucket, Key=key)["Body"]
            return open(local_path(location), "rb")

    def exists(self, location: str) -> bool:
        """Whether a body is at ``location``."""
        try:
            with failures(location):
                if is_object(location):
                    bucket, key = bucket_key(location)
                    self.client.head_object(Bucket=bucket, Key=key)
                    return True
                return local_path(location).is_file()
        except LocationError as exc:
            if exc.missing:
                return False
            raise

    def write(self, location: str, body: bytes, content_type: str) -> None:
        """Write ``body`` at ``location`` whole: readers see all of it or nothing."""
        with failures(location):
            if is_object(location):
                bucket, key = bucket_key(location)
                self.client.put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)
                return
            write_whole(local_path(location), body)

    def put_file(self, location: str, staged: Path, content_type: str) -> None:
        """Move the body prepared in the file ``staged`` to ``location`` whole: a rename (the
        file must be in the folder of ``location``), or an upload (in parts for a large one;
        the object appears once complete). ``staged`` is gone afterwards."""
        from boto3.exceptions import S3UploadFailedError

        try:
            with failures(location):
                if is_object(location):
                    bucket, key = bucket_key(location)
                    try:
                        self.client.upload_file(
                            str(staged), bucket, key, ExtraArgs={"ContentType": content_type}
                        )
                    except S3UploadFailedError as exc:
                        raise LocationError(location, str(exc), remote=True) from None
                    return
                path = local_path(location)
                os.replace(staged, path)
                sync_folder(path.parent)
        finally:
            staged.unlink(missing_ok=True)

    def delete(self, location: str) -> None:
        """Remove the body at ``location``, if any."""
        with failures(location):
            if is_object(location):
                bucket, key = bucket_key(location)
                self.client.delete_object(Bucket=bucket, Key=key)
            else:
                local_path(location).unlink(missing_ok=True)

    def list(self, location: str) -> Iterator[tuple[str, int]]:
        """Every object whose key starts with the key prefix of ``location``
        (``s3://bucket/prefix``), as ``(s3:// URL, size)``, in key order; keys ending in ``/``
        (folder markers) left out."""
        bucket, prefix = bucket_key(location)
        with failures(location):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    key = str(item["Key"])
                    if not key.endswith("/"):
                        yield f"s3://{bucket}/{key}", int(item["Size"])


def write_whole(path: Path, body: bytes, folders: set[Path] | None = None) -> None:
    """Write the file ``path`` whole: a temporary file beside it (created with the mode the
    umask gives a new file), synced, renamed into place, the folder synced; or, with
    ``folders``, the folder added to it for the caller to sync (once for many renames)."""
    temporary = staging_beside(path)
    try:
        try:
            fd = os.open(temporary, _NEW_FILE, 0o666)
        except FileNotFoundError:  # the folder is made when missing, not looked at each time
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temporary, _NEW_FILE, 0o666)
        _write_synced(fd, body)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if folders is None:
        sync_folder(path.parent)
    else:
        folders.add(path.parent)


def write_synced(path: Path, body: bytes) -> None:
    """Write the new file ``path`` (or over the one there) and sync it; its folder is the
    caller's to sync. For a file under a name nobody reads until it is recorded; one read
    meanwhile goes by :func:`write_whole`."""
    _write_synced(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666), body)


def _write_synced(fd: int, body: bytes) -> None:
    """Write ``body`` to the open file ``fd``, sync it and close it: the system calls alone (no
    buffered file object: its own calls cost as much as the writing of a small answer)."""
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_beside(path: Path) -> Path:
    """A name for a temporary file in the folder of ``path`` (hidden, unique: created with
    ``O_EXCL``, it is never another's): ``.<name>.<12 hex digits>.part``, the name cut to
    :data:`_STEM_BYTES` so that the whole stays within a file system's 255 bytes."""
    return path.with_name(f".{_stem(path.name)}.{random.getrandbits(48):012x}.part")


def remove_staged(paths: Iterable[Path], before: float) -> int:
    """Remove the temporary files :func:`staging_beside` named for any of ``paths`` and last
    written before ``before`` (a :func:`time.time`): what a process killed while writing them
    left behind. How many; one listing per folder."""
    stems: dict[Path, set[str]] = {}
    for path in paths:
        stems.setdefault(path.parent, set()).add(_stem(path.name))
    removed = 0
    for folder, wanted in stems.items():
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    found = _STAGED.fullmatch(entry.name)
                    if found is None or found["stem"] not in wanted:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(info.st_mode) and info.st_mtime < before:
                            os.unlink(entry.path)
                            removed += 1
        except (FileNotFoundError, NotADirectoryError):
            continue
    return removed


#: The longest part of a file's name that its staging file's name keeps, in bytes.
_STEM_BYTES = 200
#: The names :func:`staging_beside` gives.
_STAGED = re.compile(r"\.(?P<stem>.+)\.[0-9a-f]{12}\.part", re.DOTALL)


def _stem(name: str) -> str:
    encoded = name.encode(errors="surrogateescape")
    if len(encoded) <= _STEM_BYTES:
        return name
    return encoded[:_STEM_BYTES].decode(errors="ignore")


def sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
