"""Opening the store the configuration names: a local directory or ``s3://bucket/prefix``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver.store.local import ModelStore
from mmserver.store.source import ModelSource

if TYPE_CHECKING:
    # Only a type here: mmserver.config itself imports the store's URL helpers.
    from mmserver.config import ServerConfig


def open_store(config: ServerConfig, in_use: Callable[[str], bool] | None = None) -> ModelSource:
    """The store ``config.model_store`` names: a local directory or ``s3://bucket/prefix``.
    ``in_use(name)`` tells an object store's cache which models still need their files."""
    limit = config.max_archive_mb * 2**20
    if config.store_url is None:
        return ModelStore(config.store_path, config.cache_path, limit, config.allowed_roots)
    # Imported here: boto3 takes a while to import and a local store does not need it.
    from mmserver.store.s3 import ObjectStore

    return ObjectStore(
        config.store_url, config.cache_path, limit, config.max_cache_mb * 2**20, in_use=in_use
    )
