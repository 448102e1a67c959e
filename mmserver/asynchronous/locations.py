"""Where asynchronous requests' bodies come from and their answers go: ``s3://`` objects and
local files (``file://`` URLs or paths), read and written by :class:`~mmserver.store.objects.
Objects` (the model store's S3 client settings; answers whole or not at all).

An input must name an object, or a file under the folders the server allows
(``allowed_model_roots`` and ``async_input_roots``): :meth:`Locations.check_input` refuses any
other before the request is queued. Every method but :meth:`check_input` and :meth:`join` blocks
(the caller runs them in threads).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mmserver.errors import InputMissing, InvalidInput, MMServerError, ServiceUnavailable
from mmserver.store.objects import (
    LocationError,
    Objects,
    failures,
    is_object,
    remove_staged,
    staging_beside,
    write_whole,
)
from mmserver.store.objects import local_path as _local_path
from mmserver.store.urls import split_object_url

#: Folders whose resolution :meth:`Locations.join` keeps.
_FOLDERS = 1024


def local_path(location: str) -> Path:
    """The path of a ``file://`` URL or a plain path."""
    try:
        return _local_path(location)
    except LocationError as exc:
        raise InvalidInput(f"location {location!r}: {exc.reason}") from None


def file_url(path: Path) -> str:
    return path.resolve().as_uri()


class Locations:
    """Reads inputs and writes answers for asynchronous inference."""

    def __init__(self, input_roots: Sequence[Path], client: Any = None) -> None:
        self.input_roots = tuple(Path(r).resolve() for r in input_roots)
        #: The roots as strings, themselves and as folders (ending in a separator).
        self._root_paths = frozenset(str(r) for r in self.input_roots)
        self._root_folders = tuple(os.path.join(str(r), "") for r in self.input_roots)
        self.objects = Objects(client)
        #: The file URLs of the folders answers go to, by how the configuration names them.
        self._folders: dict[str, str] = {}

    def check_input(self, location: str) -> str:
        """The input ``location`` as it is stored: an ``s3://bucket/key`` URL as given, a local
        file as a ``file://`` URL of its resolved path, which must be under an allowed folder.
        Raises :class:`InvalidInput` (400) for any other."""
        location = location.strip()
        if not location:
            raise InvalidInput(
                "the request names no input: set X-Amzn-SageMaker-InputLocation "
                "(boto3: InputLocation=...) or send the body inline"
            )
        if is_object(location):
            try:
                _, key = split_object_url(location)
            except MMServerError as exc:
                raise InvalidInput(f"input location: {exc.message}") from None
            if not key:
                raise InvalidInput(f"input location {location!r} names a bucket, not an object")
            return location
        lowered = location.lower()
        if "://" in location and not lowered.startswith("file://"):
            raise InvalidInput(
                f"input location {location[:200]!r}: only s3:// and file:// locations are accepted"
            )
        path = local_path(location)
        if "\x00" in str(path) or not path.is_absolute():
            raise InvalidInput(f"input location {location[:200]!r} is not an absolute path")
        # One resolution, on strings: this runs for every request accepted.
        resolved = os.path.realpath(path)
        if not any(resolved.startswith(folder) for folder in self._root_folders) and (
            resolved not in self._root_paths
        ):
            allowed = ", ".join(str(r) for r in self.input_roots) or "none"
            raise InvalidInput(
                f"input location {location[:200]!r} is outside the folders inputs may be read "
                f"from ({allowed}); add its folder to async_input_roots"
            )
        return Path(resolved).as_uri()

    def join(self, base: str, name: str) -> str:
        """The location of ``name`` (a relative path) in the folder or prefix ``base``."""
        base = base.strip()
        if is_object(base):
            return base.rstrip("/") + "/" + name
        folder = self._folders.get(base)
        if folder is None:
            # Resolved once per folder: a resolution takes a system call per folder above.
            if len(self._folders) >= _FOLDERS:
                self._folders.clear()
            folder = self._folders[base] = file_url(local_path(base))
        return folder.rstrip("/") + "/" + quote(name)

    def read_unless_larger(self, location: str, most: int) -> bytes | int:
        """The whole body at ``location``, or its size when it is larger than ``most`` bytes (0:
        read it whatever its size): one call to the object store. Raises :class:`InputMissing`
        when there is none, and :class:`ServiceUnavailable` when the object store cannot be
        reached."""
        with _reading(location):
            return self.objects.read_unless_larger(location, most)

    def open(self, location: str) -> Any:
        """A stream of the input at ``location`` (``read(n)``, ``close()``)."""
        with _reading(location):
            return self.objects.open(location)

    @staticmethod
    def staging(location: str, folder: Path) -> Path:
        """Where to prepare the answer that goes to ``location``: beside it for a local file
        (so that it is renamed into place), in ``folder`` for an object."""
        target = _staged_for(location, folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        return staging_beside(target)

    @staticmethod
    def remove_staged(locations: Iterable[str], folder: Path, before: float) -> int:
        """Remove what killed writes left where :meth:`staging` prepares answers, in files last
        written before ``before`` (a :func:`time.time`): beside the local files of
        ``locations``, and every answer for an object in ``folder`` (the server's own). How
        many. Raises ``OSError``."""
        targets = {_staged_for(location, folder) for location in locations}
        targets.add(folder / _FOR_AN_OBJECT)
        return remove_staged(targets, before)

    def put_file(self, location: str, staged: Path, content_type: str) -> None:
        """Move the answer prepared at ``staged`` (:meth:`staging`) to ``location`` whole: a
        rename, or an upload (in parts for a large one; the object appears once complete)."""
        with _writing(location):
            self.objects.put_file(location, staged, content_type)

    def write(self, location: str, body: bytes, content_type: str) -> None:
        """Write ``body`` at ``location`` whole: readers see all of it or nothing."""
        with _writing(location):
            self.objects.write(location, body, content_type)

    @staticmethod
    def is_local(location: str) -> bool:
        """Whether ``location`` is a local file (not an object)."""
        return not is_object(location)

    def write_local(self, location: str, body: bytes, folders: set[Path]) -> None:
        """Write ``body`` at the local file ``location`` whole, as :meth:`write` does, but
        add its folder to ``folders`` instead of syncing it: the caller syncs it, once for
        every answer renamed into it meanwhile."""
        with _writing(location), failures(location):
            write_whole(local_path(location), body, folders)

    @staticmethod
    def read_small(location: str, most: int) -> bytes | None:
        """The body of the local file ``location`` if it has at most ``most`` bytes; ``None``
        for a larger one, an object, anything but a plain file, or one that cannot be read
        (:meth:`read_unless_larger` then says why)."""
        if is_object(location):
            return None
        try:
            # Not held by a pipe's opening (O_NONBLOCK does nothing to a file's reads).
            fd = os.open(local_path(location), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (OSError, InvalidInput):
            return None
        try:  # the system calls alone: a buffered file object makes as many again
            found = os.fstat(fd)
            size = found.st_size
            if not stat.S_ISREG(found.st_mode) or size > most:
                return None
            body = os.read(fd, size + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        return body if len(body) == size else None  # changed meanwhile: read it whole later

    def exists(self, location: str) -> bool:
        """Whether something is written at ``location``."""
        try:
            return self.objects.exists(location)
        except LocationError as exc:
            raise ServiceUnavailable(f"{location} cannot be read: {exc.reason}") from None


#: The name answers for objects are prepared under in the staging folder (each in a file of
#: its own: :func:`staging_beside`).
_FOR_AN_OBJECT = "answer"


def _staged_for(location: str, folder: Path) -> Path:
    """What :meth:`Locations.staging` prepares the answer to ``location`` beside."""
    return folder / _FOR_AN_OBJECT if is_object(location) else local_path(location)


@contextlib.contextmanager
def _reading(location: str) -> Iterator[None]:
    """Reading the input at ``location``: its errors as :class:`InputMissing` (no such input,
    or a local one that cannot be read) or :class:`ServiceUnavailable` (the object store)."""
    try:
        yield
    except LocationError as exc:
        if exc.missing:
            raise InputMissing(f"the input {location} does not exist") from None
        if exc.remote:
            raise ServiceUnavailable(f"the input {location} cannot be read: {exc.reason}") from None
        raise InputMissing(f"the input {location} cannot be read: {exc.reason}") from None


@contextlib.contextmanager
def _writing(location: str) -> Iterator[None]:
    """Writing an answer at ``location``: the object store's errors as
    :class:`ServiceUnavailable`, a local file's as :class:`MMServerError` (500)."""
    try:
        yield
    except LocationError as exc:
        kind = ServiceUnavailable if exc.remote or exc.missing else MMServerError
        raise kind(f"{location} cannot be written: {exc.reason}") from None
