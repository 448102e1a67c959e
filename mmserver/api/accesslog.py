"""The access log (``access_log``, off by default): one record per answered request, whichever
door answered it, on the logger ``mmserver.access``.

A record says the method, the path, the status, the time in the server, the model the request
named (``-`` for none), the request id and the bytes of the answer. As text:
``POST /predictions/m 200 1.84 ms model=m bytes=31 4f2a9c1e-1b``; with ``--log-format json``
each is a field of its own (``method``, ``path``, ``status``, ``latency_ms``, ``model``,
``request_id``, ``bytes``). The lean path writes it for the requests it answers, aiohttp's
access logger (:class:`AccessLogger`) for the others.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from mmserver.api import REQUEST_ID
from mmserver.api.dataplane import shown_path

log = logging.getLogger("mmserver.access")

#: Where an inference handler leaves the model a request named, for :class:`AccessLogger`.
MODEL_KEY = "mmserver_model"


def write(
    method: str, path: str, status: int, seconds: float, model: str, rid: str, size: int
) -> None:
    """One access record."""
    latency_ms = round(seconds * 1000, 3)
    log.info(
        "%s %s %d %.2f ms model=%s bytes=%d %s",
        method,
        shown_path(path),
        status,
        latency_ms,
        model,
        size,
        rid,
        extra={
            "method": method,
            "path": path,
            "status": status,
            "latency_ms": latency_ms,
            "model": model,
            "request_id": rid,
            "bytes": size,
        },
    )


class AccessLogger(AbstractAccessLogger):
    """aiohttp's access log, written as :func:`write` writes the lean path's."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        write(
            request.method,
            request.path,
            response.status,
            time,
            str(request.get(MODEL_KEY, "-")),
            response.headers.get(REQUEST_ID, "-"),
            response.body_length,
        )
