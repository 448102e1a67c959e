"""Opening the store the configuration names: a local directory or ``s3://bucket/prefix``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver.errors import ConfigError
from mmserver.store.local import ModelStore
from mmserver.store.source import ModelSource

if TYPE_CHECKING:
    # Only a type here: mmserver.config.server itself imports the store's URL helpers.
    from mmserver.config.server import ServerConfig


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


def check_store(config: ServerConfig) -> None:
    """Refuse (:class:`ConfigError`) a local model store that does not exist, is not a directory
    or cannot be read: a server started on a mistyped path would serve nothing. An empty one is
    fine (models come later, or by registration). An object store is checked as it is used."""
    if config.store_url is not None:
        return
    path = config.store_path
    if not path.exists():
        raise ConfigError(
            f"the model store {path} does not exist: create it, or pass the folder that holds "
            "the models (--model-store, MMSERVER_MODEL_STORE)"
        )
    if not path.is_dir():
        raise ConfigError(f"the model store {path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(f"the model store {path} cannot be read by this user (uid {os.getuid()})")
