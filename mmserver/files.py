"""A load's file work: the model's store entry, its files fetched and unpacked, and its
``serving.properties``. Blocking; it runs where the WorkLoadManager sends it, an unpacking
process (:class:`mmserver.store.UnpackProcesses`) or an unpacking thread, so these are plain
functions of picklable arguments."""

from __future__ import annotations

from pathlib import Path

from mmserver.config import ModelConfig, load_model_config
from mmserver.store import ModelSource, StoreEntry

#: A model's files, ready to load: their directory, and ``serving.properties`` over the server's
#: defaults (``None``: the model has none, the defaults apply as they are).
Prepared = tuple[Path, ModelConfig | None]


def prepare(store: ModelSource, entry: StoreEntry, defaults: ModelConfig) -> Prepared:
    """The directory holding the files of ``entry`` (fetched and unpacked if needed), and its
    ``serving.properties`` over ``defaults``, or ``None`` without one: the caller keeps its one
    defaults object for every such model (an answer from a process would be a copy)."""
    model_dir = store.prepare(entry)
    config = load_model_config(model_dir, defaults)
    return model_dir, None if config is defaults else config


def find_and_prepare(
    store: ModelSource, name: str, defaults: ModelConfig
) -> tuple[StoreEntry | None, Prepared | Exception | None]:
    """The store's entry of model ``name`` now (``None``: no such model), and its prepared files
    or the error that stopped them. A lookup's error is raised; a preparation's is returned, so
    that the caller tells a name that led nowhere from a model that failed to load."""
    entry = store.find(name)
    if entry is None:
        return None, None
    try:
        return entry, prepare(store, entry, defaults)
    except Exception as exc:
        return entry, exc
