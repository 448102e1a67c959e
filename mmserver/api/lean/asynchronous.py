"""``InvokeEndpointAsync`` taken by the lean path (:mod:`mmserver.api.lean.connection`): the request
is accepted as aiohttp's handler (:func:`mmserver.api.asynchronous.invoke_async`) accepts it, and
its 202, or its error, is written byte for byte as that handler writes it.

Each asynchronous request is a small request the client waits for, like an inference request:
through aiohttp, its request and response objects, router and connection task cost the event
loop about twice what accepting it does, and a stream of them takes that from the real-time
requests beside them. Here the accept is one task (the journal's write is awaited), its answer
written when that ends, in the order of the connection's requests.

Taken only on a server with asynchronous inference and without ``access_log`` (aiohttp serves
them otherwise: the 404 of a server without a ``state_dir``, and the access log's line, are its
own). The body, if any, is the inline input, as aiohttp's handler reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from mmserver.api.dataplane import shown_error
from mmserver.api.lean.answer import Link, error_answer, lean_answer
from mmserver.api.protocols import SAGEMAKER
from mmserver.api.state import REQUEST_ID
from mmserver.asynchronous import AsyncInference, AsyncRequest, Invocation
from mmserver.asynchronous.requests import FAILURE_LOCATION, OUTPUT_LOCATION

log = logging.getLogger(__name__)

#: The ``Content-Type`` of aiohttp's ``json_response``.
_JSON_UTF8 = "application/json; charset=utf-8"


class LeanAsyncExchange:
    """One ``InvokeEndpointAsync`` request taken by the lean path, until its answer is written:
    its answer is ``data`` once known."""

    __slots__ = ("conn", "data", "path", "rid")

    def __init__(self, conn: Link, path: bytes, rid: str) -> None:
        self.conn = conn
        self.path = path
        self.rid = rid
        self.data: bytes | None = None

    def accept(
        self,
        runner: AsyncInference,
        endpoint: str,
        body: bytes,
        header: Callable[[str], str | None],
    ) -> None:
        """Accept the request (``header`` gives its headers' values by name): its answer is
        made once the journal holds it, or refused it."""
        asked = AsyncRequest.from_headers(endpoint, header)
        task = asyncio.get_running_loop().create_task(runner.accept(asked, body))
        task.add_done_callback(self._accepted)

    def _accepted(self, task: asyncio.Task[tuple[Invocation, bool]]) -> None:
        conn = self.conn
        if task.cancelled():
            # The server is stopping: the answers after this one could not be written in order.
            conn.abandon()
            return
        try:
            error = task.exception()
            if error is None:
                invocation, _ = task.result()
                headers = {
                    OUTPUT_LOCATION: invocation.output,
                    FAILURE_LOCATION: invocation.failure,
                    "Content-Type": _JSON_UTF8,
                    REQUEST_ID: self.rid,
                }
                body = json.dumps({"InferenceId": invocation.id}).encode()
                self.data = lean_answer(202, headers, body)
            else:
                self.fail(error)
        except Exception:
            log.exception("unexpected error answering POST %s", self.path.decode())
            conn.abandon()
            return
        conn.flush()

    def fail(self, error: BaseException) -> None:
        """Make the error answer (a 500 logged), as aiohttp's handler does."""
        shown = shown_error(error, "POST", self.path.decode(), self.rid)
        self.data, _ = error_answer(self.conn.state, shown, self.rid, SAGEMAKER)
