"""The HTTP layer: thin aiohttp handlers over the WorkLoadManager (DESIGN §8).

- :mod:`mmserver.api.inference` — ``/ping`` and the four inference paths (DJL and SageMaker);
- :mod:`mmserver.api.management` — ``/models`` (list, describe, register, rescale, unload) and
  ``/metrics``;
- :mod:`mmserver.api.v2` — the Open Inference Protocol (KServe V2 REST) under ``/v2``: health,
  metadata, inference and the model repository extension;
- :mod:`mmserver.api.middleware` — the one place where errors become HTTP responses, and the
  management token check;
- :mod:`mmserver.api.grpc` — the Open Inference Protocol over gRPC, on its own port
  (``grpc_port``), through the same data plane (:mod:`mmserver.api.dataplane`).

Handlers find their collaborators in :data:`STATE` on the application; there are no module-level
singletons.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from mmserver.config.server import ServerConfig
from mmserver.errors import ClientClosed, InvalidInput, RequestTimeout, RequestTooLarge
from mmserver.ops.metrics import Metrics

if TYPE_CHECKING:
    from mmserver.api.accesslog import AccessLog
    from mmserver.asynchronous import AsyncInference
    from mmserver.manager.wlm import WorkLoadManager
    from mmserver.ops.capture import Capture


#: The header naming a request: every answer has it (as DJL Serving's do), with the client's own
#: value when its request had one.
REQUEST_ID = "X-Request-Id"


class RequestIds:
    """Request ids for requests that came without one: a random per-process prefix and a counter
    (a step of the counter and a short string per request; a UUID would cost several times
    that)."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


@dataclass
class ApiState:
    """What the handlers use, stored on the application under :data:`STATE`."""

    config: ServerConfig
    wlm: WorkLoadManager
    metrics: Metrics
    request_ids: RequestIds = field(default_factory=RequestIds)
    #: The access log, when ``access_log`` is on.
    access_log: AccessLog | None = None
    #: Asynchronous inference, when the server has a ``state_dir``.
    asynchronous: AsyncInference | None = None
    #: The data capture, when the server has a ``capture_path``.
    capture: Capture | None = None

    @functools.cached_property
    def _hidden_paths(self) -> tuple[str, ...]:
        config = self.config
        roots = {str(config.cache_path), *(str(r) for r in config.allowed_roots)}
        if config.store_url is None:
            roots |= {str(config.store_path), os.path.realpath(config.store_path)}
        return tuple(sorted((r.rstrip("/") for r in roots if r.strip("/")), key=len, reverse=True))

    def without_paths(self, text: str) -> str:
        """``text`` with the server's own folders (the store, the cache, the allowed model
        roots) cut from the paths in it: an answer names a model's files, not the machine's."""
        for root in self._hidden_paths:
            if root in text:
                text = text.replace(root + "/", "").replace(root, "the model store")
        return text

    def observe_request(self, model: str, code: int, seconds: float) -> None:
        """Count one answered inference request and its time in the server."""
        self.metrics.requests.labels(model, str(code)).inc()
        self.metrics.request_seconds.labels(model).observe(seconds)


STATE: web.AppKey[ApiState] = web.AppKey("mmserver_api_state", ApiState)


def request_id(request: web.Request) -> str:
    """The id of ``request``: its own ``X-Request-Id`` when the client sent one (DJL Serving
    echoes it too), otherwise a new one."""
    return request.headers.get(REQUEST_ID) or request.app[STATE].request_ids.next()


async def read_body(request: web.Request, limit: int, timeout: float = 0.0) -> bytes:
    """The request body, refused with :class:`RequestTooLarge` once it passes ``limit`` bytes,
    and with :class:`RequestTimeout` when it has not arrived whole within ``timeout`` seconds
    (0: no limit). A client that closes its connection meanwhile raises :class:`ClientClosed`;
    a body its ``Content-Encoding`` does not decode raises :class:`InvalidInput`.

    A declared ``Content-Length`` over the limit is refused before anything is read; a chunked
    body is read incrementally and refused as soon as it passes the limit (aiohttp's
    ``client_max_size``, set to the same limit on the application). A limit of 0 means none.
    Either refusal closes the connection once answered, unread (see
    :mod:`mmserver.api.connections`).
    """
    length = request.content_length
    if length is not None and limit and length > limit:
        raise too_large(length, limit)
    if length == 0:
        return b""
    payload = request.content
    try:
        if length is not None and payload.is_eof():
            return payload.read_nowait()  # all of it has arrived (the common case): no await
        async with asyncio.timeout(timeout or None):
            return await request.read()
    except RequestPayloadError as exc:
        raise _undecodable(request, exc) from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(None, limit) from None
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout:g} s (body_timeout)"
        ) from None
    except (ConnectionError, ClientPayloadError) as exc:
        raise ClientClosed(
            f"the client closed its connection while sending the body: {exc}"
        ) from None


def _undecodable(request: web.Request, exc: RequestPayloadError) -> InvalidInput:
    """The error of a body whose framing or content coding is broken: the client's fault, said
    as such (aiohttp's own exception would be a 500 and a traceback per request)."""
    if isinstance(exc.__cause__, ContentEncodingError):
        coding = request.headers.get("Content-Encoding", "")[:40]
        return InvalidInput(
            f"the request body is not valid {coding!r} data, as its Content-Encoding says; "
            "it was not read further and the connection is closed"
        )
    return InvalidInput(
        "the request body's chunked framing is not valid HTTP/1.1; it was not read further "
        "and the connection is closed"
    )


def too_large(length: int | None, limit: int) -> RequestTooLarge:
    """The error of a request of ``length`` bytes (``None``: not known, more than ``limit``)."""
    size = f"{length} bytes" if length is not None else "more"
    return RequestTooLarge(
        f"the request body is {size}; the limit is {limit} bytes (max_request_size). "
        "Send fewer rows per request."
    )
