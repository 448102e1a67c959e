"""Management and metrics handlers: ``/models`` (DJL's management API) and ``/metrics``.

Parameters come from the query string or from a JSON (or form) body; the body wins where both
name a key. DJL's names are used: ``min_worker``, ``max_worker``, ``batch_size``,
``max_batch_delay`` (ms), ``max_idle_time`` (s), ``job_queue_size``, ``synchronous``; and the
server's own ``pinned`` on ``PUT /models/{model}``.
``PUT /models/{model}`` refuses a parameter it does not take (400, with the closest name it
does); ``POST /models`` ignores those of DJL's it has no use for (``engine``,
``model_version`` ...). A configuration the model cannot
take (``min_worker`` above ``max_worker``, say) is answered 400. ``max_worker=0`` is taken, as
DJL takes it: the model keeps no worker and its requests are answered 503 until it is given some.

Answers are DJL Serving's (``ManagementRequestHandler``): the same status messages, and describe
as DJL's ``DescribeWorkflowResponse``, a list of workflows each holding its models.

``GET /models`` pages through the models sorted by name: ``limit`` (1 to 100; larger values are
capped at 100, as in DJL) and ``next_page_token``, which is the last name of the previous page,
so pages stay consistent while models come and go.
"""

from __future__ import annotations

import asyncio
import datetime
import difflib
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import hdrs, web

from mmserver.api import peers
from mmserver.api.access import check_metrics, check_visible, shows_paths, viewer
from mmserver.api.middleware import Handler, answers_errors, authorize
from mmserver.api.protocols import versioned
from mmserver.api.repository import bool_param, shown_value
from mmserver.api.state import ApiState
from mmserver.api.web import STATE, read_body
from mmserver.codecs.requests import media_type
from mmserver.config.model import LEAST, MANAGEMENT_PARAMS, mistyped_keys, out_of_order, short_of
from mmserver.errors import ConfigError, InvalidInput, InvalidModelName
from mmserver.lifecycle.record import ModelStatus
from mmserver.manager.wlm import ModelView
from mmserver.policy.rollout import percent_of
from mmserver.store.names import normalize_name
from mmserver.store.urls import name_from_url
from mmserver.tenancy.gate import OPERATOR

log = logging.getLogger(__name__)

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_PAGE = 100

# Request parameter -> WorkLoadManager override key.
#: The parameters of POST /models, each the management name of an option (DJL's spelling).
_REGISTER_PARAMS = MANAGEMENT_PARAMS
#: The parameters of PUT /models/{model}: every per-model setting a management call changes.
_RESCALE_PARAMS = MANAGEMENT_PARAMS
#: What else PUT /models/{model} takes: ``synchronous`` (DJL's scale call sends it; the change
#: is synchronous) and ``pinned`` (true: load the model and never evict it; false: unpin it).
_RESCALE_OTHER = ("synchronous", "pinned")

# DJL's model status (WorkerPoolConfig.Status) for a status of the WorkLoadManager.
_DJL_STATUS = {ModelStatus.LOADING: "PENDING"}

_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")


async def list_models(request: web.Request) -> web.Response:
    """``GET /models``: ``{"models": [...], "nextPageToken"?}``."""
    query = request.query
    limit = min(_int(query, "limit") if "limit" in query else MAX_PAGE, MAX_PAGE)
    if limit < 1:
        raise InvalidInput(f"parameter limit={limit} must be between 1 and {MAX_PAGE}")
    token = query.get("next_page_token") or None
    state = request.app[STATE]
    caller = viewer(state.tenants, request.headers.get(hdrs.AUTHORIZATION))
    if caller is None or caller is OPERATOR:
        models, more = await state.wlm.list_page(token, limit)
    else:  # a tenant's few models, paged the same way
        gate = state.tenants
        assert gate is not None
        mine = [
            m
            for m in await state.wlm.list_models()
            if gate.may_see(caller, m.name) and (token is None or m.name > token)
        ]
        models, more = mine[:limit], len(mine) > limit
    paths = shows_paths(caller)
    listed = []
    for m in models:
        url = m.url if paths else state.without_paths(m.url)
        row = {"modelName": m.name, "modelUrl": url, "status": _djl_status(m.status)}
        if m.skew:
            row["versionSkew"] = m.skew
        listed.append(row)
    body: dict[str, Any] = {"models": listed}
    if more and models:
        body["nextPageToken"] = models[-1].name
    return web.json_response(body)


async def describe_model(request: web.Request) -> web.Response:
    """``GET /models/{model}`` and ``GET /models/{model}/{version}``: DJL's
    ``DescribeWorkflowResponse[]``. A model without versions is one workflow without a
    ``version`` (DJL leaves a null one out); a model with versions is one workflow per version
    (or the one named), each with its ``version``, and the rollout: which version is the
    default (``isDefault``) and why (``defaultFrom``)."""
    state = request.app[STATE]
    wlm = state.wlm
    name = normalize_name(request.match_info["model"])
    caller = viewer(state.tenants, request.headers.get(hdrs.AUTHORIZATION))
    check_visible(state.tenants, caller, name)
    hide = None if shows_paths(caller) else state
    asked = request.match_info.get("version")
    if asked is not None:
        await wlm.versions.resolve(
            versioned(name, asked)
        )  # 404 for a version the model does not have
    rollout = await wlm.versions.rollout_of(name)
    if rollout is None:
        model = await wlm.catalog.describe(name)
        return web.json_response([{"workflowName": name, "models": [_describe(model, hide)]}])
    versions = rollout.versions if asked is None else (int(asked),)
    workflows = []
    for version in versions:
        described = _describe(await wlm.catalog.describe(rollout.key(version)), hide)
        described["modelName"] = name
        described["version"] = str(version)
        described["isDefault"] = version == rollout.default
        described["defaultFrom"] = rollout.default_from
        for role, share in rollout.shares.items():
            if share.version == version:
                described[f"{role}Percent"] = share.percent
                described[f"{role}From"] = share.source
        workflows.append({"workflowName": name, "version": str(version), "models": [described]})
    return web.json_response(workflows)


def _target(request: web.Request) -> str:
    """The model, or the model's version (``NAME/2``), the path names."""
    name = normalize_name(request.match_info["model"])
    return versioned(name, request.match_info.get("version"))


def _describe(model: ModelView, hide: ApiState | None = None) -> dict[str, Any]:
    """The fields of DJL's ``DescribeWorkflowResponse.Model``, and the server's own (memory,
    lane and cost, predict paths, the last load's error); with ``hide``, its URL and error
    without the server's folders (a tenant's view)."""
    config = model.config
    result: dict[str, Any] = {
        "modelName": model.name,
        "modelUrl": model.url if hide is None else hide.without_paths(model.url),
        "batchSize": config.batch_size,
        "maxBatchDelayMillis": config.max_batch_delay,
        "maxIdleSeconds": config.max_idle_time,
        "queueSize": config.job_queue_size,
        "requestInQueue": model.queued,
        "status": _describe_status(model),
        "loadedAtStartup": model.startup,
        "pinned": model.pinned,
        "workerGroups": [
            {
                "device": {"deviceType": "cpu", "deviceId": -1},
                "minWorkers": config.min_workers,
                "maxWorkers": config.max_workers,
                "workers": [
                    {
                        "id": w.id,
                        "startTime": _djl_date(w.start_time),
                        "status": w.status,
                        "backend": w.backend,
                        "lane": w.lane,
                    }
                    for w in model.workers
                ],
            }
        ],
    }
    cost = model.cost
    if model.memory_bytes is not None and cost is not None:
        result["memoryBytes"] = model.memory_bytes
        result.update(
            {
                "lane": model.lane,
                "holdPerBatchMillis": _ms(cost.hold),
                "costPerBatchMillis": _ms(cost.per_batch),
                "costPerRowMillis": _ms(cost.per_row),
                "costPerRequestMillis": _ms(cost.single if cost.single < math.inf else None),
                "rowsPerRequest": round(cost.rows_per_request, 1),
                "cpuSeconds": round(cost.cpu_seconds, 6),
                "batches": cost.batches,
                "batchesWaitedBehind": cost.waited,
            }
        )
        if model.paths is not None:
            apart = ("family", "summary", "explanation")
            paths = {k: v for k, v in model.paths.items() if k not in apart}
            paths["batches"] = model.path_batches or {}
            result["family"] = model.paths.get("family")
            result["predictPaths"] = paths
            if "explanation" in model.paths:  # the method its explanations get
                result["explanation"] = model.paths["explanation"]
    if model.inputs is not None:
        result["inputs"] = model.inputs
    if model.file_format is not None:
        result["format"] = model.file_format
    if model.input_example is not None:
        result["inputExample"] = model.input_example
    if model.trained_with:
        result["trainedWith"] = model.trained_with
        result["servedWith"] = model.served_with
    if model.environment is not None:
        result["environment"] = model.environment
    trust = config.trust
    result["trust"] = trust.level
    if trust.full:
        result["trustedBy"] = trust.because
    said = [*model.warnings, *mistyped_keys(model.config.properties)]
    if said:
        result["warnings"] = said
    if model.error is not None:
        result["error"] = model.error if hide is None else hide.without_paths(model.error)
    return result


def _djl_status(status: ModelStatus) -> str:
    return _DJL_STATUS.get(status, status.value)


def _djl_date(timestamp: float) -> str:
    """A time as DJL writes its dates (``yyyy-MM-dd'T'HH:mm:ss.SSS'Z'``), in UTC."""
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def _name_from_url(url: str) -> str:
    """DJL's name for a model registered from ``url`` without ``model_name``."""
    name = name_from_url(url)
    try:
        return normalize_name(name)
    except InvalidModelName:
        raise InvalidInput(
            f"the model name taken from url {url!r} is {name!r}, which is not a valid model "
            "name; give one in model_name"
        ) from None


def _describe_status(model: ModelView) -> str:
    """DJL's status of a described model: a loaded one is ``Healthy`` when it has at least its
    ``minWorkers`` workers, ``Unhealthy`` otherwise; a loading one ``PENDING``."""
    if model.status is ModelStatus.READY:
        healthy = len(model.workers) >= model.config.min_workers
        return "Healthy" if healthy else "Unhealthy"
    return _djl_status(model.status)


async def register_model(request: web.Request) -> web.Response:
    """``POST /models``: register (and by default load) a model; 200, or 202 if asynchronous."""
    authorize(request)
    params = await request_params(request)
    url = params.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidInput("parameter 'url' is required: the model's folder or archive")
    name = params.get("model_name")
    if name is not None and not isinstance(name, str):
        raise InvalidInput("parameter 'model_name' must be a string")
    name = normalize_name(name) if name else _name_from_url(url)
    overrides = _overrides(params, _REGISTER_PARAMS)
    synchronous = bool_param(params, "synchronous", default=True)
    # The operator trusts the model's files (any pickle global, a model.py): the call is a
    # management one, token-protected; nothing in the model's folder can ask for it.
    trusted = bool_param(params, "trusted", default=False)
    # A bad parameter is a 400 (the WorkLoadManager checks them); a bad serving.properties
    # fails the model's load, a 500, whichever call loads it.
    model = await request.app[STATE].wlm.register(
        url=url, name=name, overrides=overrides, synchronous=synchronous, trusted=trusted
    )
    if synchronous:
        return web.json_response({"status": f'Model "{model}" registered.'})
    return web.json_response({"status": f'Model "{model}" registration scheduled.'}, status=202)


async def rescale_model(request: web.Request) -> web.Response:
    """``PUT /models/{model}``: change workers and batching of a model live."""
    authorize(request)
    name = _target(request)
    params = await request_params(request)
    _refuse_unknown(params, (*_RESCALE_PARAMS, *_RESCALE_OTHER), f"PUT /models/{name}")
    if "synchronous" in params:
        bool_param(params, "synchronous", default=True)
    wlm = request.app[STATE].wlm
    overrides = _overrides(params, _RESCALE_PARAMS)
    answer: dict[str, Any] = {}
    if "pinned" in params:
        pinned = bool_param(params, "pinned", default=True)
        key = await wlm.pin(name, pinned)
        answer = {"status": f'Model "{key}" {"pinned" if pinned else "unpinned"}', "pinned": pinned}
        if not overrides:
            return web.json_response(answer)
    config = await wlm.rescale(name, overrides)
    answer["status"] = (
        f'Workflow "{name}" worker scaled. New Worker configuration '
        f"min workers:{config.min_workers} max workers:{config.max_workers}"
    )
    return web.json_response(answer)


async def unload_model(request: web.Request) -> web.Response:
    """``DELETE /models/{model}``: unload a model (a store model loads again when asked for)."""
    authorize(request)
    name = _target(request)
    if "/" in name:
        await request.app[STATE].wlm.versions.resolve(
            name
        )  # 404 for a version the model does not have
    await request.app[STATE].wlm.unload(name)
    return web.json_response({"status": f'Model or workflow "{name}" unregistered'})


async def set_default_version(request: web.Request) -> web.Response:
    """``PUT /models/{model}/{version}/set-default`` (TorchServe's call): the version is
    loaded (its workers started), then the requests that name no version go to it; the change
    survives a restart. A version that fails to load takes no request: the call fails with
    the load's error."""
    authorize(request)
    name = normalize_name(request.match_info["model"])
    key = versioned(name, request.match_info["version"])
    rollout = await request.app[STATE].wlm.set_default_version(name, int(key.split("/")[1]))
    return web.json_response(
        {"status": f'Default version of model "{name}" set to {rollout.default}.'}
    )


def share_handler(role: str) -> Handler:
    """The handler of ``PUT /models/{model}/{version}/set-<role>?percent=P`` (``canary`` or
    ``shadow``): the version is loaded, then ``P`` % of the requests that name no version take
    it in that role (``percent=0`` ends the role); the change survives a restart."""

    async def set_share(request: web.Request) -> web.Response:
        authorize(request)
        name = normalize_name(request.match_info["model"])
        key = versioned(name, request.match_info["version"])
        params = await request_params(request)
        if "percent" not in params:
            raise InvalidInput("parameter percent is required: the share (0 to 100) of requests")
        try:
            percent = percent_of(params["percent"], "parameter percent")
        except ConfigError as exc:
            raise InvalidInput(exc.message) from None
        version = int(key.split("/")[1])
        rollout = await request.app[STATE].wlm.set_share(name, version, role, percent)
        if rollout.shares.get(role) is None:
            return web.json_response({"status": f'The {role} of model "{name}" ended.'})
        return web.json_response(
            {"status": f'The {role} of model "{name}" is version {version} at {percent:g}%.'}
        )

    return answers_errors(set_share)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text, rendered in a thread so the event loop keeps serving."""
    state = request.app[STATE]
    check_metrics(state.config, state.tenants, request.headers.get(hdrs.AUTHORIZATION))
    # Reads loop-owned state: a few gauge sets, or a few per loaded model with the label "all".
    state.wlm.refresh_metrics()
    if state.asynchronous is not None:
        state.asynchronous.refresh_metrics()
    text = await asyncio.get_running_loop().run_in_executor(None, state.metrics.render)
    return web.Response(body=text, headers={"Content-Type": PROMETHEUS_TYPE})


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------


async def request_params(request: web.Request) -> dict[str, Any]:
    """The query parameters, updated with those of a JSON or form body."""
    params: dict[str, Any] = dict(request.query)
    config = request.app[STATE].config
    body = await read_body(request, config.max_request_size, config.body_timeout)
    if not body.strip():
        return params
    kind = media_type(request.headers.get("Content-Type"))
    if kind == "application/x-www-form-urlencoded":
        try:
            params.update(parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=True))
        except (UnicodeDecodeError, ValueError):
            raise InvalidInput("the form body is malformed") from None
        return params
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise InvalidInput("the body must be a JSON object of parameters") from None
    if not isinstance(data, dict):
        raise InvalidInput("the body must be a JSON object of parameters")
    params.update(data)
    return params


def _refuse_unknown(params: Mapping[str, Any], known: Sequence[str], call: str) -> None:
    """Raise :class:`InvalidInput` for a parameter ``call`` does not take, with the closest
    one it does (as a ``serving.properties`` key is refused)."""
    for key in params:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidInput(
                f"{call} does not take parameter {shown_value(key)}{hint} It takes "
                f"{', '.join(known)}"
            )


def _overrides(params: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    overrides = {key: _int(params, param) for param, key in names.items() if param in params}
    for key, value in overrides.items():
        if (why := short_of(value, LEAST.get(key, 0))) is not None:
            param = next(p for p, k in names.items() if k == key)
            raise InvalidInput(f"parameter {param}={value} {why}")
    low, high = overrides.get("min_workers"), overrides.get("max_workers")
    if low is not None and high is not None:
        order = out_of_order("min_worker", low, "max_worker", high)
        if order is not None:
            raise InvalidInput(order)
    return overrides


def _int(params: Mapping[str, Any], name: str) -> int:
    value = params[name]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value)
    raise InvalidInput(f"parameter {name} must be an integer, got {shown_value(value)}")


#: The handlers of the management routes, by operation (:data:`~mmserver.api.protocols.ROUTES`).
def fanned(handler: Handler) -> Handler:
    """``handler`` (a management operation of :data:`FANNED`), its call sent on to the peers
    once it succeeded here; a call from this instance itself answered :data:`peers.SELF`."""

    async def fan_out(request: web.Request) -> web.StreamResponse:
        sent_on: peers.Peers | None = request.app[STATE].peers
        origin = request.headers.get(peers.FORWARDED)
        if sent_on is not None and origin == sent_on.instance:
            return web.json_response(
                {"status": "this is the instance the call came from"}, status=peers.SELF
            )
        response = await handler(request)
        if sent_on is None or origin is not None or response.status >= 300:
            return response
        body = await request.read()
        outcomes = await sent_on.send(request.method, request.path_qs, body, dict(request.headers))
        failed = [o for o in outcomes if "error" in o]
        response.headers[peers.PEERS_HEADER] = f"{len(outcomes) - len(failed)}/{len(outcomes)}"
        for o in failed:
            log.warning(
                "peers: %s %s was not applied by %s: %s",
                request.method,
                request.path,
                o["peer"],
                o["error"],
            )
        if (
            failed
            and isinstance(response, web.Response)
            and response.content_type == "application/json"
        ):
            answer = json.loads(response.body) if isinstance(response.body, bytes) else {}
            if isinstance(answer, dict):
                answer["peers"] = failed
                response.body = json.dumps(answer).encode()
        return response

    return fan_out


async def peer_rollouts(request: web.Request) -> web.Response:
    """``GET /peers/rollouts``: the versions' rollouts set through the management API (the
    contents of ``rollouts.json``), for a new peer: a management call, since they name models;
    an instance asked by itself answers that it is (:data:`~mmserver.api.peers.SELF`)."""
    authorize(request)
    state = request.app[STATE]
    asking: peers.Peers | None = state.peers
    if asking is not None and request.headers.get(peers.FORWARDED) == asking.instance:
        return web.json_response({"status": "this is the instance that asks"}, status=peers.SELF)
    return web.json_response(state.wlm.versions.saved())


HANDLERS: dict[str, Handler] = {
    "peer_rollouts": answers_errors(peer_rollouts),
    "list_models": answers_errors(list_models),
    "register_model": answers_errors(register_model),
    "describe_model": answers_errors(describe_model),
    "rescale_model": answers_errors(rescale_model),
    "unload_model": answers_errors(unload_model),
    "set_default_version": answers_errors(set_default_version),
    "set_canary_version": share_handler("canary"),
    "set_shadow_version": share_handler("shadow"),
    "metrics": answers_errors(metrics),
}
