"""Health and inference handlers: ``/ping``, the DJL path and the three SageMaker paths.

One request: read the body (bounded), check its content type, hand it to the WorkLoadManager, and
send back the answer's body. The body is decoded, and the answer encoded, in the model's backend
process (:func:`mmserver.backend.batching.answer_batch`): the event loop only moves bytes.
:func:`inference_handler` makes that handler for a protocol; the Open Inference Protocol's
(:mod:`mmserver.api.v2`) is made by it too.

Metrics: ``mmserver_requests_total{model,code}`` and ``mmserver_request_seconds{model}`` carry the
model's name only once the WorkLoadManager has resolved the request to a model; a request that
never reached one (an unsupported content type, a bad or unknown name, refused during
shutdown) is counted under ``model="-"``, so clients cannot create series at will.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import hdrs, web
from multidict import CIMultiDictProxy

from mmserver.answers import answer_body
from mmserver.api import REQUEST_ID, STATE, read_body, request_id
from mmserver.api.middleware import Handler, answer_error, answer_unexpected
from mmserver.codecs import Request, make_request
from mmserver.errors import (
    InvalidInput,
    InvalidModelName,
    MMServerError,
    ModelNotFound,
    ShuttingDown,
)
from mmserver.store import normalize_name
from mmserver.wlm import Submission

TARGET_MODEL = "X-Amzn-SageMaker-Target-Model"
UNRESOLVED = "-"

# Errors from WorkLoadManager.submit that say the name did not lead to a model.
_UNRESOLVED_ERRORS = (InvalidModelName, ModelNotFound, ShuttingDown)

_HEALTHY = b'{"status": "Healthy"}'
_UNHEALTHY = (
    b'{"status": "Unhealthy", "code": 503, "type": "WlmShutdownException", '
    b'"message": "the server is shutting down and accepts no new requests"}'
)
_JSON = "application/json"


async def ping(request: web.Request) -> web.Response:
    """200 ``{"status": "Healthy"}``; 503 once shutdown has begun."""
    headers = {REQUEST_ID: request_id(request)}
    if request.app[STATE].wlm.accepting:
        return web.Response(body=_HEALTHY, content_type=_JSON, headers=headers)
    return web.Response(status=503, body=_UNHEALTHY, content_type=_JSON, headers=headers)


#: Where a protocol finds the model's name in a request (raising when it is missing), how it
#: makes the :data:`~mmserver.codecs.Request` from the body and headers (checking only the
#: headers), and how it answers with the body the model's backend encoded.
ModelOf = Callable[[web.Request], str]
MakeJob = Callable[[bytes, CIMultiDictProxy[str]], Request]
Respond = Callable[[bytes, Request], web.Response]


def inference_handler(model_of: ModelOf, make_job: MakeJob, respond: Respond) -> Handler:
    """The handler of one protocol's inference paths: read the body (bounded), make the job,
    submit it to the WorkLoadManager (which loads the model if needed), and answer.

    One coroutine, with no coroutine under it for a loaded model: this runs for every request.
    Errors are answered here, in the request's protocol (:func:`answer_error`)."""

    async def infer(request: web.Request) -> web.Response:
        state = request.app[STATE]
        start = time.perf_counter()
        submission: Submission | None = None
        name = UNRESOLVED
        failure: BaseException | None = None
        code = 500
        try:
            name = model_of(request)
            config = state.config
            body = await read_body(request, config.max_request_size, config.body_timeout)
            job = make_job(body, request.headers)
            transport = request.transport
            submission = state.wlm.submit(
                name, job, transport.is_closing if transport is not None else None
            )
            answer = await submission.answer
            response = respond(answer, job)
            response.headers[REQUEST_ID] = (
                request.headers.get(REQUEST_ID) or state.request_ids.next()
            )
            code = 200
            requests = submission.requests
            if requests is not None:
                requests.answered(time.perf_counter() - start)
            return response
        except MMServerError as error:
            code = error.status_code
            failure = error
            return answer_error(request, error)
        except asyncio.CancelledError:
            code = 0  # the server is stopping or the client left: no answer, nothing to count
            raise
        except Exception:
            return answer_unexpected(request)
        finally:
            if code != 200 and code:
                label = failure_label(name, submission, failure)
                state.observe_request(label, code, time.perf_counter() - start)

    return infer


def _target_model(request: web.Request) -> str:
    """DJL and SageMaker: the model of ``/predictions/{model}`` and ``/models/{model}/invoke``;
    on ``/invocations`` and ``/endpoints/{endpoint}/invocations``, the
    ``X-Amzn-SageMaker-Target-Model`` header (boto3's ``TargetModel``) or the ``model_name``
    query parameter (the endpoint name is not used)."""
    name = (
        request.match_info.get("model")
        or request.headers.get(TARGET_MODEL)
        or request.query.get("model_name")
    )
    if not name:
        raise missing_target()
    return name


def missing_target() -> InvalidInput:
    """The error of a ``/invocations`` request that names no model."""
    return InvalidInput(
        f"missing target model: set the {TARGET_MODEL} header (boto3: TargetModel=...) "
        "or the model_name query parameter"
    )


def _make_job(body: bytes, headers: CIMultiDictProxy[str]) -> Request:
    return make_request(body, headers.get(hdrs.CONTENT_TYPE), headers.get(hdrs.ACCEPT))


def _respond(answer: bytes, job: Request) -> web.Response:
    body, content_type = answer_body(answer, job[2])
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})


#: The four inference paths of DJL and SageMaker: ``POST /predictions/{model}`` (DJL),
#: ``/models/{model}/invoke`` (SageMaker multi-model container), ``/invocations`` and
#: ``/endpoints/{endpoint}/invocations`` (SageMaker, boto3).
infer = inference_handler(_target_model, _make_job, _respond)


def failure_label(name: str, submission: Submission | None, error: BaseException | None) -> str:
    """The model a request that failed with ``error`` is counted under: its model once the
    request reached one, the name it asked for when that name led to a model that failed (to
    load, say), otherwise :data:`UNRESOLVED`."""
    if submission is None:
        return UNRESOLVED
    if submission.requests is not None:
        return submission.requests.model
    if isinstance(error, MMServerError) and not isinstance(error, _UNRESOLVED_ERRORS):
        return _label(name)
    return UNRESOLVED


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
