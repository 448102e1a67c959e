"""``mmserver transform [options]``: the command (``mmserver transform --help`` lists every
option, :mod:`mmserver.commands.transform.options` declares them).

Exit codes: 0 every file written; 1 some files failed (each has its ``.error``); 2 the job
could not run or stopped (bad options, no input, unknown model, ``--on-error fail``); 130
interrupted (run the same command again to continue).

With the ``OTEL_*`` variables that turn the server's traces on (:mod:`mmserver.ops.otel`), each
run of a job is a span (``mmserver transform``) and the server's spans of its requests are its
children; the job's journal keeps its first run's ``traceparent``, so a run that continues the
job continues its trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from mmserver.commands.transform.failures import TransformError
from mmserver.commands.transform.job import Job
from mmserver.commands.transform.journal import JOB_FILE, Journal
from mmserver.commands.transform.options import PROG, TransformOptions, default_journal, parse
from mmserver.commands.transform.places import ERROR_SUFFIX, OUT_SUFFIX, InputFile, Places
from mmserver.commands.transform.progress import Display, Tally
from mmserver.commands.transform.sender import Sender
from mmserver.errors import ConfigError
from mmserver.ops.capacity import cpus
from mmserver.ops.folderlock import FolderInUse, FolderLock
from mmserver.ops.traces import Door
from mmserver.ops.tracing import tracing_from
from mmserver.store.objects import is_object, remove_staged

if TYPE_CHECKING:
    from mmserver.ops.otel import Tracing

#: How a run of a job is shown in traces, with the command's exit code (2: the job stopped).
TRANSFORM_DOOR = Door(
    "mmserver transform", {}, status_key="process.exit.code", errors_from=2, kind="internal"
)


def main(argv: Sequence[str], out: TextIO | None = None) -> int:
    """Run the command line ``argv`` (the arguments after ``transform``); the exit code."""
    stream = out or sys.stderr
    try:
        options = parse(argv)
        import uvloop  # the server's event loop: its sockets' reads and writes are the cheaper

        return uvloop.run(run(options, stream))
    except TransformError as exc:
        print(f"{PROG}: {exc.message}", file=stream)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; run the same command again to continue", file=stream)
        return 130


async def run(options: TransformOptions, stream: TextIO) -> int:
    """Run the job ``options`` describes, reporting to ``stream``; the exit code."""
    try:
        tracing = tracing_from(os.environ)
    except ConfigError as exc:
        raise TransformError(exc.message) from None
    try:
        return await _traced(options, stream, tracing)
    finally:
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)  # its spans sent before it exits


async def _traced(options: TransformOptions, stream: TextIO, tracing: Tracing | None) -> int:
    places = Places(options)
    files = await asyncio.to_thread(places.list_inputs)
    journal_dir = Path(default_journal(options))
    lock = FolderLock(journal_dir)
    await asyncio.to_thread(_hold, lock)
    try:
        journal = await asyncio.to_thread(
            Journal,
            journal_dir,
            options.fingerprint(),
            {"model": options.model, "input": options.input, "output": options.output},
        )
        if journal.resumed:  # what the stopped run was writing when it was killed
            await asyncio.to_thread(remove_staged, _written(places, files, journal), lock.since)
        trace = None if tracing is None else tracing.sampled(TRANSFORM_DOOR, journal.traceparent)
        if trace is None:
            return await _run(options, stream, places, files, journal)
        assert tracing is not None
        traceparent = tracing.traceparent(trace)
        if journal.traceparent is None:
            await asyncio.to_thread(journal.keep_trace, traceparent)
        trace.attributes.update({"mmserver.model": options.model, "mmserver.files": len(files)})
        code = 2
        try:
            code = await _run(options, stream, places, files, journal, traceparent)
        finally:
            tracing.export(trace, code)
        return code
    finally:
        lock.release()


def _written(places: Places, files: list[InputFile], journal: Journal) -> list[Path]:
    """The local files the job writes: its outputs and errors, and its journal's own."""
    paths = [journal.folder / JOB_FILE]
    if not is_object(places.output):
        for file in files:
            for suffix in (OUT_SUFFIX, ERROR_SUFFIX):
                paths.append(Path(places.output_location(file.name, suffix)))
    return paths


def _hold(lock: FolderLock) -> None:
    """Hold the job's journal folder: two runs of one job would send its payloads twice."""
    try:
        lock.take()
    except FolderInUse as exc:
        holder = f" (pid {exc.pid})" if exc.pid else ""
        raise TransformError(
            f"another run of this job{holder} is using its journal {lock.folder}: let it end "
            "(or stop it), then run the command again to continue"
        ) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise TransformError(
            f"the journal {lock.folder} cannot be used: {exc.strerror or exc}{where}"
        ) from None


async def _run(
    options: TransformOptions,
    stream: TextIO,
    places: Places,
    files: list[InputFile],
    journal: Journal,
    traceparent: str | None = None,
) -> int:
    journal_dir = journal.folder
    loop = asyncio.get_running_loop()
    tally = Tally(loop.time(), len(files), sum(f.size for f in files))
    display = Display(tally, stream, options.progress)
    async with contextlib.AsyncExitStack() as stack:
        # The clock starts once a server answers: the job's rate is its own, not a start-up's.
        if options.url:
            url = options.url
            concurrency = options.max_concurrent_transforms or cpus().value
        else:
            from mmserver.commands.transform.local import LocalServer  # its imports: only for it

            server = LocalServer(
                options.model_store,
                options.backend_processes,
                options.max_payload_bytes,
                journal_dir / "server.log",
            )
            url = (await stack.enter_async_context(server)).url
            concurrency = options.max_concurrent_transforms or (
                options.backend_processes or cpus().value
            )
        sender = await stack.enter_async_context(
            Sender(
                url,
                options.model,
                options.request_accept,
                concurrency,
                options.timeout,
                options.token,
                traceparent,
            )
        )
        tally.started = loop.time()
        shown = asyncio.create_task(display.run(), name="transform-progress")
        try:
            await Job(options, places, journal, sender, tally, concurrency).run(files)
        finally:
            shown.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shown
            display.finish(loop.time())
    return 1 if tally.files_failed else 0
