"""The aiohttp application: routes, error answers and the handlers' state.

:func:`build_app` composes the HTTP layer over a WorkLoadManager and a metrics registry that the
caller owns (and starts and stops); the application holds them under
:data:`mmserver.api.STATE`. Running it — the event loop, signals, the access log, shutdown — is the
server's job: it calls :func:`check_security` before binding, and its runner
(:class:`~mmserver.api.connections.HttpRunner`) writes the access log when
:func:`access_log_enabled`.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from aiohttp import web

from mmserver.api import asynchronous, inference, management, pages, v2
from mmserver.api.access import check_security
from mmserver.api.accesslog import AccessLog
from mmserver.api.middleware import Handler, unmatched
from mmserver.api.peers import FANNED, Peers
from mmserver.api.protocols import INFER, ROUTES
from mmserver.api.state import ApiState
from mmserver.api.web import STATE
from mmserver.asynchronous import AsyncInference
from mmserver.config.server import ServerConfig
from mmserver.ops.capture import Capture
from mmserver.ops.metrics import Metrics
from mmserver.ops.tracing import tracing_from
from mmserver.tenancy.gate import TenantGate

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager

__all__ = ["access_log_enabled", "build_app", "check_security"]


def build_app(config: ServerConfig, wlm: WorkLoadManager, metrics: Metrics) -> web.Application:
    """The application serving every path of DESIGN §8 and the Open Inference Protocol's
    (§15) on one port; with traces when the environment's ``OTEL_*`` variables ask for them
    (:mod:`mmserver.ops.tracing`)."""
    app = web.Application(client_max_size=config.max_request_size)
    access = AccessLog(config.log_format) if config.access_log else None
    state = app[STATE] = ApiState(config=config, wlm=wlm, metrics=metrics, access_log=access)
    if config.tenants.strip():
        state.tenants = TenantGate(config.tenants, config.management_token)
    tracing = state.tracing = tracing_from(os.environ)
    if tracing is not None:

        async def close_tracing(app: web.Application) -> None:
            await asyncio.to_thread(tracing.shutdown)  # the spans not sent yet are sent first

        app.on_cleanup.append(close_tracing)
    if config.async_enabled:
        state.asynchronous = AsyncInference(
            config, wlm, metrics, without_paths=state.without_paths, tracing=tracing
        )
    if config.capture_path.strip():
        capture = state.capture = Capture(config.capture_path, config.capture_buffer, metrics)
        wlm.shadows.capture = capture  # shadow runs whose answers differ are captured with both

        async def start_capture(app: web.Application) -> None:
            capture.start()

        async def close_capture(app: web.Application) -> None:
            await asyncio.to_thread(capture.close)  # what is buffered is written first

        app.on_startup.append(start_capture)
        app.on_cleanup.append(close_capture)
    if config.peers.strip():
        state.peers = Peers(config.peers, config.management_token)

        async def close_peers(app: web.Application) -> None:
            if state.peers is not None:
                await state.peers.close()

        app.on_cleanup.append(close_peers)
    handlers: dict[str, Handler] = {
        **inference.HANDLERS,
        **management.HANDLERS,
        **v2.HANDLERS,
        **asynchronous.HANDLERS,
        **pages.HANDLERS,
    }
    for route in ROUTES:
        if route.operation == INFER:
            handler = inference.inference_handler(route)
        elif route.operation in FANNED:
            handler = management.fanned(handlers[route.operation])
        else:
            handler = handlers[route.operation]
        if route.method == "GET":
            app.router.add_get(route.path, handler)  # HEAD too, as aiohttp's GET routes
        else:
            app.router.add_route(route.method, route.path, handler)
    app.router.add_route("*", "/{path:.*}", unmatched)  # last: 404 and 405, as JSON errors
    return app


def access_log_enabled(config: ServerConfig) -> bool:
    """Whether to log one line per request. Off by default: it costs time on every request."""
    return config.access_log
