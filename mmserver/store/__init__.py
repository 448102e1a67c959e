"""The model store: a directory of models, each a folder ``NAME/`` or an archive ``NAME.tar.gz``.

The store only lists entries and unpacks archives; it never loads a model. Archives are unpacked
into a cache directory, once per archive version, with every member checked first: no absolute
paths, no ``..``, no links leaving the archive, no device files, at most
:data:`~mmserver.store.archive.MAX_MEMBERS` members and at most ``max_unpacked_bytes`` in total.
Nothing is ever written outside the cache.

:class:`~mmserver.store.source.ModelSource` is what the WorkLoadManager needs of a store;
:class:`~mmserver.store.local.ModelStore` (a local directory) and
:class:`mmserver.store.s3.ObjectStore` (``s3://bucket/prefix``) provide it, and both unpack with
:func:`~mmserver.store.archive.unpack_archive`.

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
- :mod:`~mmserver.store.objects`: whole bodies read from and written to ``s3://`` objects and
  local files, with the clients of :mod:`~mmserver.store.client`;
- :mod:`~mmserver.store.properties`: Java-properties files (``--config`` and each model's
  ``serving.properties``).

The store the configuration names is opened by :mod:`mmserver.opening`.
Each name is imported from the module that defines it: importing one part of the store
(``mmserver transform`` needs only :mod:`~mmserver.store.objects`) imports none of the others
(the archive's tarfile, the unpacking processes' multiprocessing, boto3).
"""
