"""Where a job's files are: input files listed and read, outputs written whole.

Inputs: a local folder (every file under it, hidden ones aside, by relative path), a local
file, an ``s3://bucket/prefix`` (every object whose key starts with it, named by its key past
the prefix's last ``/``), or a SageMaker manifest (``--data-type ManifestFile``: a local file or
an object, ``[{"prefix": "s3://bucket/prefix/"}, "relative/key", ...]``). Objects are read and
written with the model store's S3 client settings (:func:`mmserver.store.s3.make_client`: the
endpoint, region and credentials from the usual AWS variables and files; boto3 is imported only
for a job that uses S3). Every output is written whole: a local one to a temporary file renamed
into place, an object by one ``put_object``. Every method blocks: the job calls them in threads.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.errors import ConfigError
from mmserver.store import split_object_url
from mmserver.transform.failures import FileFailed, TransformError
from mmserver.transform.options import TransformOptions

OUT_SUFFIX = ".out"
ERROR_SUFFIX = ".error"


@dataclass(frozen=True)
class InputFile:
    """One input file: ``name`` is its path relative to the input, ``/``-separated; ``size`` is
    in bytes (0 when not known before reading, as for a manifest's objects)."""

    name: str
    location: str
    size: int


def is_object(location: str) -> bool:
    return location[:5].lower() == "s3://"


def _split(url: str) -> tuple[str, str]:
    """``s3://bucket/key-prefix`` as ``(bucket, key prefix)``, the prefix as written."""
    try:
        bucket, _ = split_object_url(url)
    except ConfigError as exc:
        raise TransformError(exc.message.replace("model store", "location")) from None
    rest = url.strip()[5:].partition("/")[2]
    return bucket, rest


class Places:
    """The job's input listing and reading, and its output writing."""

    def __init__(self, options: TransformOptions, client: Any = None) -> None:
        self.options = options
        self._client = client
        self._lock = threading.Lock()
        self.output = options.output.strip()
        if is_object(self.output):
            _split(self.output)
            self.output = self.output.rstrip("/")
        else:
            self.output = str(Path(self.output))

    @property
    def client(self) -> Any:
        """The one S3 client (thread-safe), made on first use."""
        with self._lock:
            if self._client is None:
                from mmserver.store.s3 import make_client

                self._client = make_client()
            return self._client

    # -- inputs ----------------------------------------------------------------------------

    def list_inputs(self) -> list[InputFile]:
        """Every input file, sorted by name. Raises :class:`TransformError` when there is none
        or the input cannot be listed."""
        where = self.options.input.strip()
        if self.options.data_type == "ManifestFile":
            files = self._manifest(where)
        elif is_object(where):
            files = self._objects(where)
        else:
            files = self._local(Path(where))
        if not files:
            raise TransformError(f"no input files in {where}: check --input")
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise TransformError(f"the manifest {where} names a file twice")
        return sorted(files, key=lambda f: f.name)

    def _local(self, root: Path) -> list[InputFile]:
        if root.is_file():
            return [InputFile(root.name, str(root), root.stat().st_size)]
        if not root.is_dir():
            raise TransformError(f"the input {root} does not exist: give a folder or a file")
        files = []
        # An output folder inside the input is not input: a rerun would read the outputs.
        skip = Path(self.output).resolve() if not is_object(self.output) else None
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(
                d for d in dirs if not d.startswith(".") and (Path(folder) / d).resolve() != skip
            )
            for name in names:
                path = Path(folder) / name
                if name.startswith(".") or not path.is_file():
                    continue
                files.append(InputFile(path.relative_to(root).as_posix(), str(path), _size(path)))
        return files

    def _objects(self, url: str) -> list[InputFile]:
        bucket, prefix = _split(url)
        folder = prefix[: prefix.rfind("/") + 1]
        files = []
        with _s3_errors(f"the input {url} cannot be listed", TransformError):
            pages = self.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    key = str(item["Key"])
                    if key.endswith("/"):
                        continue
                    files.append(
                        InputFile(key[len(folder) :], f"s3://{bucket}/{key}", int(item["Size"]))
                    )
        if not files:
            raise TransformError(f"no objects under {url}: check the bucket and prefix")
        return files

    def _manifest(self, where: str) -> list[InputFile]:
        try:
            text = self._read(where)
        except FileFailed as exc:
            raise TransformError(f"the manifest: {exc.message}") from None
        try:
            entries = json.loads(text)
            prefix = entries[0]["prefix"]
            keys = entries[1:]
            if not isinstance(prefix, str) or not all(isinstance(k, str) for k in keys):
                raise TypeError
        except (ValueError, TypeError, KeyError, IndexError):
            raise TransformError(
                f"the manifest {where} is not SageMaker's form: "
                '[{"prefix": "s3://bucket/prefix/"}, "relative/key", ...]'
            ) from None
        if is_object(prefix):
            _split(prefix)
            return [InputFile(k.lstrip("/"), prefix + k, 0) for k in keys]
        root = Path(prefix)
        return [InputFile(k.lstrip("/"), str(root / k), 0) for k in keys]

    def read(self, file: InputFile) -> bytes:
        """The content of ``file``. Raises :class:`FileFailed`."""
        return self._read(file.location)

    def _read(self, location: str) -> bytes:
        if is_object(location):
            bucket, key = _split(location)
            with _s3_errors(f"the input {location} cannot be read", FileFailed, location):
                return bytes(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        try:
            return Path(location).read_bytes()
        except FileNotFoundError:
            raise FileFailed(f"the input {location} does not exist") from None
        except OSError as exc:
            raise FileFailed(f"the input {location} cannot be read: {exc.strerror}") from None

    # -- outputs ---------------------------------------------------------------------------

    def output_location(self, name: str, suffix: str = OUT_SUFFIX) -> str:
        if is_object(self.output):
            return f"{self.output}/{name}{suffix}"
        return str(Path(self.output) / (name + suffix))

    def write(self, name: str, data: bytes, suffix: str = OUT_SUFFIX) -> None:
        """Write the output (or with ``ERROR_SUFFIX``, the error) of the input ``name`` whole.
        Raises :class:`TransformError`: an output that cannot be written stops the job."""
        location = self.output_location(name, suffix)
        kind = "text/plain" if suffix == ERROR_SUFFIX else self.options.answer_type
        try:
            if is_object(location):
                bucket, key = _split(location)
                with _s3_errors(f"{location} cannot be written", TransformError):
                    self.client.put_object(Bucket=bucket, Key=key, Body=data, ContentType=kind)
            else:
                _write_whole(Path(location), data)
        except OSError as exc:
            raise TransformError(f"{location} cannot be written: {exc.strerror}") from None

    def remove_error(self, name: str) -> None:
        """Remove the ``.error`` an earlier run left for the input ``name``, if any."""
        location = self.output_location(name, ERROR_SUFFIX)
        if is_object(location):
            bucket, key = _split(location)
            with _s3_errors(f"{location} cannot be removed", TransformError):
                self.client.delete_object(Bucket=bucket, Key=key)
        else:
            Path(location).unlink(missing_ok=True)


_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})


@contextmanager
def _s3_errors(what: str, kind: type[TransformError], location: str = "") -> Iterator[None]:
    """boto3's errors as ``kind``: ``what`` and the reason (a missing ``location`` said so)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if location and code in _NOT_FOUND:
            raise kind(f"the input {location} does not exist") from None
        raise kind(f"{what}: {exc}") from None
    except BotoCoreError as exc:
        raise kind(f"{what}: {exc}") from None


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a temporary file beside it, synced, renamed into place (with the
    mode the umask gives a new file, as any other output of the user's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
