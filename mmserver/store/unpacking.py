"""A load's file work in processes of their own.

Looking a model up, unpacking its archive (tar headers, gzip, the checks of
:func:`mmserver.store.archive.unpack_archive`) and reading its ``serving.properties`` is Python
work that holds the interpreter lock, and a blocking call that hands it back and forth: run in the
frontend's threads, a stream of cold loads takes the lock from the event loop, and every hand-off
between a thread and the loop costs more than the work itself. :class:`UnpackProcesses` runs that
work in a few processes of the fork server instead
(:class:`~mmserver.procs.sidework.SideProcesses`):
the event loop asks them and reads their answers as it reads the backends' replies, and no
frontend thread takes part. Threads that need an archive unpacked (an object store's downloads)
hand it over the same way (:meth:`UnpackProcesses.unpack`).

Measured (cold loads of the reference archive over 16 connections, CPU time of the frontend
process per load): 4.6 ms with the unpacking in the frontend's threads; 1.3 to 1.5 ms with only the
unpacking in these processes, behind threads that handed archives over and waited; 0.9 ms with
the whole file work here, asked from the event loop (8,000 loads, alternated runs).

A process that dies (killed, out of memory) fails the load it was working for with
:class:`~mmserver.errors.ModelLoadError` and is replaced for the next one.
"""

from __future__ import annotations

from multiprocessing.context import BaseContext
from pathlib import Path

from mmserver.errors import ModelLoadError, ShuttingDown
from mmserver.procs.sidework import Kind, SideProcesses
from mmserver.store.archive import unpack_archive

#: The unpacking processes' name (``/proc/PID/comm``), which tells them from the backend
#: processes, their siblings under the fork server.
PROCESS_NAME = "mmserver-unpack"


def _load_failed(name: str, message: str) -> ModelLoadError:
    return ModelLoadError(f"model {name}: {message}", model=name)


def _not_loaded(name: str) -> ShuttingDown:
    return ShuttingDown(f"model {name} is not loaded: the server is stopping", model=name)


KIND = Kind(
    title="mmserver: unpacking", comm=PROCESS_NAME, failure=_load_failed, stopping=_not_loaded
)


class UnpackProcesses(SideProcesses):
    """``processes`` processes doing the file work of loads, started on first use. Runs on the
    event loop (:meth:`run`); threads hand archives over with :meth:`unpack`."""

    def __init__(self, processes: int, context: BaseContext) -> None:
        super().__init__(processes, context, KIND)

    def unpack(self, archive: Path, target: Path, max_unpacked_bytes: int, name: str) -> Path:
        """:func:`~mmserver.store.archive.unpack_archive` in one of the processes, for a thread
        (a :data:`mmserver.store.source.Unpacker`; blocking)."""
        result: Path = self.run_from_thread(
            name,
            f"unpacking {archive.name}",
            unpack_archive,
            archive,
            target,
            max_unpacked_bytes,
            name,
        )
        return result
