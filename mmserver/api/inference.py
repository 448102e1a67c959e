"""Health and inference over aiohttp: ``/ping`` and the handler of every inference route.

One request: read the body (bounded), then the data plane (:class:`~mmserver.api.dataplane.
Exchange`) makes the job of the route's protocol, hands it to the WorkLoadManager, and renders
the answer or the error, counted. The body is decoded, and the answer encoded, in the model's
backend process (:func:`mmserver.backend.batching.answer_batch`): the event loop only moves
bytes. :func:`inference_handler` makes the handler of one route of
:data:`~mmserver.api.protocols.ROUTES`.
"""

from __future__ import annotations

import asyncio

from aiohttp import hdrs, web

from mmserver.api.accesslog import MODEL_KEY
from mmserver.api.dataplane import Exchange
from mmserver.api.middleware import Handler, render_error
from mmserver.api.protocols import ROUTING_KEY, TARGET_MODEL, Route
from mmserver.api.state import REQUEST_ID
from mmserver.api.web import STATE, read_body, request_id
from mmserver.ops.traces import TRACEPARENT, TRACESTATE, http_door
from mmserver.tenancy.gate import THROTTLE_HOLD_S, Throttled

_HEALTHY = b'{"status": "Healthy"}'
_UNHEALTHY = (
    b'{"status": "Unhealthy", "code": 503, "type": "WlmShutdownException", '
    b'"message": "the server is shutting down and accepts no new requests"}'
)
_JSON = "application/json"


async def ping(request: web.Request) -> web.Response:
    """200 ``{"status": "Healthy"}``; 503 once shutdown has begun, and at start while the warm
    set is loaded again within ``warm_ready_timeout``."""
    headers = {REQUEST_ID: request_id(request)}
    if request.app[STATE].wlm.healthy():
        return web.Response(body=_HEALTHY, content_type=_JSON, headers=headers)
    return web.Response(status=503, body=_UNHEALTHY, content_type=_JSON, headers=headers)


def inference_handler(route: Route) -> Handler:
    """The handler of the inference route ``route``: read the body (bounded), submit it through
    the data plane (which loads the model if needed), and answer in the route's protocol.

    One coroutine, with no coroutine under it for a loaded model: this runs for every request.
    Errors are answered here."""
    protocol = route.protocol
    door = http_door(route.method, route.path)

    async def infer(request: web.Request) -> web.Response:
        state = request.app[STATE]
        headers = request.headers
        exchange = Exchange(state, protocol, headers.get(REQUEST_ID) or state.request_ids.next())
        if state.tracing is not None:
            exchange.sample(state.tracing, door, headers.get(TRACEPARENT), headers.get(TRACESTATE))
        try:
            name = route.model_name(
                request.match_info, headers.get(TARGET_MODEL), request.query.get("model_name")
            )
            if state.config.access_log:
                request[MODEL_KEY] = name
            config = state.config
            body = await read_body(request, config.max_request_size, config.body_timeout)
            if state.tenants is not None:
                exchange.authenticate(request.method, request.raw_path, headers.get, body)
            transport = request.transport
            answer = await exchange.submit(
                name,
                body,
                headers.get(hdrs.CONTENT_TYPE),
                headers.get(hdrs.ACCEPT),
                None if protocol.header is None else headers.get(protocol.header),
                transport.is_closing if transport is not None else None,
                headers.get(ROUTING_KEY),
            )
            answered, content_type, extra = exchange.answered(answer)
        except asyncio.CancelledError:
            raise  # the server is stopping or the client left: no answer, nothing to count
        except Exception as exc:
            shown = exchange.failed(exc, request.method, request.path)
            if isinstance(exc, Throttled):
                await asyncio.sleep(THROTTLE_HOLD_S)  # see mmserver.tenancy.gate
            error_body, error_headers = render_error(state, shown, exchange.rid, protocol)
            return web.Response(
                status=shown.status_code,
                body=error_body,
                content_type="application/json",
                headers=error_headers,
            )
        response_headers: dict[str, str] = {hdrs.CONTENT_TYPE: content_type}
        if extra is not None:
            response_headers.update(extra)
        response_headers[REQUEST_ID] = exchange.rid
        return web.Response(body=answered, headers=response_headers)

    return infer


#: The handlers of this module's routes other than inference, by operation.
HANDLERS: dict[str, Handler] = {"ping": ping}
