"""The Open Inference Protocol (KServe V2, REST), beside the DJL and SageMaker paths.

- health: ``GET /v2/health/live`` (200 while the process serves, draining included),
  ``GET /v2/health/ready`` (200 while it accepts work, 503 once shutdown has begun),
  ``GET /v2/models/{model}[/versions/{version}]/ready`` (200 when loaded, 400 when not, 404 for
  a model the server does not know);
- metadata: ``GET /v2`` (server) and ``GET /v2/models/{model}[/versions/{version}]`` (loads the
  model if needed: its inputs and outputs are what its backend found in the estimator);
- inference: ``POST /v2/models/{model}[/versions/{version}]/infer``, JSON tensors or Triton's
  binary tensor data extension (:mod:`mmserver.codecs.v2`), through the data plane like every
  other inference route (:data:`mmserver.api.protocols.V2`): same queues, batching, scaling and
  metrics, the body decoded in the backend;
- Triton's model repository extension: ``POST /v2/repository/index``,
  ``POST /v2/repository/models/{model}/load`` and ``.../unload``, over the WorkLoadManager, the
  last two under the management access rule (:func:`~mmserver.api.middleware.authorize`).

Every model has one version, ``1``. Errors have the protocol's body, ``{"error": message}``
(:func:`~mmserver.api.middleware.error_response`), with the status of their class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web

from mmserver import __version__
from mmserver.api import REQUEST_ID, STATE, request_id
from mmserver.api.management import bool_param, request_params
from mmserver.api.middleware import Handler, answers_errors, authorize
from mmserver.api.protocols import versioned
from mmserver.codecs.v2 import (
    VERSION,
    datatype_of,
    parameters_of,
)
from mmserver.errors import InvalidInput, ModelNotFound, ModelNotReady, ShuttingDown
from mmserver.lifecycle.record import ModelStatus
from mmserver.store import normalize_name, split_version

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager

SERVER_NAME = "mmserver"
EXTENSIONS = ("binary_tensor_data", "model_repository")
#: The name the metadata gives the model's input (any name is accepted).
INPUT_NAME = "input-0"

_JSON = "application/json"
_BINARY = "application/octet-stream"

# The repository index's states (Triton's names) for a model's status.
_STATES = {
    ModelStatus.READY: "READY",
    ModelStatus.LOADING: "LOADING",
    ModelStatus.UNLOADING: "UNLOADING",
    ModelStatus.FAILED: "UNAVAILABLE",
    ModelStatus.UNLOADED: "UNAVAILABLE",
}


# ------------------------------------------------------------------------------------------------
# Health and metadata
# ------------------------------------------------------------------------------------------------


async def live(request: web.Request) -> web.Response:
    """200 while the process serves, also while it drains (a liveness probe)."""
    return web.Response(headers={REQUEST_ID: request_id(request)})


async def ready(request: web.Request) -> web.Response:
    """200 while the server accepts work; 503 once shutdown has begun (a readiness probe)."""
    status = 200 if request.app[STATE].wlm.accepting else 503
    return web.Response(status=status, headers={REQUEST_ID: request_id(request)})


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(SERVER_METADATA)


async def model_ready(request: web.Request) -> web.Response:
    """200 when the model is loaded; 400 saying why not (it loads on its first request, or on
    a repository load); 404 for a model the server does not know."""
    name = _model_of(request)
    reason = await not_ready_reason(request.app[STATE].wlm, name)
    if reason is not None:
        raise ModelNotReady(reason)
    return web.Response()


async def model_metadata(request: web.Request) -> web.Response:
    """The model's name, version, platform, inputs and outputs; loads the model if needed."""
    return web.json_response(await metadata_of(request.app[STATE].wlm, _model_of(request)))


# ------------------------------------------------------------------------------------------------
# What both doors answer (REST here, gRPC in mmserver.api.grpc)
# ------------------------------------------------------------------------------------------------

#: The server's metadata.
SERVER_METADATA: dict[str, Any] = {
    "name": SERVER_NAME,
    "version": __version__,
    "extensions": list(EXTENSIONS),
}


async def not_ready_reason(wlm: WorkLoadManager, name: str) -> str | None:
    """Why model ``name`` is not ready (``None``: it is): it loads on its first request or on a
    repository load. Raises :class:`ModelNotFound` for a model the server does not know, and
    :class:`ShuttingDown` once shutdown has begun."""
    if not wlm.accepting:
        raise ShuttingDown("the server is shutting down; its models take no new requests")
    name = await wlm.resolve(name)
    status = wlm.status(name)
    if status is ModelStatus.READY:
        return None
    await wlm.describe(name)  # ModelNotFound (404) for a model the server does not know
    reason = wlm.failure(name) if status is ModelStatus.FAILED else None
    return (
        f"model {name} is not ready: it is {status.value.lower()}"
        + (f" ({reason})" if reason else "")
        + f"; it loads on its first inference request or on POST /v2/repository/models/{name}/load"
    )


async def metadata_of(wlm: WorkLoadManager, name: str) -> dict[str, Any]:
    """Model ``name``'s V2 metadata (:func:`describe`), loading it first if needed."""
    key = await wlm.ready(name)
    metadata = describe(key, wlm.signature(key))
    base, version = split_version(key)
    if version is not None:
        rollout = await wlm.rollout(base)
        metadata["name"] = base
        metadata["versions"] = [str(v) for v in (rollout.versions if rollout else (version,))]
    return metadata


#: A column's kind (:mod:`mmserver.codecs.schema`) to the datatype of its V2 input.
_COLUMN_DATATYPES = {"number": "FP64", "string": "BYTES", "boolean": "BOOL", "category": "BYTES"}


def describe(name: str, signature: dict[str, Any] | None) -> dict[str, Any]:
    """V2 model metadata from a model's :func:`~mmserver.execution.predictor.signature` (``None``:
    not
    known yet, the model has not been loaded into a backend; no inputs nor outputs then)."""
    metadata: dict[str, Any] = {"name": name, "versions": [VERSION], "platform": ""}
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    if signature is not None:
        metadata["platform"] = signature["platform"]
        columns = signature.get("inputs")
        if columns:  # a model fitted on a DataFrame: one input per column (MLServer's pandas)
            inputs.extend(
                {"name": c["name"], "datatype": _COLUMN_DATATYPES[c["kind"]], "shape": [-1]}
                for c in columns
            )
        else:
            width = signature["n_features"] or -1
            inputs.append({"name": INPUT_NAME, "datatype": "FP64", "shape": [-1, width]})
        for output in signature["outputs"]:
            if output["dtype"] is not None:  # a custom handler's output: not known before
                outputs.append(
                    {
                        "name": output["name"],
                        "datatype": datatype_of(np.dtype(output["dtype"])),
                        "shape": output["shape"],
                    }
                )
    metadata["inputs"] = inputs
    metadata["outputs"] = outputs
    return metadata


def _model_of(request: web.Request) -> str:
    """The model named by the path; :class:`ModelNotFound` for a version other than ``1``."""
    return versioned(request.match_info["model"], request.match_info.get("version"))


# ------------------------------------------------------------------------------------------------
# Model repository extension
# ------------------------------------------------------------------------------------------------


async def repository_index(request: web.Request) -> web.Response:
    """Every model of the store and every registered one, with its state; ``{"ready": true}``
    in the body keeps the loaded ones only."""
    only_ready = bool_param(await request_params(request), "ready", default=False)
    return web.json_response(await index_of(request.app[STATE].wlm, only_ready))


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


async def index_of(wlm: WorkLoadManager, only_ready: bool) -> list[dict[str, str]]:
    """The repository index: every model of the store and every registered one, with its
    version, state (Triton's names) and the reason for it (a model with versions the server
    has read: a row per version); the loaded ones only when ``only_ready``."""
    index = []
    for model in await wlm.list_models():
        rollout = wlm.known_rollout(model.name)
        rows = (
            [(model.name, VERSION, model.status)]
            if rollout is None
            else [(rollout.key(v), str(v), wlm.status(rollout.key(v))) for v in rollout.versions]
        )
        for key, version, status in rows:
            if only_ready and status is not ModelStatus.READY:
                continue
            reason = ""
            if status is ModelStatus.FAILED:
                reason = wlm.failure(key) or "the last load failed"
            elif status is ModelStatus.UNLOADED:
                reason = "not loaded"
            index.append(
                {"name": model.name, "version": version, "state": _STATES[status], "reason": reason}
            )
    return index


async def load(wlm: WorkLoadManager, name: str, parameters: Mapping[str, Any]) -> None:
    """Load model ``name`` now, with the repository call's ``parameters`` (checked: a model's
    configuration and files cannot come with the call). The caller has authorized the call."""
    name = normalize_name(name)
    for key in parameters:
        if key == "config" or key.startswith("file:"):
            raise InvalidInput(
                f"load parameter {key!r} is not supported: a model's configuration is its "
                "serving.properties, and its files come from the model store"
            )
    await wlm.load(name)


async def unload(wlm: WorkLoadManager, name: str, parameters: Mapping[str, Any]) -> None:
    """Unload model ``name``, with the repository call's ``parameters`` (checked); a model of
    the store that is not loaded is left as it is. The caller has authorized the call."""
    name = normalize_name(name)
    bool_param(parameters, "unload_dependents", default=False)  # checked; no model has any
    try:
        await wlm.unload(name)
    except ModelNotFound:
        await wlm.describe(name)  # ModelNotFound again for a model the server does not know


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
