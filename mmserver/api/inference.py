"""Health and inference handlers: ``/ping``, the DJL path and the three SageMaker paths.

One request: read the body (bounded), decode it into rows, hand them to the WorkLoadManager, encode
the outputs. Decoding happens on the event loop: the JSON and CSV decoders are C code holding the
GIL, so a thread would not free the loop; large batches are best sent as ``application/x-npy``,
which decodes without parsing.

Metrics: ``mmserver_requests_total{model,code}`` and ``mmserver_request_seconds{model}`` carry the
model's name only once the WorkLoadManager has resolved the request to a model; a request that
never reached one (bad body, bad or unknown name, refused during shutdown) is counted under
``model="-"``, so clients cannot create series at will.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import hdrs, web

from mmserver.api import STATE, read_body
from mmserver.codecs import decode, encode
from mmserver.errors import (
    InvalidInput,
    InvalidModelName,
    MMServerError,
    ModelNotFound,
    ShuttingDown,
)
from mmserver.store import normalize_name

TARGET_MODEL = "X-Amzn-SageMaker-Target-Model"
UNRESOLVED = "-"

# Errors from WorkLoadManager.infer that say the name did not lead to a model.
_UNRESOLVED_ERRORS = (InvalidModelName, ModelNotFound, ShuttingDown)

_HEALTHY = b'{"status": "Healthy"}'
_UNHEALTHY = (
    b'{"status": "Unhealthy", "code": 503, "type": "ShuttingDown", '
    b'"message": "the server is shutting down and accepts no new requests"}'
)


async def ping(request: web.Request) -> web.Response:
    """200 ``{"status": "Healthy"}``; 503 once shutdown has begun."""
    if request.app[STATE].wlm.accepting:
        return web.Response(body=_HEALTHY, content_type="application/json")
    return web.Response(status=503, body=_UNHEALTHY, content_type="application/json")


async def predictions(request: web.Request) -> web.Response:
    """``POST /predictions/{model}`` (DJL)."""
    return await _infer(request, request.match_info["model"])


async def invoke(request: web.Request) -> web.Response:
    """``POST /models/{model}/invoke`` (SageMaker multi-model container)."""
    return await _infer(request, request.match_info["model"])


async def invocations(request: web.Request) -> web.Response:
    """``POST /invocations`` and ``POST /endpoints/{endpoint}/invocations`` (SageMaker, boto3).

    The model comes from the ``X-Amzn-SageMaker-Target-Model`` header (boto3's ``TargetModel``)
    or the ``model_name`` query parameter; the endpoint name is not used.
    """
    name = request.headers.get(TARGET_MODEL) or request.query.get("model_name")
    return await _infer(request, name)


async def _infer(request: web.Request, name: str | None) -> web.Response:
    state = request.app[STATE]
    start = time.perf_counter()
    label = UNRESOLVED
    code = 500
    try:
        if not name:
            raise InvalidInput(
                f"missing target model: set the {TARGET_MODEL} header (boto3: TargetModel=...) "
                "or the model_name query parameter"
            )
        body = await read_body(request, state.config.max_request_size)
        rows = decode(body, request.headers.get(hdrs.CONTENT_TYPE))
        try:
            outputs = await state.wlm.infer(name, rows, client_gone=_client_gone(request))
        except MMServerError as error:
            if not isinstance(error, _UNRESOLVED_ERRORS):
                label = _label(name)
            raise
        label = _label(name)
        payload, content_type = encode(outputs, request.headers.get(hdrs.ACCEPT))
        code = 200
        return web.Response(body=payload, headers={hdrs.CONTENT_TYPE: content_type})
    except MMServerError as error:
        code = error.status_code
        raise
    except asyncio.CancelledError:
        code = 0  # the server is stopping or the client left: no answer, nothing to count
        raise
    finally:
        if code:
            state.observe_request(label, code, time.perf_counter() - start)


def _label(name: str) -> str:
    try:
        return normalize_name(name)
    except InvalidModelName:
        return UNRESOLVED


def _client_gone(request: web.Request) -> Callable[[], bool]:
    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


#: The SageMaker paths: their errors carry ``x-amzn-ErrorType``.
SAGEMAKER_PATHS = frozenset(
    {"/invocations", "/endpoints/{endpoint}/invocations", "/models/{model}/invoke"}
)

ROUTES = [
    web.get("/ping", ping),
    web.post("/predictions/{model}", predictions),
    web.post("/invocations", invocations),
    web.post("/endpoints/{endpoint}/invocations", invocations),
    web.post("/models/{model}/invoke", invoke),
]
