"""Health and inference handlers: ``/ping``, the DJL path and the three SageMaker paths.

One request: read the body (bounded), check its content type, hand it to the WorkLoadManager, and
send back the answer's body. The body is decoded, and the answer encoded, in the model's backend
process (:func:`mmserver.batching.answer_batch`): the event loop only moves bytes.

Metrics: ``mmserver_requests_total{model,code}`` and ``mmserver_request_seconds{model}`` carry the
model's name only once the WorkLoadManager has resolved the request to a model; a request that
never reached one (an unsupported content type, a bad or unknown name, refused during
shutdown) is counted under ``model="-"``, so clients cannot create series at will.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import hdrs, web

from mmserver.api import STATE, read_body
from mmserver.api.middleware import answer_error, answer_unexpected
from mmserver.codecs import make_request, response_type
from mmserver.errors import (
    InvalidInput,
    InvalidModelName,
    MMServerError,
    ModelNotFound,
    ShuttingDown,
)
from mmserver.pool import ModelPool
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


async def infer(request: web.Request) -> web.Response:
    """The four inference paths: ``POST /predictions/{model}`` (DJL), ``/models/{model}/invoke``
    (SageMaker multi-model container), ``/invocations`` and ``/endpoints/{endpoint}/invocations``
    (SageMaker, boto3).

    On the last two the model comes from the ``X-Amzn-SageMaker-Target-Model`` header (boto3's
    ``TargetModel``) or the ``model_name`` query parameter; the endpoint name is not used.

    One handler, with no coroutine under it for a loaded model: this runs for every request."""
    state = request.app[STATE]
    start = time.perf_counter()
    pool: ModelPool | None = None
    pool_name = UNRESOLVED  # the label of a request that has no pool
    code = 500
    try:
        headers = request.headers
        name = (
            request.match_info.get("model")
            or headers.get(TARGET_MODEL)
            or request.query.get("model_name")
        )
        if not name:
            raise InvalidInput(
                f"missing target model: set the {TARGET_MODEL} header (boto3: TargetModel=...) "
                "or the model_name query parameter"
            )
        body = await read_body(request, state.config.max_request_size)
        job = make_request(body, headers.get(hdrs.CONTENT_TYPE), headers.get(hdrs.ACCEPT))
        wlm = state.wlm
        pool = wlm.ready_pool(name)
        if pool is None:
            try:
                pool = await wlm.ensure_pool(name)
            except MMServerError as error:
                if not isinstance(error, _UNRESOLVED_ERRORS):
                    pool_name = _label(name)  # e.g. a model that failed to load
                raise
        transport = request.transport
        answer = await wlm.enqueue(
            pool, job, client_gone=transport.is_closing if transport is not None else None
        )
        code = 200
        pool.m_answered.inc()
        pool.m_request_seconds.observe(time.perf_counter() - start)
        return web.Response(body=answer, headers={hdrs.CONTENT_TYPE: response_type(job[2])})
    except MMServerError as error:
        code = error.status_code
        return answer_error(request, error)
    except asyncio.CancelledError:
        code = 0  # the server is stopping or the client left: no answer, nothing to count
        raise
    except Exception:
        return answer_unexpected(request)
    finally:
        if code != 200 and code:
            label = pool.name if pool is not None else pool_name
            state.observe_request(label, code, time.perf_counter() - start)


def _label(name: str) -> str:
    try:
        return normalize_name(name)
    except InvalidModelName:
        return UNRESOLVED


ROUTES = [
    web.get("/ping", ping),
    web.post("/predictions/{model}", infer),
    web.post("/invocations", infer),
    web.post("/endpoints/{endpoint}/invocations", infer),
    web.post("/models/{model}/invoke", infer),
]
