"""The aiohttp side of the API's shared parts: :data:`STATE`, the application key under which
the handlers find :class:`~mmserver.api.state.ApiState`, a request's id, and reading a body
within the server's limits, and aiohttp's access logger."""

from __future__ import annotations

import asyncio

from aiohttp import ClientPayloadError, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from mmserver.api.accesslog import MODEL_KEY
from mmserver.api.state import REQUEST_ID, ApiState, too_large
from mmserver.errors import ClientClosed, InvalidInput, RequestTimeout

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


class AccessLogger(AbstractAccessLogger):
    """aiohttp's access log, written to the server's :class:`AccessLog` as the lean path
    writes its own."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        access = request.app[STATE].access_log if isinstance(request, web.Request) else None
        if access is not None:
            access.write(
                request.method,
                request.path,
                response.status,
                time,
                str(request.get(MODEL_KEY, "-")),
                response.headers.get(REQUEST_ID, "-"),
                response.body_length,
            )
