"""Errors become HTTP responses here and nowhere else; and the management API's access rule.

Every error answer has the JSON body ``{"code", "type", "message"}`` (``type``: DJL Serving's
Java exception name for the error, :data:`~mmserver.errors.DJL_TYPES`; on the Open Inference
Protocol's paths, under ``/v2``, the protocol's ``{"error": message}``), the status and headers
its :class:`~mmserver.errors.MMServerError` asks for, and the ``X-Request-Id`` header that every
answer has (:func:`~mmserver.api.request_id`), whose value also ends the message, so a client's
report can be matched with the server's log line. On the SageMaker paths (the routes of
:data:`~mmserver.api.protocols.SAGEMAKER`) the ``x-amzn-ErrorType`` header names the error shape
of the SageMaker Runtime API (``ValidationError``, ``ModelError``, ``ServiceUnavailable``,
``InternalFailure``), which botocore reads to raise the matching exception. Any other exception
is logged with its traceback and answered 500 with a generic message: a traceback never reaches
the client.

The rule is applied per route, not as an aiohttp middleware (which would add two coroutine frames
and a wrapper to every request, inference included): :func:`answers_errors` wraps the management
handlers (and puts ``X-Request-Id`` on their answers), the inference handler renders the data
plane's errors itself (:func:`render_error`), and :func:`unmatched`, the last route, answers any
path or method no other route takes (404, or 405 with ``Allow``).

Management calls that change state (``POST``, ``PUT``, ``DELETE`` on ``/models``, and the V2
repository's ``load`` and ``unload``) pass
:func:`authorize`: when a ``management_token`` is configured, they need
``Authorization: Bearer <token>``; without one they are open only on a loopback address, or with
``insecure_management``. gRPC's repository calls pass the same rule with the ``authorization``
metadata (:func:`check_authorization`). :func:`check_security` refuses to start a server that
would expose them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from mmserver.api.access import check_authorization
from mmserver.api.accesslog import shown_path
from mmserver.api.dataplane import log_server_error, shown_message, unexpected
from mmserver.api.protocols import Protocol, known_paths, protocol_of
from mmserver.api.state import REQUEST_ID, ApiState
from mmserver.api.web import STATE, request_id
from mmserver.errors import (
    InvalidInput,
    MethodNotAllowed,
    MMServerError,
    NotFound,
    RequestTooLarge,
    djl_type,
)

AMZN_ERROR_TYPE = "x-amzn-ErrorType"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HTTPError(MMServerError):
    """An error aiohttp raised itself, with no class of its own in the error tree."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status
        self.amzn_error_type = "ValidationError" if status < 500 else "InternalFailure"

    @property
    def error_type(self) -> str:
        return djl_type(InvalidInput if self.status_code < 500 else MMServerError)


def answers_errors(handler: Handler) -> Handler:
    """``handler``, with whatever it raises answered as the module docstring says."""

    @functools.wraps(handler)
    async def answering(request: web.Request) -> web.StreamResponse:
        try:
            response = await handler(request)
        except MMServerError as error:
            return answer_error(request, error)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(request, _from_http(request, exc), _passed_headers(exc))
        except Exception:
            return answer_unexpected(request)
        if REQUEST_ID not in response.headers:  # an error answered by the handler has one
            response.headers[REQUEST_ID] = request_id(request)
        return response

    return answering


def answer_error(request: web.Request, error: MMServerError) -> web.Response:
    """The answer to ``request`` for ``error``; a 500 is also logged."""
    response = error_response(request, error)
    if error.status_code == 500:
        log_server_error(request.method, request.path, error, response.headers[REQUEST_ID])
    return response


def answer_unexpected(request: web.Request) -> web.Response:
    """The answer to ``request`` for an exception outside the error tree (call it from the
    ``except`` clause): logged with its traceback, answered 500 with a generic message."""
    rid = request_id(request)
    return error_response(request, unexpected(request.method, request.path, rid), rid=rid)


@answers_errors
async def unmatched(request: web.Request) -> web.StreamResponse:
    """The last route: a path no route serves (404), or a method its routes do not take (405)."""
    own = request.match_info.route.resource
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not own:
            _, methods = await resource.resolve(request)
            allowed |= methods
    path = shown_path(request.path)
    if allowed:
        shown = ",".join(sorted(allowed))
        error = MethodNotAllowed(
            f"method {request.method} is not allowed on {path}; allowed: {shown}"
        )
        return error_response(request, error, {hdrs.ALLOW: shown})
    raise NotFound(
        f"no such path: {request.method} {path}. The paths are {known_paths()}, "
        "and the Open Inference Protocol's under /v2"
    )


def error_response(
    request: web.Request,
    error: MMServerError,
    extra_headers: dict[str, str] | None = None,
    *,
    rid: str | None = None,
) -> web.Response:
    """The HTTP answer for ``error`` to ``request``."""
    if rid is None:
        rid = request_id(request)
    resource = request.match_info.route.resource
    protocol = protocol_of(resource.canonical if resource is not None else None, request.path)
    body, headers = render_error(request.app[STATE], error, rid, protocol, extra_headers)
    return web.Response(
        status=error.status_code, body=body, content_type="application/json", headers=headers
    )


def render_error(
    state: ApiState,
    error: MMServerError,
    rid: str,
    protocol: Protocol,
    extra_headers: dict[str, str] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The JSON body and the headers (all but ``Content-Type``) of the answer for ``error`` to
    request ``rid`` of ``protocol``."""
    without_paths = state.without_paths
    message = shown_message(state, error, rid)
    body: dict[str, object]
    if protocol.v2_errors:
        body = {"error": message}
    else:
        body = error.to_dict()
        body["message"] = message
        if "OriginalMessage" in body:
            body["OriginalMessage"] = without_paths(error.message)
    headers = {REQUEST_ID: rid}
    if extra_headers:
        headers.update(extra_headers)
    headers.update(error.headers())
    if error.amzn_error_type is not None and protocol.amzn_errors:
        headers[AMZN_ERROR_TYPE] = error.amzn_error_type
    return json.dumps(body).encode(), headers


def _from_http(request: web.Request, exc: web.HTTPException) -> MMServerError:
    if exc.status == 413:
        return RequestTooLarge(
            f"the request body is over the limit of {request.client_max_size} bytes "
            "(max_request_size)"
        )
    return HTTPError(exc.status, exc.text or exc.reason)


def _passed_headers(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get(hdrs.ALLOW)
    return {hdrs.ALLOW: allow} if allow is not None else {}


# ------------------------------------------------------------------------------------------------
# Management access
# ------------------------------------------------------------------------------------------------


def authorize(request: web.Request) -> None:
    """Raise :class:`Unauthorized` unless ``request`` may change the server's models."""
    check_authorization(request.app[STATE].config, request.headers.get(hdrs.AUTHORIZATION))
