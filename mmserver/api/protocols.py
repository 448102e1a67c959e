"""The protocols mmserver speaks and the one table of its routes.

A :class:`Protocol` says how an inference request of that protocol becomes a job for the
WorkLoadManager (:data:`~mmserver.codecs.requests.Request`), how the answer its model's backend
encoded
becomes the body and headers sent back, and what shape its errors take. :data:`ROUTES` lists
every path the server answers, with its method, protocol and operation; the doors read it:

- aiohttp's application (:mod:`mmserver.app`) adds one route per entry, in this order;
- the lean path (:mod:`mmserver.api.lean.connection`) takes the routes marked ``lean``
  (:func:`match_lean`): the inference routes and ``InvokeEndpointAsync``;
- error answers take their shape from the route's protocol (:func:`protocol_of`), and the 404
  answer lists the paths (:func:`known_paths`);
- V2 over gRPC (:mod:`mmserver.api.grpc.service`) makes its jobs and reads its answers with
  :data:`V2`.

A request for an explanation is a job like any other: its kind says so
(:mod:`mmserver.codecs.explanations`), and the model's backend answers it.

A new protocol is a :class:`Protocol` and its rows here; a door that serves it calls
:class:`mmserver.api.dataplane.Exchange`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mmserver.codecs import explanations
from mmserver.codecs.answers import answer_body
from mmserver.codecs.explanations import ENABLE_EXPLANATIONS, explain_request
from mmserver.codecs.requests import Request, make_request
from mmserver.codecs.v2 import HEADER_LENGTH, v2_request
from mmserver.codecs.v2_answers import split_answer
from mmserver.errors import InvalidInput, ModelNotFound
from mmserver.store.names import VERSION_RE

JSON = "application/json"
BINARY = "application/octet-stream"
TARGET_MODEL = "X-Amzn-SageMaker-Target-Model"
#: The header whose value picks the version of a model's canary rollout a request goes to: the
#: same value, the same version (:mod:`mmserver.lifecycle.versions`).
ROUTING_KEY = "X-Mmserver-Routing-Key"

#: Makes the job of a request from its body and the headers that matter (``Content-Type``,
#: ``Accept`` and the protocol's own :attr:`Protocol.header`), checking only those.
MakeJob = Callable[[bytes, "str | None", "str | None", "str | None"], Request]
#: An answer's body, ``Content-Type`` and other headers (``None``: none) from the bytes the
#: model's backend encoded and the job they answer.
Render = Callable[[bytes, Request], "tuple[bytes | memoryview, str, dict[str, str] | None]"]


@dataclass(frozen=True, slots=True, eq=False)
class Protocol:
    name: str
    make_job: MakeJob
    render: Render
    #: Errors have the Open Inference Protocol's body, ``{"error": message}`` (otherwise DJL
    #: Serving's ``{"code", "type", "message"}``).
    v2_errors: bool = False
    #: Errors carry ``x-amzn-ErrorType``, which botocore reads to raise the matching exception.
    amzn_errors: bool = False
    #: The one other header its jobs read (``None``: none), and its name as the lean path's
    #: fields hold it (lower case, bytes; empty, a name no header has, for none).
    header: str | None = None
    lean_field: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        if self.header is not None:
            object.__setattr__(self, "lean_field", self.header.lower().encode())


def _plain_job(
    body: bytes, content_type: str | None, accept: str | None, header_length: str | None
) -> Request:
    return make_request(body, content_type, accept)


def _clarify_job(
    body: bytes, content_type: str | None, accept: str | None, expression: str | None
) -> Request:
    if expression is None:
        return make_request(body, content_type, accept)
    return explain_request(explanations.CLARIFY, body, content_type, accept, expression)


def _kserve_job(
    body: bytes, content_type: str | None, accept: str | None, header: str | None
) -> Request:
    return explain_request(explanations.KSERVE, body, content_type, accept, "`true`")


def _plain_answer(
    answer: bytes, job: Request
) -> tuple[bytes | memoryview, str, dict[str, str] | None]:
    body, content_type = answer_body(answer, job[2])
    return body, content_type, None


def _v2_job(
    body: bytes, content_type: str | None, accept: str | None, header_length: str | None
) -> Request:
    return v2_request(body, header_length)


def _v2_answer(
    answer: bytes, job: Request
) -> tuple[bytes | memoryview, str, dict[str, str] | None]:
    # A binary answer's body is a view past its header: not copied on its way out.
    body, header_length = split_answer(answer)
    if header_length is None:
        return body, JSON, None
    return body, BINARY, {HEADER_LENGTH: str(header_length)}


DJL = Protocol("djl", _plain_job, _plain_answer)
#: SageMaker's: with ``X-Amzn-SageMaker-Enable-Explanations``, answered as Clarify answers.
SAGEMAKER = Protocol(
    "sagemaker", _clarify_job, _plain_answer, amzn_errors=True, header=ENABLE_EXPLANATIONS
)
V2 = Protocol("v2", _v2_job, _v2_answer, v2_errors=True, header=HEADER_LENGTH)
#: KServe V1's explain verb (its errors are ``{"error": message}``, as V2's).
KSERVE = Protocol("kserve", _kserve_job, _plain_answer, v2_errors=True)

#: The operation of the inference routes (the data plane's); the others name their handler.
INFER = "infer"
#: The operation of ``InvokeEndpointAsync``, the one route besides inference the lean path takes.
INVOKE_ASYNC = "invoke_async"


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    method: str
    path: str
    protocol: Protocol
    operation: str
    #: The lean path takes it (the inference routes and :data:`INVOKE_ASYNC`).
    lean: bool = False
    segments: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(self.path.split("/")[1:]))

    def model_name(self, params: Mapping[str, str], target: str | None, query: str | None) -> str:
        """The model an inference request on this route names: the path's ``{model}`` (and
        ``{version}``: ``NAME/2``); on the SageMaker paths without one, the
        ``X-Amzn-SageMaker-Target-Model`` header (boto3's ``TargetModel``, ``NAME/2.tar.gz``
        for a version) or the ``model_name`` query parameter."""
        name = params.get("model") or target or query
        if not name:
            raise missing_target()
        return versioned(name, params.get("version"))


def versioned(name: str, version: str | None) -> str:
    """What a request for version ``version`` of model ``name`` asks for: ``NAME/2`` (``None``,
    no version: ``name``). The model's versions decide where it goes
    (:mod:`mmserver.lifecycle.versions`); a version that is not a number is none the model has
    (:class:`ModelNotFound`)."""
    if version is None:
        return name
    if not VERSION_RE.fullmatch(version):
        raise ModelNotFound(f"model {name} has no version {version[:40]!r}")
    return f"{name}/{version}"


def missing_target() -> InvalidInput:
    """The error of a ``/invocations`` request that names no model."""
    return InvalidInput(
        f"missing target model: set the {TARGET_MODEL} header (boto3: TargetModel=...) "
        "or the model_name query parameter"
    )


#: A model's version in DJL's management paths: a number (``/models/{model}/invoke`` is
#: SageMaker's inference path, and answers 405 to another method).
_DJL_VERSION = "/models/{model}/{version:[0-9]+}"
_V2_MODEL = "/v2/models/{model}"
_V2_VERSION = "/v2/models/{model}/versions/{version}"

#: Every route, in the order aiohttp tries them (inference first: routes sharing a path prefix
#: are tried in order).
ROUTES: tuple[Route, ...] = (
    # Inference: DJL, the SageMaker multi-model container, SageMaker Runtime, V2.
    Route("POST", "/predictions/{model}", DJL, INFER, lean=True),
    Route("POST", "/predictions/{model}/{version}", DJL, INFER, lean=True),
    Route("POST", "/invocations", SAGEMAKER, INFER, lean=True),
    Route("POST", "/endpoints/{endpoint}/invocations", SAGEMAKER, INFER, lean=True),
    Route("POST", "/models/{model}/invoke", SAGEMAKER, INFER, lean=True),
    Route("POST", _V2_MODEL + "/infer", V2, INFER, lean=True),
    Route("POST", _V2_VERSION + "/infer", V2, INFER),
    # Explanations (KServe V1's explain verb; the other protocols ask in their requests).
    Route("POST", "/v1/models/{model}:explain", KSERVE, INFER),
    # Asynchronous inference (SageMaker Runtime's InvokeEndpointAsync) and its requests' state.
    Route("POST", "/endpoints/{endpoint}/async-invocations", SAGEMAKER, INVOKE_ASYNC, lean=True),
    Route("GET", "/async-invocations/{inference_id}", SAGEMAKER, "async_status"),
    # Health.
    Route("GET", "/ping", DJL, "ping"),
    # Management (DJL Serving's API) and metrics.
    Route("GET", "/models", DJL, "list_models"),
    Route("POST", "/models", DJL, "register_model"),
    Route("GET", "/models/{model}", DJL, "describe_model"),
    Route("PUT", "/models/{model}", DJL, "rescale_model"),
    Route("DELETE", "/models/{model}", DJL, "unload_model"),
    Route("GET", _DJL_VERSION, DJL, "describe_model"),
    Route("PUT", _DJL_VERSION, DJL, "rescale_model"),
    Route("DELETE", _DJL_VERSION, DJL, "unload_model"),
    Route("PUT", _DJL_VERSION + "/set-default", DJL, "set_default_version"),
    Route("PUT", _DJL_VERSION + "/set-canary", DJL, "set_canary_version"),
    Route("PUT", _DJL_VERSION + "/set-shadow", DJL, "set_shadow_version"),
    Route("GET", "/metrics", DJL, "metrics"),
    # What a new instance takes from its peers (option peers: mmserver.api.peers).
    Route("GET", "/peers/rollouts", DJL, "peer_rollouts"),
    # The Open Inference Protocol's health, metadata and model repository.
    Route("GET", "/v2", V2, "server_metadata"),
    Route("GET", "/v2/health/live", V2, "live"),
    Route("GET", "/v2/health/ready", V2, "ready"),
    Route("GET", _V2_MODEL + "/ready", V2, "model_ready"),
    Route("GET", _V2_VERSION + "/ready", V2, "model_ready"),
    Route("GET", _V2_MODEL, V2, "model_metadata"),
    Route("GET", _V2_VERSION, V2, "model_metadata"),
    Route("POST", "/v2/repository/index", V2, "repository_index"),
    Route("POST", "/v2/repository/models/{model}/load", V2, "repository_load"),
    Route("POST", "/v2/repository/models/{model}/unload", V2, "repository_unload"),
    # Pages for people: the API in OpenAPI 3.1 (mmserver.api.openapi), its browsable page, a
    # model's page where it can be called, and the status page (mmserver.api.pages).
    Route("GET", "/openapi.json", DJL, "openapi"),
    Route("OPTIONS", "/", DJL, "openapi"),
    Route("GET", "/docs", DJL, "docs"),
    Route("GET", "/docs/{asset}", DJL, "docs_asset"),
    Route("GET", _V2_MODEL + "/docs", V2, "model_docs"),
    Route("GET", _V2_MODEL + "/openapi.json", V2, "model_openapi"),
    Route("GET", "/status", DJL, "status"),
    Route("GET", "/status.json", DJL, "status_data"),
)

_BY_PATH: dict[str, Route] = {}
for _route in ROUTES:
    _BY_PATH.setdefault(_route.path, _route)

#: The lean routes by their number of path segments.
_LEAN: dict[int, tuple[Route, ...]] = {}
for _route in ROUTES:
    if _route.lean:
        _LEAN[len(_route.segments)] = (*_LEAN.get(len(_route.segments), ()), _route)


def match_lean(path: str) -> tuple[Route, dict[str, str]] | None:
    """The lean route ``path`` (already checked to hold no query, percent-encoding or dot
    segment) matches, with the values of its placeholders; ``None`` for any other path."""
    parts = path.split("/")
    del parts[0]
    for route in _LEAN.get(len(parts), ()):
        params: dict[str, str] = {}
        for pattern, part in zip(route.segments, parts, strict=True):
            if pattern[:1] == "{":
                if not part:
                    break
                params[pattern[1:-1]] = part
            elif pattern != part:
                break
        else:
            return route, params
    return None


def protocol_of(canonical: str | None, path: str) -> Protocol:
    """The protocol of a request routed to the route whose path is ``canonical`` (``None``: to
    none); a path no route serves is the Open Inference Protocol's under ``/v2``."""
    route = _BY_PATH.get(canonical) if canonical is not None else None
    if route is not None:
        return route.protocol
    return V2 if path == "/v2" or path.startswith("/v2/") else DJL


def known_paths() -> str:
    """The paths outside ``/v2`` the server answers, for the 404 answer."""
    paths = dict.fromkeys(plain_path(r.path) for r in ROUTES if r.protocol is not V2)
    return ", ".join(paths)


def plain_path(path: str) -> str:
    """A route's path without its placeholders' patterns (``{version:[0-9]+}``: ``{version}``)."""
    return _PATTERN.sub(r"{\1}", path)


#: A placeholder's pattern in a route's path (``{version:[0-9]+}``), left out where the paths
#: are shown.
_PATTERN = re.compile(r"\{(\w+):[^}]*\}")
