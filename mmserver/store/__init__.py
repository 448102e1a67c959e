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
- :mod:`~mmserver.store.opening`: :func:`open_store`, the store the configuration names.
"""

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
from mmserver.store.opening import open_store
from mmserver.store.source import ModelSource, StoreEntry, Unpacker
from mmserver.store.unpacking import UnpackProcesses
from mmserver.store.urls import (
    check_location,
    name_from_url,
    resolve_model_url,
    split_object_url,
)

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
