"""Where a job's files are: input files listed and read, outputs written whole.

Inputs: a local folder (every file under it, hidden ones aside, by relative path), a local
file, an ``s3://bucket/prefix`` (every object whose key starts with it, named by its key past
the prefix's last ``/``), or a SageMaker manifest (``--data-type ManifestFile``: a local file or
an object, ``[{"prefix": "s3://bucket/prefix/"}, "relative/key", ...]``). Bodies are read and
outputs written whole by :class:`mmserver.store.objects.Objects` (the model store's S3 client
settings; boto3 is imported only for a job that uses S3). Every method blocks: the job calls
them in threads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.commands.transform.failures import FileFailed, TransformError
from mmserver.commands.transform.options import TransformOptions
from mmserver.store.objects import LocationError, Objects, bucket_key, is_object

OUT_SUFFIX = ".out"
ERROR_SUFFIX = ".error"


@dataclass(frozen=True)
class InputFile:
    """One input file: ``name`` is its path relative to the input, ``/``-separated; ``size`` is
    in bytes (0 when not known before reading, as for a manifest's objects)."""

    name: str
    location: str
    size: int


def _split(url: str) -> tuple[str, str]:
    """``s3://bucket/key-prefix`` as ``(bucket, key prefix)``, the prefix as written."""
    try:
        return bucket_key(url)
    except LocationError as exc:
        raise TransformError(exc.reason) from None


@contextmanager
def _failing(what: str, kind: type[TransformError]) -> Iterator[None]:
    """A location's errors as ``kind``: ``what`` and the reason; a missing input said so."""
    try:
        yield
    except LocationError as exc:
        if exc.missing and kind is FileFailed:
            raise kind(f"the input {exc.location} does not exist") from None
        raise kind(f"{what}: {exc.reason}") from None


class Places:
    """The job's input listing and reading, and its output writing."""

    def __init__(self, options: TransformOptions, client: Any = None) -> None:
        self.options = options
        self.objects = Objects(client)
        self.output = options.output.strip()
        if is_object(self.output):
            _split(self.output)
            self.output = self.output.rstrip("/")
        else:
            self.output = str(Path(self.output))

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
        folder = f"s3://{bucket}/{prefix[: prefix.rfind('/') + 1]}"
        with _failing(f"the input {url} cannot be listed", TransformError):
            files = [
                InputFile(location[len(folder) :], location, size)
                for location, size in self.objects.list(url)
            ]
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
        with _failing(f"the input {location} cannot be read", FileFailed):
            return self.objects.read(location)

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
        with _failing(f"{location} cannot be written", TransformError):
            self.objects.write(location, data, kind)

    def remove_error(self, name: str) -> None:
        """Remove the ``.error`` an earlier run left for the input ``name``, if any."""
        location = self.output_location(name, ERROR_SUFFIX)
        with _failing(f"{location} cannot be removed", TransformError):
            self.objects.delete(location)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
