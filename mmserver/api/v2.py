"""The Open Inference Protocol (KServe V2, REST), beside the DJL and SageMaker paths.

- health: ``GET /v2/health/live`` (200 ``{"live": true}`` while the process serves, draining
  included), ``GET /v2/health/ready`` (200 ``{"ready": true}`` while it accepts work, 503
  ``{"ready": false}`` once shutdown has begun, or at start while the warm set loads within
  ``warm_ready_timeout``),
  ``GET /v2/models/{model}[/versions/{version}]/ready`` (200 when loaded, 400 when not, 404 for
  a model the server does not know);
- metadata: ``GET /v2`` (server) and ``GET /v2/models/{model}[/versions/{version}]`` (loads the
  model if needed: its inputs and outputs are what its backend found in the estimator);
- inference: ``POST /v2/models/{model}[/versions/{version}]/infer``, JSON tensors or Triton's
  binary tensor data extension (:mod:`mmserver.codecs.v2_requests`), through the data plane like
  every other inference route (:data:`mmserver.api.protocols.V2`): same queues, batching, scaling
  and metrics, the body decoded in the backend;
- Triton's model repository extension: ``POST /v2/repository/index``,
  ``POST /v2/repository/models/{model}/load`` and ``.../unload``, over the WorkLoadManager, the
  last two under the management access rule (:func:`~mmserver.api.middleware.authorize`).

Every model has one version, ``1``. Errors have the protocol's body, ``{"error": message}``
(:func:`~mmserver.api.middleware.error_response`), with the status of their class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import hdrs, web

from mmserver.api.access import check_visible, viewer
from mmserver.api.management import request_params
from mmserver.api.middleware import Handler, answers_errors, authorize
from mmserver.api.protocols import versioned
from mmserver.api.repository import (
    SERVER_METADATA,
    bool_param,
    index_of,
    load,
    metadata_of,
    not_ready_reason,
    unload,
)
from mmserver.api.state import REQUEST_ID
from mmserver.api.web import STATE, request_id
from mmserver.codecs.v2 import (
    parameters_of,
)
from mmserver.errors import ModelNotReady

if TYPE_CHECKING:
    pass


_JSON = "application/json"
_BINARY = "application/octet-stream"


# ------------------------------------------------------------------------------------------------
# Health and metadata
# ------------------------------------------------------------------------------------------------


async def live(request: web.Request) -> web.Response:
    """200 ``{"live": true}`` while the process serves, also while it drains (a liveness
    probe)."""
    return web.json_response({"live": True}, headers={REQUEST_ID: request_id(request)})


async def ready(request: web.Request) -> web.Response:
    """200 ``{"ready": true}`` while the server accepts work; 503 ``{"ready": false}`` once
    shutdown has begun, and at start while the warm set is loaded again within
    ``warm_ready_timeout`` (a readiness probe)."""
    ready = request.app[STATE].wlm.healthy()
    return web.json_response(
        {"ready": ready},
        status=200 if ready else 503,
        headers={REQUEST_ID: request_id(request)},
    )


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(SERVER_METADATA)


async def model_ready(request: web.Request) -> web.Response:
    """200 when the model is loaded; 400 saying why not (it loads on its first request, or on
    a repository load); 404 for a model the server does not know."""
    name = _model_of(request)
    _check_visible(request, name)
    reason = await not_ready_reason(request.app[STATE].wlm, name)
    if reason is not None:
        raise ModelNotReady(reason)
    return web.json_response({"name": request.match_info["model"], "ready": True})


async def model_metadata(request: web.Request) -> web.Response:
    """The model's name, version, platform, inputs and outputs; loads the model if needed."""
    name = _model_of(request)
    _check_visible(request, name)
    return web.json_response(await metadata_of(request.app[STATE].wlm, name))


# ------------------------------------------------------------------------------------------------
# What both doors answer (REST here, gRPC in mmserver.api.grpc.service)
# ------------------------------------------------------------------------------------------------


def _check_visible(request: web.Request, name: str) -> None:
    """Raise unless the caller may see model ``name`` (a server with tenants)."""
    gate = request.app[STATE].tenants
    check_visible(gate, viewer(gate, request.headers.get(hdrs.AUTHORIZATION)), name)


def _model_of(request: web.Request) -> str:
    """The model named by the path; :class:`ModelNotFound` for a version other than ``1``."""
    return versioned(request.match_info["model"], request.match_info.get("version"))


# ------------------------------------------------------------------------------------------------
# Model repository extension
# ------------------------------------------------------------------------------------------------


async def repository_index(request: web.Request) -> web.Response:
    """Every model of the store and every registered one, with its state; ``{"ready": true}``
    in the body keeps the loaded ones only."""
    state = request.app[STATE]
    caller = viewer(state.tenants, request.headers.get(hdrs.AUTHORIZATION))
    only_ready = bool_param(await request_params(request), "ready", default=False)
    return web.json_response(await index_of(state.wlm, only_ready, state.tenants, caller))


async def repository_load(request: web.Request) -> web.Response:
    """Load a model of the store (or a registered one) now; a loaded model stays as it is."""
    authorize(request)
    parameters = parameters_of(await request_params(request), "the request", allow_null=False)
    await load(request.app[STATE].wlm, request.match_info["model"], parameters)
    return web.Response()


async def repository_unload(request: web.Request) -> web.Response:
    """Unload a model (a store model loads again on its next request); a model of the store
    that is not loaded is left as it is."""
    authorize(request)
    parameters = parameters_of(await request_params(request), "the request", allow_null=False)
    await unload(request.app[STATE].wlm, request.match_info["model"], parameters)
    return web.Response()


#: The handlers of the V2 routes other than inference, by operation
#: (:data:`~mmserver.api.protocols.ROUTES`).
HANDLERS: dict[str, Handler] = {
    "server_metadata": answers_errors(server_metadata),
    "live": live,
    "ready": ready,
    "model_ready": answers_errors(model_ready),
    "model_metadata": answers_errors(model_metadata),
    "repository_index": answers_errors(repository_index),
    "repository_load": answers_errors(repository_load),
    "repository_unload": answers_errors(repository_unload),
}
