"""Asynchronous inference over HTTP: ``POST /endpoints/{endpoint}/async-invocations`` exactly as
boto3's ``sagemaker-runtime`` ``invoke_endpoint_async`` sends it (the endpoint names the model),
and ``GET /async-invocations/{inference_id}``, the request's state.

The 202 is sent once the request is in the journal (:meth:`AsyncInference.accept
<mmserver.asynchronous.runner.AsyncInference.accept>`): its body holds ``InferenceId`` and its
headers the output and failure locations, where botocore reads them. On a server without a
``state_dir`` both paths answer 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from mmserver.api.middleware import Handler, answers_errors
from mmserver.api.web import STATE, read_body
from mmserver.asynchronous import AsyncInference, AsyncRequest, Invocation
from mmserver.asynchronous.requests import FAILURE_LOCATION, OUTPUT_LOCATION
from mmserver.asynchronous.runner import unknown_request
from mmserver.errors import NotFound
from mmserver.tenancy.gate import OPERATOR, THROTTLE_HOLD_S, AccessDenied, Throttled


def _runner(request: web.Request) -> AsyncInference:
    runner = request.app[STATE].asynchronous
    if runner is None:
        raise NotFound(
            "asynchronous inference is not enabled on this server: start it with a state_dir"
        )
    return runner


async def invoke_async(request: web.Request) -> web.Response:
    """``InvokeEndpointAsync``: 202 ``{"InferenceId": ...}`` with the output and failure
    locations once the request is journaled."""
    runner = _runner(request)
    headers = request.headers
    state = request.app[STATE]
    config = state.config
    body = await read_body(request, config.max_request_size, config.body_timeout)
    asked = AsyncRequest.from_headers(request.match_info["endpoint"], headers.get)
    gate = state.tenants
    if gate is not None:
        caller = gate.authenticate(True, request.method, request.raw_path, headers.get, body)
        try:
            release = gate.admit(caller, asked.model)  # its rate; no place held while queued
        except Throttled:
            await asyncio.sleep(THROTTLE_HOLD_S)  # see mmserver.tenancy.gate
            raise
        if release is not None:
            release(None)
        if asked.input_location is not None and caller is not OPERATOR:
            raise AccessDenied(
                f"tenant {caller.name}: a tenant's asynchronous request carries its input in "
                "the body (InputLocation names the server's storage, which is not a tenant's)"
            )
    invocation, _ = await runner.accept(asked, body)
    return web.json_response(
        {"InferenceId": invocation.id},
        status=202,
        headers={OUTPUT_LOCATION: invocation.output, FAILURE_LOCATION: invocation.failure},
    )


async def async_status(request: web.Request) -> web.Response:
    """The state of one asynchronous request and where its answer is (or will be)."""
    runner = _runner(request)
    gate = request.app[STATE].tenants
    inference_id = request.match_info["inference_id"]
    if gate is None:
        return web.json_response(describe(await runner.status(inference_id)))
    caller = gate.authenticate(True, request.method, request.raw_path, request.headers.get, b"")
    invocation = await runner.status(inference_id)
    if not gate.may_see(caller, invocation.model):
        raise unknown_request(inference_id)  # another tenant's: as if there were none
    return web.json_response(describe(invocation))


def describe(invocation: Invocation) -> dict[str, Any]:
    described: dict[str, Any] = {
        "InferenceId": invocation.id,
        "EndpointName": invocation.model,
        "Status": invocation.state.value,
        "InputLocation": invocation.input,
        "OutputLocation": invocation.output,
        "FailureLocation": invocation.failure,
        "AcceptedAt": invocation.accepted_at,
        "RequestTTLSeconds": invocation.ttl_s,
        "InvocationTimeoutSeconds": invocation.timeout_s,
    }
    if invocation.ended_at is not None:
        described["EndedAt"] = invocation.ended_at
    if invocation.error is not None:
        described["Error"] = invocation.error
    return described


HANDLERS: dict[str, Handler] = {
    "invoke_async": answers_errors(invoke_async),
    "async_status": answers_errors(async_status),
}
