"""The model store on S3-compatible object storage: ``s3://bucket/prefix``.

Every model is an object ``prefix/NAME.tar.gz`` (or ``NAME.tgz``), as in SageMaker multi-model
endpoints, or a model with versions: objects ``prefix/NAME/1.tar.gz``, ``prefix/NAME/2.tar.gz``...
and optionally ``prefix/NAME/serving.properties``, which the versions inherit (found when asked
for; a listing shows the archives of the prefix). Listing reads the object listing only; the
first load of a model downloads its archive and unpacks it into the local cache with the rules of
local archives (:func:`mmserver.store.archive.unpack_archive`). The endpoint, region and
credentials come from the usual AWS environment variables and files, through boto3.

Cache layout (``cache_dir``)::

    NAME-KEY/        unpacked copy of one version of an object (KEY from its ETag)
    .tmp-NAME-*/     a download or unpack in progress (the archive is deleted once unpacked)
    .registered/     archives registered from local paths (POST /models), unpacked

A changed object has a new ETag, so the next load of its model unpacks a new copy. A download goes
to a temporary folder of the cache and the copy is renamed into place, so processes sharing the
cache never see each other's partial files. When the copies pass ``max_cache_bytes``, the least
recently used are removed, never the copy of a model that is loading, loaded or being unloaded
(as ``in_use`` tells) nor one being prepared (:mod:`mmserver.store.cache`).

Errors stay with the model asked for: a missing object is :class:`~mmserver.errors.ModelNotFound`,
an archive over the size limit or corrupt fails that model's load
(:class:`~mmserver.errors.ModelLoadError`, :class:`~mmserver.errors.UnsafeArchive`), and a store
that refuses access or cannot be reached is :class:`~mmserver.errors.ServiceUnavailable`.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import IO, Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from mmserver.errors import MMServerError, ModelLoadError, ModelNotFound, ServiceUnavailable
from mmserver.store.archive import model_root, unpack_archive
from mmserver.store.cache import CopyCache
from mmserver.store.client import client_config, make_client
from mmserver.store.local import local_entry, prepare_local
from mmserver.store.names import (
    ARCHIVE_SUFFIXES,
    archive_name,
    entry_version,
    file_stem,
    normalize_name,
    normalize_target,
)
from mmserver.store.objects import error_code
from mmserver.store.properties import parse_properties
from mmserver.store.source import StoreEntry, Unpacker
from mmserver.store.urls import split_object_url

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_DENIED = frozenset(
    {
        "403",
        "AccessDenied",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
    }
)


class ObjectStore:
    """Lists the ``NAME.tar.gz`` objects under ``s3://bucket/prefix`` and fetches them into
    ``cache_dir``.

    Every method may block on the network (callers run them in threads, several at once; the one
    boto3 client is thread-safe). :meth:`prepare` downloads a model once however many threads
    ask for it, and is safe when several processes share the cache. ``max_archive_bytes`` caps
    both the object's size and its unpacked size; ``max_cache_bytes`` (0: no limit) is the disk
    budget of the copies. ``in_use(name)`` (called from those threads, so it must be
    thread-safe) tells whether a model still needs its files; without it, the current copy of
    every model prepared by this store is kept.
    """

    def __init__(
        self,
        url: str,
        cache_dir: Path,
        max_archive_bytes: int,
        max_cache_bytes: int = 0,
        *,
        in_use: Callable[[str], bool] | None = None,
        client: Any = None,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
    ) -> None:
        self.bucket, self.prefix = split_object_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.cache_dir = Path(cache_dir)
        self.max_archive_bytes = max_archive_bytes
        self.unpack: Unpacker = unpack_archive
        self._cache = CopyCache(self.cache_dir, max_cache_bytes, in_use)
        self._client = client
        self._client_config = client_config(connect_timeout, read_timeout)
        self._client_lock = threading.Lock()

    @property
    def max_cache_bytes(self) -> int:
        """The disk budget of the unpacked copies in bytes (0: no limit)."""
        return self._cache.max_bytes

    @property
    def client(self) -> Any:
        """The boto3 S3 client, made on first use (it may read credentials over the network)."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = make_client(self._client_config)
                except (BotoCoreError, ValueError) as exc:
                    raise ServiceUnavailable(
                        f"the model store {self.root} cannot be used: {exc}"
                    ) from None
            return self._client

    # Listing ------------------------------------------------------------------------------------

    def list(self) -> list[StoreEntry]:
        """Every ``NAME.tar.gz``/``NAME.tgz`` object directly under the prefix, sorted by name
        (``.tar.gz`` wins over ``.tgz``). Reads the listing page by page; downloads nothing."""
        return [
            self._entry(name, self.prefix + name + suffix, obj["Size"], obj["ETag"])
            for name, suffix, obj in self._archives()
        ]

    def scan(self) -> Sequence[tuple[str, str]]:
        """``(name, suffix)`` of every model, sorted by name, for the store index: the object
        listing, page by page, as :meth:`list` reads it."""
        return [(name, suffix) for name, suffix, _ in self._archives()]

    def _archives(self) -> Sequence[tuple[str, str, dict[str, Any]]]:
        """``(name, suffix, object)`` of every model's archive object directly under the
        prefix, sorted by name; of ``NAME.tar.gz`` and ``NAME.tgz``, the first."""
        found: dict[str, tuple[str, dict[str, Any]]] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    filename = obj["Key"][len(self.prefix) :]
                    name = archive_name(filename)
                    if name is None:
                        continue
                    known = found.get(name)
                    if known is not None and known[0] == ".tar.gz":
                        continue
                    found[name] = (filename[len(name) :], obj)
        except (BotoCoreError, ClientError) as exc:
            raise self._store_error(exc) from None
        return [(name, *found[name]) for name in sorted(found)]

    def portable(self) -> None:
        """``None``: the store's client and its copy cache stay in this process; its downloads
        run in the frontend's threads (which hand the archives to :attr:`unpack`)."""
        return None

    def version(self) -> tuple[Hashable, float] | None:
        """``None``: an object listing has no cheap token of change; the index ages out."""
        return None

    def url_of(self, name: str, suffix: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}{suffix}"

    def find(self, name: str) -> StoreEntry | None:
        """The current version of model ``name`` (one HeadObject per archive suffix), or of a
        version's key ``NAME/2``; a model with versions is found by a listing of ``NAME/``
        when it has no archive of its own. ``None`` when there is none. Raises
        :class:`InvalidModelName` before any request."""
        key = normalize_target(name)
        for suffix in ARCHIVE_SUFFIXES:
            object_key = self.prefix + key + suffix
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=object_key)
            except ClientError as exc:
                if error_code(exc) in _NOT_FOUND:
                    continue
                raise self._store_error(exc) from None
            except BotoCoreError as exc:
                raise self._store_error(exc) from None
            return self._entry(key, object_key, head["ContentLength"], head["ETag"])
        if "/" in key:
            return None
        versions = self._versions(key)
        if not versions:
            return None
        url = f"s3://{self.bucket}/{self.prefix}{key}/"
        return StoreEntry(
            key, self.cache_dir / file_stem(key), "object", 0, object_url=url, versions=versions
        )

    def _versions(self, name: str) -> tuple[int, ...]:
        """The versions of the archives ``prefix/NAME/N.tar.gz`` (or ``.tgz``), sorted."""
        found: set[int] = set()
        folder = self.prefix + name + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=folder, Delimiter="/"
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    filename = obj["Key"][len(folder) :]
                    version = entry_version(filename)
                    if version is not None and filename != str(version):
                        found.add(version)
        except (BotoCoreError, ClientError) as exc:
            raise self._store_error(exc) from None
        return tuple(sorted(found))

    def model_properties(self, name: str) -> dict[str, str]:
        """The keys of the object ``prefix/NAME/serving.properties``, which the versions of
        ``NAME`` inherit (``{}`` without one)."""
        key = f"{self.prefix}{normalize_name(name)}/serving.properties"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            data = response["Body"].read(1 << 20)
        except ClientError as exc:
            if error_code(exc) in _NOT_FOUND:
                return {}
            raise self._store_error(exc) from None
        except BotoCoreError as exc:
            raise self._store_error(exc) from None
        return parse_properties(data.decode("utf-8", errors="replace"))

    def entry_for_path(self, path: Path, name: str) -> StoreEntry:
        """An entry for a model registered from a local path inside the allowed roots."""
        return local_entry(path, name)

    def _entry(self, name: str, key: str, size: int, etag: str) -> StoreEntry:
        digest = hashlib.sha256(etag.encode()).hexdigest()[:16]
        return StoreEntry(
            name,
            self.cache_dir / f"{file_stem(name)}-{digest}",
            "object",
            size,
            object_url=f"s3://{self.bucket}/{key}",
            etag=etag,
        )

    # Fetching -----------------------------------------------------------------------------------

    def prepare(self, entry: StoreEntry) -> Path:
        """The directory holding the model's files: the cached copy of this version, or the
        object downloaded (streamed to disk) and unpacked now. Blocking; one download per model
        at a time in this process, and safe against other processes sharing the cache."""
        if entry.kind != "object":
            return prepare_local(
                entry, self.cache_dir / ".registered", self.max_archive_bytes, self.unpack
            )
        folder = entry.path.name
        cache = self._cache
        with cache.name_lock(entry.name):
            cache.preparing(entry.name, folder)
            if entry.path.is_dir():
                cache.used(folder, entry.path)
                return model_root(entry.path)
            cache.evict(entry.name, incoming_bytes=entry.size_bytes)
            root = self._fetch(entry)
            cache.used(folder, entry.path, new=True)
            cache.evict(entry.name)
            return root

    def _fetch(self, entry: StoreEntry) -> Path:
        limit = self.max_archive_bytes
        if entry.size_bytes > limit:
            raise _too_large(entry, f"is {entry.size_bytes} bytes", limit)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._cache.sweep_once()
        stem = file_stem(entry.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{stem}-", dir=self.cache_dir))
        try:
            archive = tmp / f"{stem}.tar.gz"
            started = time.perf_counter()
            try:
                with open(archive, "wb") as out:
                    size = self._download(entry, out)
            except OSError as exc:
                raise ModelLoadError(
                    f"model {entry.name}: {entry.url} cannot be written to the cache "
                    f"{self.cache_dir}: {exc}",
                    model=entry.name,
                ) from None
            log.info(
                "model %s: downloaded %s (%d bytes) in %.1f ms",
                entry.name,
                entry.url,
                size,
                (time.perf_counter() - started) * 1000,
            )
            return self.unpack(archive, entry.path, limit, entry.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _download(self, entry: StoreEntry, out: IO[bytes]) -> int:
        """Stream the object's version ``entry.etag`` into ``out``; returns its size."""
        limit = self.max_archive_bytes
        key = (entry.object_url or "").removeprefix(f"s3://{self.bucket}/")
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=entry.etag)
        except ClientError as exc:
            code = error_code(exc)
            if code in _NOT_FOUND:
                raise ModelNotFound(f"model {entry.name}: {entry.url} no longer exists") from None
            if code in ("PreconditionFailed", "412"):
                raise ServiceUnavailable(
                    f"model {entry.name}: {entry.url} changed while it was being fetched; retry"
                ) from None
            raise self._store_error(exc) from None
        except BotoCoreError as exc:
            raise self._store_error(exc) from None
        body = response["Body"]
        written = 0
        try:
            if response.get("ContentLength", 0) > limit:
                raise _too_large(entry, f"is {response['ContentLength']} bytes", limit)
            for chunk in body.iter_chunks(_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise _too_large(entry, "grew past the limit while downloading", limit)
                out.write(chunk)
        except BotoCoreError as exc:
            raise self._store_error(exc, f"while downloading {entry.url}") from None
        finally:
            body.close()
        return written

    def remove_unpacked(self, name: str) -> None:
        """Delete the cached copies of model ``name`` (best effort)."""
        self._cache.remove(normalize_target(name))

    # Errors -------------------------------------------------------------------------------------

    def _store_error(self, exc: Exception, during: str = "") -> MMServerError:
        where = f"the model store {self.root}"
        detail = f" {during}" if during else ""
        if isinstance(exc, ClientError):
            code = error_code(exc)
            message = exc.response.get("Error", {}).get("Message") or code
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _DENIED or status == 403:
                return ServiceUnavailable(
                    f"{where}: access denied{detail} ({code}: {message}); check the "
                    "credentials and the bucket's policy"
                )
            if code == "NoSuchBucket":
                return ServiceUnavailable(f"{where}: bucket {self.bucket} does not exist")
            return ServiceUnavailable(f"{where} failed{detail}: {code}: {message}")
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return ServiceUnavailable(
                f"{where}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            )
        return ServiceUnavailable(f"{where} is unreachable{detail}: {exc}")


def _too_large(entry: StoreEntry, what: str, limit: int) -> ModelLoadError:
    return ModelLoadError(
        f"model {entry.name}: {entry.url} {what}; the limit is {limit} bytes (max_archive_mb), "
        "so it is not loaded",
        model=entry.name,
    )
