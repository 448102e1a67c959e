"""What the WorkLoadManager needs of a store: :class:`ModelSource`, and its :class:`StoreEntry`.

:class:`mmserver.store.local.ModelStore` (a local directory) and
:class:`mmserver.store.s3.ObjectStore` (``s3://bucket/prefix``) provide it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


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
    #: The versions a model folder holds (``NAME/1/``, ``NAME/2.tar.gz``...), sorted; empty for
    #: a model that is its own files (and for a version's own entry).
    versions: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        """Where the model comes from, as shown to users: the object URL or the local path."""
        return self.object_url or str(self.path)


#: Unpacks an archive into a cache folder and returns the model's directory: the signature of
#: :func:`mmserver.store.archive.unpack_archive` (archive, target folder, byte limit, model
#: name). Blocking.
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
        (:class:`mmserver.store.index.IndexSource`)."""
        ...

    def version(self) -> tuple[Hashable, float] | None:
        """A token that changes when the listing may have, and when; ``None``: no such token."""
        ...

    def url_of(self, name: str, suffix: str) -> str:
        """The url of the entry ``name + suffix``, as :attr:`StoreEntry.url` shows it."""
        ...

    def model_properties(self, name: str) -> dict[str, str]:
        """The keys of the ``serving.properties`` of model folder ``name`` itself, which its
        versions inherit (``{}`` without one)."""
        ...

    def entry_for_path(self, path: Path, name: str) -> StoreEntry:
        """An entry for a model registered from a local path inside the allowed roots."""
        ...

    def prepare(self, entry: StoreEntry) -> Path:
        """The local directory holding the entry's files, fetched and unpacked if needed."""
        ...

    def portable(self) -> ModelSource | None:
        """The same store as another process can open it (picklable), for
        :mod:`mmserver.lifecycle.files`'s work in an unpacking process; ``None`` when it cannot
        cross a
        process (an object store's client)."""
        ...

    #: What :meth:`prepare` unpacks archives with: :func:`mmserver.store.archive.unpack_archive`
    #: in the calling thread by default; the server hands this to processes of their own
    #: (:mod:`mmserver.store.unpacking`).
    unpack: Unpacker

    def remove_unpacked(self, name: str) -> None:
        """Delete the cached copies of model ``name`` (best effort)."""
        ...
