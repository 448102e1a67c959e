"""Where asynchronous requests' bodies come from and their answers go: ``s3://`` objects
(read and written with the model store's S3 client settings, :func:`mmserver.store.s3.make_client`)
and local files (``file://`` URLs or paths).

An input must name an object, or a file under the folders the server allows
(``allowed_model_roots`` and ``async_input_roots``): :meth:`Locations.check_input` refuses any
other before the request is queued. An answer appears whole or not at all: a local one is
written to a temporary file beside it, synced, then renamed into place; an object is one
``put_object``. Every method but :meth:`check_input` and :meth:`join` blocks (the caller runs
them in threads; the one S3 client is thread-safe).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError

from mmserver.errors import InputMissing, InvalidInput, MMServerError, ServiceUnavailable
from mmserver.store import split_object_url
from mmserver.store.s3 import make_client

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchBucket"})
#: Folders whose resolution :meth:`Locations.join` keeps.
_FOLDERS = 1024


def is_object(location: str) -> bool:
    return location[:5].lower() == "s3://"


def local_path(location: str) -> Path:
    """The path of a ``file://`` URL or a plain path."""
    if location[:7].lower() == "file://":
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise InvalidInput(f"location {location!r}: only local file:// URLs are accepted")
        return Path(unquote(parts.path))
    return Path(location)


def file_url(path: Path) -> str:
    return path.resolve().as_uri()


class Locations:
    """Reads inputs and writes answers for asynchronous inference."""

    def __init__(self, input_roots: Sequence[Path], client: Any = None) -> None:
        self.input_roots = tuple(Path(r).resolve() for r in input_roots)
        self._client = client
        self._lock = threading.Lock()
        #: The file URLs of the folders answers go to, by how the configuration names them.
        self._folders: dict[str, str] = {}

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = make_client()
            return self._client

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
        resolved = path.resolve()
        if not any(resolved.is_relative_to(root) for root in self.input_roots):
            allowed = ", ".join(str(r) for r in self.input_roots) or "none"
            raise InvalidInput(
                f"input location {location[:200]!r} is outside the folders inputs may be read "
                f"from ({allowed}); add its folder to async_input_roots"
            )
        return file_url(resolved)

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

    def read(self, location: str) -> bytes:
        """The whole body at ``location``. Raises :class:`InputMissing` when there is none, and
        :class:`ServiceUnavailable` when the object store cannot be reached."""
        with _reading(location):
            if is_object(location):
                bucket, key = _bucket_key(location)
                return bytes(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
            return local_path(location).read_bytes()

    def size(self, location: str) -> int:
        """The size in bytes of the input at ``location`` (:class:`InputMissing` if none)."""
        with _reading(location):
            if is_object(location):
                bucket, key = _bucket_key(location)
                return int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
            return local_path(location).stat().st_size

    def open(self, location: str) -> Any:
        """A stream of the input at ``location`` (``read(n)``, ``close()``)."""
        with _reading(location):
            if is_object(location):
                bucket, key = _bucket_key(location)
                return self.client.get_object(Bucket=bucket, Key=key)["Body"]
            return open(local_path(location), "rb")  # the caller closes it

    @staticmethod
    def staging(location: str, folder: Path) -> Path:
        """Where to prepare the answer that goes to ``location``: beside it for a local file
        (so that it is renamed into place), in ``folder`` for an object."""
        name = f".{os.urandom(8).hex()}.part"
        if is_object(location):
            folder.mkdir(parents=True, exist_ok=True)
            return folder / name
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.parent / name

    def put_file(self, location: str, staged: Path, content_type: str) -> None:
        """Move the answer prepared at ``staged`` (:meth:`staging`) to ``location`` whole: a
        rename, or an upload (in parts for a large one; the object appears once complete)."""
        try:
            if is_object(location):
                bucket, key = _bucket_key(location)
                try:
                    self.client.upload_file(
                        str(staged), bucket, key, ExtraArgs={"ContentType": content_type}
                    )
                except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
                    raise ServiceUnavailable(f"{location} cannot be written: {exc}") from None
                return
            path = local_path(location)
            os.replace(staged, path)
            _sync_folder(path.parent)
        finally:
            staged.unlink(missing_ok=True)

    def write(self, location: str, body: bytes, content_type: str) -> None:
        """Write ``body`` at ``location`` whole: readers see all of it or nothing."""
        if is_object(location):
            bucket, key = _bucket_key(location)
            try:
                self.client.put_object(Bucket=bucket, Key=key, Body=body, ContentType=content_type)
            except (BotoCoreError, ClientError) as exc:
                raise ServiceUnavailable(f"{location} cannot be written: {exc}") from None
            return
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(body)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        _sync_folder(path.parent)

    def exists(self, location: str) -> bool:
        """Whether something is written at ``location``."""
        if is_object(location):
            bucket, key = _bucket_key(location)
            try:
                self.client.head_object(Bucket=bucket, Key=key)
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in _NOT_FOUND:
                    return False
                raise ServiceUnavailable(f"{location} cannot be read: {exc}") from None
            except BotoCoreError as exc:
                raise ServiceUnavailable(f"{location} cannot be read: {exc}") from None
            return True
        return local_path(location).is_file()


def _bucket_key(location: str) -> tuple[str, str]:
    bucket, key = split_object_url(location)
    return bucket, key.rstrip("/")


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
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


@contextlib.contextmanager
def _reading(location: str) -> Iterator[None]:
    """Reading the input at ``location``: its errors as :class:`InputMissing` (no such input,
    or a local one that cannot be read) or :class:`ServiceUnavailable` (the object store)."""
    try:
        yield
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _NOT_FOUND:
            raise InputMissing(f"the input {location} does not exist") from None
        raise ServiceUnavailable(f"the input {location} cannot be read: {exc}") from None
    except BotoCoreError as exc:
        raise ServiceUnavailable(f"the input {location} cannot be read: {exc}") from None
    except FileNotFoundError:
        raise InputMissing(f"the input {location} does not exist") from None
    except OSError as exc:
        raise InputMissing(f"the input {location} cannot be read: {exc.strerror}") from None
