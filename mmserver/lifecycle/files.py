"""A load's file work: the model's store entry, its files fetched and unpacked, and its
``serving.properties``. The work is blocking; :class:`FileWork` runs it in an unpacking process
(:class:`mmserver.store.unpacking.UnpackProcesses`) or an unpacking thread, so :func:`prepare` and
:func:`find_and_prepare` are plain functions of picklable arguments."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from mmserver.config.model import PROPERTIES_FILE, model_config_from_properties
from mmserver.config.server import ModelConfig, load_model_config
from mmserver.envs import requirements
from mmserver.envs.requirements import RequirementSet
from mmserver.errors import ModelLoadError
from mmserver.execution import skew
from mmserver.execution.families import engine_families
from mmserver.store.names import split_version
from mmserver.store.source import ModelSource, StoreEntry
from mmserver.store.unpacking import UnpackProcesses

#: Threads doing a load's file work where the unpacking processes do not: without backend
#: processes, and an object store's downloads.
UNPACK_THREADS = 4
#: Processes doing a load's file work (with backend processes).
UNPACK_PROCESSES = 2

#: A model's files, ready to load: their directory, ``serving.properties`` over the server's
#: defaults (``None``: the model has none, the defaults apply as they are), and the requirement
#: set it runs with (``None``: the server's own environment).
Prepared = tuple[Path, ModelConfig | None, RequirementSet | None]

#: The files a pickled model may be in, searched for its recorded scikit-learn version.
_PICKLES = ("*.joblib", "*.pkl", "*.pickle")


def prepare(store: ModelSource, entry: StoreEntry, defaults: ModelConfig) -> Prepared:
    """The directory holding the files of ``entry`` (fetched and unpacked if needed), and its
    ``serving.properties`` over ``defaults``, or ``None`` without one: the caller keeps its one
    defaults object for every such model (an answer from a process would be a copy). A
    version's ``serving.properties`` goes over its model folder's."""
    if entry.versions:
        raise ModelLoadError(
            f"model {entry.name} has versions ({', '.join(map(str, entry.versions))}); "
            f"load one of them ({entry.name}/{entry.versions[-1]})",
            model=entry.name,
        )
    model_dir = store.prepare(entry)
    base, version = split_version(entry.name)
    inherited = defaults
    if version is not None:
        props = store.model_properties(base)
        if props:
            where = f"{store.root}/{base}/{PROPERTIES_FILE}"
            inherited = model_config_from_properties(props, defaults, where)
    config = load_model_config(model_dir, inherited)
    engine_families(config.engine, str(model_dir / PROPERTIES_FILE))  # an engine no family has
    wanted = requirements.read_folder(model_dir)
    if wanted is None and config.on_version_skew == skew.ENV:
        wanted = _skew_set(model_dir)
    return model_dir, None if config is defaults else config, wanted


def _skew_set(model_dir: Path) -> RequirementSet | None:
    """The set pinned to the scikit-learn version that made the model's pickle, when it is
    another minor version than the server's (``on_version_skew=env``); read from the pickle's
    bytes, nothing of it run."""
    for pattern in _PICKLES:
        for path in sorted(model_dir.glob(pattern)):
            made = skew.recorded_version(path)
            if made is not None and skew.skewed({skew.SKLEARN: made}):
                return requirements.pinned_for_skew(made)
    return None


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


class FileWork:
    """Where a load's file work runs: threads of its own, so that look-ups of unknown names,
    scrapes and the other blocking calls of the default pool never wait behind a slow archive;
    and with backend processes (``context``), processes of its own, so that a stream of cold
    loads does not take the interpreter lock from the event loop."""

    def __init__(
        self, store: ModelSource, defaults: ModelConfig, context: BaseContext | None
    ) -> None:
        self.store = store
        self.defaults = defaults
        self._threads = ThreadPoolExecutor(UNPACK_THREADS, thread_name_prefix="mmserver-unpack")
        self.processes: UnpackProcesses | None = None
        #: The store as an unpacking process opens it (``None``: an object store, whose
        #: downloads stay in the frontend's threads and hand only their archives over).
        self._portable = store.portable()
        if context is not None:
            self.processes = UnpackProcesses(UNPACK_PROCESSES, context)
            if self._portable is None:
                store.unpack = self.processes.unpack

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the unpacking processes hand their work back to."""
        if self.processes is not None:
            self.processes.bind(loop)

    async def run(self, name: str, work: Callable[..., Any], *args: Any) -> Any:
        """``work(store, *args, defaults)``, :func:`prepare` or :func:`find_and_prepare`, for
        model ``name``: in an unpacking process when the store can be opened there (a
        directory), else in an unpacking thread."""
        processes, portable = self.processes, self._portable
        if processes is not None and portable is not None:
            what = "preparing its files"
            return await processes.run(name, what, work, portable, *args, self.defaults)
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, functools.partial(work, self.store, *args, self.defaults)
        )

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            await self.processes.close()
