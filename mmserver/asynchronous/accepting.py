"""Accepting asynchronous calls (step 1 of :mod:`mmserver.asynchronous.runner`): a call is checked
(its headers, its input location, the bound ``async_max_queued``) before anything is written;
then, in one hand-off to the journal's thread (:mod:`mmserver.asynchronous.writer`), an inline
body is saved under ``state_dir/inputs`` and the request's row added to the journal, synced to
disk; only then is it queued (:class:`~mmserver.asynchronous.dispatching.Dispatcher`) and
:meth:`Acceptor.accept` returns, so the 202 is sent for a request no crash can lose.

Real time first: while real-time requests keep the event loop busy, calls wait their turn
(:class:`~mmserver.asynchronous.admission.Intake`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mmserver import errors
from mmserver.asynchronous.admission import Intake
from mmserver.asynchronous.dispatching import Dispatcher
from mmserver.asynchronous.journal import Invocation
from mmserver.asynchronous.locations import Locations, file_url
from mmserver.asynchronous.requests import AsyncRequest
from mmserver.asynchronous.writer import Folders, JournalThread
from mmserver.codecs.requests import make_request
from mmserver.config.server import ServerConfig
from mmserver.ops.metrics import Metrics
from mmserver.store.names import normalize_name
from mmserver.store.objects import write_synced

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager


class Acceptor:
    """Accepts the asynchronous calls of one server (module docstring), from :meth:`open` to
    :meth:`close`; refused with :class:`~mmserver.errors.ShuttingDown` before and after."""

    def __init__(
        self,
        config: ServerConfig,
        wlm: WorkLoadManager,
        metrics: Metrics,
        locations: Locations,
        writer: JournalThread,
        dispatcher: Dispatcher,
        intake: Intake,
        *,
        inputs_dir: Path,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._wlm = wlm
        self._metrics = metrics
        self._locations = locations
        self._writer = writer
        self._dispatcher = dispatcher
        #: When calls are accepted while real-time requests keep the event loop busy.
        self.intake = intake
        #: Where inline bodies are saved.
        self._inputs_dir = inputs_dir
        self._clock = clock
        self._accepting = False

    def open(self) -> None:
        """Accept calls from now on."""
        self._accepting = True

    def close(self) -> None:
        """Accept nothing more (calls waiting their turn are refused when it comes)."""
        self._accepting = False

    async def accept(self, request: AsyncRequest, body: bytes) -> tuple[Invocation, bool]:
        """Journal one request and queue it: its row, and whether it is new (``False``: a
        request with its inference id was accepted before; it is not queued again). Raises what
        refuses it before anything is written."""
        self._check_room()
        model = normalize_name(request.model)
        make_request(b"", request.content_type, request.accept)  # 415 now, not in the failure
        ttl, timeout = request.ttl_s(), request.timeout_s()
        inference_id = request.checked_id()
        request.check_attributes()
        extension, filename = request.extension(), request.checked_filename()
        if self.intake.busy():  # real time first: the call waits its turn
            await self.intake.take()
            self._check_room()  # again: the server may have filled up or begun to stop
        output_base, failure_base = self._places(model)
        if extension is not None:
            output_base = self._locations.join(output_base, extension)
            failure_base = self._locations.join(failure_base, extension)
        inline: Path | None = None
        location = (request.input_location or "").strip()
        if location:
            if body:
                raise errors.InvalidInput(
                    "send the input inline or name its location, not both (Body and "
                    "InputLocation are exclusive)"
                )
        else:
            if not body:
                self._locations.check_input("")  # says what is missing
            inline = self._inputs_dir / f"{uuid.uuid4().hex}.in"
        invocation = Invocation(
            id=inference_id,
            model=model,
            input="",
            output=self._locations.join(output_base, filename or f"{inference_id}.out"),
            failure=self._locations.join(failure_base, f"{inference_id}-error.out"),
            content_type=request.content_type,
            accept=request.accept,
            custom_attributes=request.custom_attributes,
            accepted_at=self._clock(),
            ttl_s=ttl,
            timeout_s=timeout,
            traceparent=request.traceparent,
        )
        journal = self._writer.current()
        locations = self._locations

        def save(folders: Folders) -> str:
            # In the journal's thread: resolving a path may take a system call per folder.
            if inline is None:
                return locations.check_input(location)  # refused before anything is written
            write_synced(inline, body)
            folders.add(inline.parent)
            return file_url(inline)

        def record(source: str) -> tuple[Invocation, bool, str]:
            row, added = journal.add(dataclasses.replace(invocation, input=source))
            if not added and inline is not None:
                inline.unlink(missing_ok=True)
            return row, added, source

        row, added, source = await self._writer.run(save, record)
        if not added:
            if row.model != invocation.model or (inline is None and row.input != source):
                raise errors.InvalidInput(
                    f"inference id {inference_id!r} names another request already accepted; "
                    "use a new id"
                )
            return row, False
        self._dispatcher.enqueue(row)
        self._metrics.async_requests.labels("accepted").inc()
        return row, True

    def _check_room(self) -> None:
        if not self._accepting:
            raise errors.ShuttingDown("the server is shutting down; retry on another instance")
        if self._dispatcher.open_requests >= self._config.async_max_queued:
            raise errors.TooManyRequests(
                f"the server holds {self._config.async_max_queued} asynchronous requests "
                "(async_max_queued); retry later"
            )

    def _places(self, model: str) -> tuple[str, str]:
        """Where the answers and failures of ``model`` go: its own settings when the server
        knows them (the model is loaded), otherwise the server's."""
        pool = self._wlm.room.loaded.get(model)
        output = self._config.async_outputs
        failure = self._config.async_failure_path.strip() or None
        if pool is not None:
            output = pool.config.async_output_path or output
            failure = pool.config.async_failure_path or failure
        return output, failure or output
