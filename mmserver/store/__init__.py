"""The model store: a directory of models, each a folder ``NAME/`` or an archive ``NAME.tar.gz``.

The store only lists entries and unpacks archives; it never loads a model. Archives are unpacked
into a cache directory, once per archive version, with every member checked first: no absolute
paths, no ``..``, no links leaving the archive, no device files, at most :data:`MAX_MEMBERS`
members and at most ``max_unpacked_bytes`` in total. Nothing is ever written outside the cache.

:class:`ModelSource` is what the WorkLoadManager needs of a store; :class:`ModelStore` (a local
directory) and :class:`mmserver.store.s3.ObjectStore` (``s3://bucket/prefix``) provide it, and
both unpack with :func:`unpack_archive`.

The modules, one part each:

- :mod:`~mmserver.store.names`: model names, and the name an entry's file gives;
- :mod:`~mmserver.store.source`: :class:`ModelSource` and its :class:`StoreEntry`;
- :mod:`~mmserver.store.local`: :class:`ModelStore`, the store on the local file system;
- :mod:`~mmserver.store.s3`: ``ObjectStore``, the store on S3 (imported only when a store is on
  S3: boto3 takes a while to import);
- :mod:`~mmserver.store.cache`: the object store's unpacked copies and their disk budget;
- :mod:`~mmserver.store.archive`: the checks and the unpacking of an archive;
- :mod:`~mmserver.store.unpacking`: :class:`UnpackProcesses`, processes doing a load's file work;
- :mod:`~mmserver.store.index`: :class:`StoreIndex`, the store's names in memory, for listing;
- :mod:`~mmserver.store.urls`: ``s3://`` store URLs and the model URLs of the management API;
- :mod:`~mmserver.opening`: :func:`open_store`, the store the configuration names.

The names below are imported from their module when first used: importing one part of the
store (``mmserver transform`` needs only :mod:`~mmserver.store.objects`) does not import the
others (the archive's tarfile, the unpacking processes' multiprocessing, the properties'
parser), ~0.1 s of a command's start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserver.opening import open_store
    from mmserver.store.archive import MAX_HEADER_BYTES, MAX_MEMBERS, model_root, unpack_archive
    from mmserver.store.index import IndexSource, StoreIndex, suffix_of
    from mmserver.store.local import ModelStore, tree_size
    from mmserver.store.names import (
        ARCHIVE_SUFFIXES,
        MODEL_NAME_RE,
        archive_name,
        is_model_name,
        normalize_name,
        normalize_target,
        split_version,
        version_key,
    )
    from mmserver.store.source import ModelSource, StoreEntry, Unpacker
    from mmserver.store.unpacking import UnpackProcesses
    from mmserver.store.urls import (
        check_location,
        name_from_url,
        resolve_model_url,
        split_object_url,
    )

#: Where each name is defined: imported on first use, so that a part of the store (say
#: :mod:`~mmserver.store.objects`) is imported without the rest.
_WHERE = {
    "ARCHIVE_SUFFIXES": "mmserver.store.names",
    "IndexSource": "mmserver.store.index",
    "MAX_HEADER_BYTES": "mmserver.store.archive",
    "MAX_MEMBERS": "mmserver.store.archive",
    "MODEL_NAME_RE": "mmserver.store.names",
    "ModelSource": "mmserver.store.source",
    "ModelStore": "mmserver.store.local",
    "StoreEntry": "mmserver.store.source",
    "StoreIndex": "mmserver.store.index",
    "UnpackProcesses": "mmserver.store.unpacking",
    "Unpacker": "mmserver.store.source",
    "archive_name": "mmserver.store.names",
    "check_location": "mmserver.store.urls",
    "is_model_name": "mmserver.store.names",
    "model_root": "mmserver.store.archive",
    "name_from_url": "mmserver.store.urls",
    "normalize_name": "mmserver.store.names",
    "normalize_target": "mmserver.store.names",
    "open_store": "mmserver.opening",
    "resolve_model_url": "mmserver.store.urls",
    "split_object_url": "mmserver.store.urls",
    "split_version": "mmserver.store.names",
    "suffix_of": "mmserver.store.index",
    "tree_size": "mmserver.store.local",
    "unpack_archive": "mmserver.store.archive",
    "version_key": "mmserver.store.names",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


__all__ = [
    "ARCHIVE_SUFFIXES",
    "MAX_HEADER_BYTES",
    "MAX_MEMBERS",
    "MODEL_NAME_RE",
    "IndexSource",
    "ModelSource",
    "ModelStore",
    "StoreEntry",
    "StoreIndex",
    "UnpackProcesses",
    "Unpacker",
    "archive_name",
    "check_location",
    "is_model_name",
    "model_root",
    "name_from_url",
    "normalize_name",
    "normalize_target",
    "open_store",
    "resolve_model_url",
    "split_object_url",
    "split_version",
    "suffix_of",
    "tree_size",
    "unpack_archive",
    "version_key",
]
