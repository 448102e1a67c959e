"""The Open Inference Protocol over gRPC: the third door, on its own port (``grpc_port``).

:class:`GrpcServer` serves Triton's ``inference.GRPCInferenceService`` with ``grpc.aio`` on the
server's own event loop: health (``ServerLive``, ``ServerReady``, ``ModelReady``), metadata
(``ServerMetadata``, ``ModelMetadata``), inference (``ModelInfer``) and the model repository
extension (``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``). The other
RPCs of Triton's service (streaming, statistics, shared memory, trace) answer UNIMPLEMENTED.

One ``ModelInfer`` call goes through the data plane as a V2 REST request does
(:class:`~mmserver.api.dataplane.Exchange` with :data:`~mmserver.api.protocols.V2`): the message
(bounded by ``max_request_size``) becomes the body of the binary tensor extension — a JSON
header naming the inputs with their ``binary_data_size``, then their bytes
(``raw_input_contents`` as they came, typed ``contents`` packed as raw data), every output asked
for as binary data (:mod:`mmserver.api.grpc.tensors`) — and is submitted to the model's queue;
the answer's binary outputs become ``raw_output_contents``. So the same queues, batching, lanes
and metrics serve it, the body is decoded in the model's backend, and an answer holds the same
values as REST's.

Errors are the data plane's (:class:`~mmserver.errors.MMServerError`) with REST's message, the
request id at its end (the ``x-request-id`` metadata of the call when it has one), and the gRPC
status of their HTTP status (:data:`STATUS_CODES`); the ``x-request-id`` trailing metadata
carries the id too. ``RepositoryModelLoad`` and ``RepositoryModelUnload`` follow the management
access rule of the HTTP repository calls (:func:`~mmserver.api.middleware.check_authorization`),
a bearer token in the ``authorization`` metadata. A ``traceparent`` metadata continues the caller's
trace on a server with traces (:mod:`mmserver.ops.otel`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from mmserver.api.access import check_authorization, check_visible, viewer
from mmserver.api.dataplane import Exchange, shown_error, shown_message
from mmserver.api.grpc.proto import grpc_service_pb2 as pb
from mmserver.api.grpc.tensors import infer_body, infer_response, json_parameters
from mmserver.api.protocols import V2, versioned
from mmserver.api.repository import (
    SERVER_METADATA,
    index_of,
    load,
    metadata_of,
    not_ready_reason,
    unload,
)
from mmserver.api.state import ApiState, too_large
from mmserver.codecs.v2 import HEADER_LENGTH
from mmserver.errors import InvalidInput, MMServerError
from mmserver.ops.traces import TRACEPARENT, TRACESTATE, Door
from mmserver.tenancy.gate import THROTTLE_HOLD_S, Throttled

#: The service's name on the wire (Triton's and KServe's package ``inference``).
SERVICE = "inference.GRPCInferenceService"
#: The metadata naming a call, as ``X-Request-Id`` names an HTTP request.
REQUEST_ID = "x-request-id"
AUTHORIZATION = "authorization"

_Code = Any  # grpc.StatusCode (grpcio has no type information)

#: The gRPC status of an error of each HTTP status (others: INVALID_ARGUMENT below 500,
#: INTERNAL from 500); as gRPC's own HTTP mapping and Triton's, read backwards.
STATUS_CODES: dict[int, _Code] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    424: grpc.StatusCode.INTERNAL,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(http_status: int) -> _Code:
    """The gRPC status of an error answered ``http_status`` over HTTP."""
    code = STATUS_CODES.get(http_status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


def _grpc_status(http_status: int) -> int:
    """The number of the gRPC status of a call answered ``http_status`` over HTTP (0: OK)."""
    return 0 if http_status == 200 else int(status_code(http_status).value[0])


#: How ``ModelInfer`` calls are shown in traces (OpenTelemetry's RPC conventions).
INFER_DOOR = Door(
    f"{SERVICE}/ModelInfer",
    {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "ModelInfer"},
    status_key="rpc.grpc.status_code",
    status=_grpc_status,
)

M = TypeVar("M", bound=Message)
Context = Any  # grpc.aio.ServicerContext
Handler = Callable[[bytes, Context], Awaitable[Message]]


def _rpc(
    kind: type[M],
) -> Callable[[Callable[[GrpcServer, M, Context], Awaitable[Message]]], Any]:
    """An RPC other than ``ModelInfer`` taking a ``kind`` message: what it raises is answered as
    the module docstring says (not counted, as REST's health, metadata and repository calls
    are not)."""

    def decorate(method: Callable[[GrpcServer, M, Context], Awaitable[Message]]) -> Any:
        @functools.wraps(method)
        async def answering(self: GrpcServer, message: bytes, context: Context) -> Message:
            try:
                return await method(self, parse(kind, message), context)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                rid = self.request_id(context)
                path = f"/{SERVICE}/{kind.__name__.removesuffix('Request')}"
                await self.abort(context, shown_error(exc, "gRPC", path, rid), rid)
                raise AssertionError("abort returns only by raising") from None

        return answering

    return decorate


class GrpcServer:
    """The gRPC server of one mmserver: started after the HTTP site, stopped after the drain
    (:class:`mmserver.server.Server`); its handlers are coroutines on the server's loop. Every
    handler takes the message as it came and parses it itself, so that a malformed one is
    answered as any other bad request."""

    def __init__(self, state: ApiState, port: int) -> None:
        self.state = state
        #: The port to bind (0: one the system picks), then the port bound.
        self.port = port
        self._server: Any = None  # grpc.aio.Server

    async def start(self) -> None:
        """Listen on ``host:port``. Raises :class:`OSError` when the port cannot be bound."""
        config = self.state.config
        limit = config.max_request_size
        server = aio.server(
            options=[
                # A port another process holds is an error, not a second listener beside it.
                ("grpc.so_reuseport", 0),
                # gRPC refuses a message past twice the limit before it is read whole; one
                # between is read and refused as REST refuses a body (model_infer).
                ("grpc.max_receive_message_length", 2 * limit if limit else -1),
                ("grpc.max_send_message_length", -1),
            ]
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        host = config.host
        address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot serve gRPC on {address} (grpc_port): {exc}") from None
        await server.start()
        self._server = server

    async def stop(self, grace: float) -> None:
        """Stop listening; calls still running get ``grace`` seconds, then are cancelled."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    def _handlers(self) -> Any:
        rpcs: dict[str, Handler] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.unary_unary_rpc_method_handler(rpc, response_serializer=_serialize)
                for name, rpc in rpcs.items()
            },
        )

    # The data plane ----------------------------------------------------------------------------

    async def model_infer(self, message: bytes, context: Context) -> pb.ModelInferResponse:
        """One inference call, through the data plane as the module docstring says."""
        state = self.state
        exchange = Exchange(state, V2, self.request_id(context))
        if state.tracing is not None:
            exchange.sample(
                state.tracing,
                INFER_DOOR,
                _metadata(context, TRACEPARENT),
                _metadata(context, TRACESTATE),
            )
        try:
            limit = state.config.max_request_size
            if limit and len(message) > limit:
                raise too_large(len(message), limit)
            request = parse(pb.ModelInferRequest, message)
            name = versioned(request.model_name, request.model_version or None)
            body, header_length = infer_body(request)
            if state.tenants is not None:
                exchange.authenticate("POST", "", functools.partial(_metadata, context), b"")
            answer = await exchange.submit(
                name, body, None, None, str(header_length), context.cancelled
            )
            answered, _, headers = exchange.answered(answer)
        except asyncio.CancelledError:
            raise  # the server is stopping or the client left: no answer, nothing to count
        except Exception as exc:
            shown = exchange.failed(exc, "gRPC", f"/{SERVICE}/ModelInfer")
            if isinstance(exc, Throttled):
                await asyncio.sleep(THROTTLE_HOLD_S)  # see mmserver.tenancy.gate
            await self.abort(context, shown, exchange.rid)
            raise AssertionError("abort returns only by raising") from None
        length = int(headers[HEADER_LENGTH]) if headers is not None else len(answered)
        return infer_response(answered, length)

    # Health, metadata and the model repository -------------------------------------------------

    @_rpc(pb.ServerLiveRequest)
    async def server_live(
        self, request: pb.ServerLiveRequest, context: Context
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @_rpc(pb.ServerReadyRequest)
    async def server_ready(
        self, request: pb.ServerReadyRequest, context: Context
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.wlm.healthy())

    @_rpc(pb.ModelReadyRequest)
    async def model_ready(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        name = versioned(request.name, request.version or None)
        self.check_visible(context, name)
        reason = await not_ready_reason(self.state.wlm, name)
        return pb.ModelReadyResponse(ready=reason is None)

    @_rpc(pb.ServerMetadataRequest)
    async def server_metadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**SERVER_METADATA)

    @_rpc(pb.ModelMetadataRequest)
    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        name = versioned(request.name, request.version or None)
        self.check_visible(context, name)
        metadata = await metadata_of(self.state.wlm, name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensor(**t) for t in metadata["inputs"]],
            outputs=[tensor(**t) for t in metadata["outputs"]],
        )

    @_rpc(pb.RepositoryIndexRequest)
    async def repository_index(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        gate = self.state.tenants
        caller = viewer(gate, _metadata(context, AUTHORIZATION))
        index = await index_of(self.state.wlm, request.ready, gate, caller)
        model = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[model(**m) for m in index])

    @_rpc(pb.RepositoryModelLoadRequest)
    async def repository_load(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        self.authorize(context)
        parameters = json_parameters(request.parameters)
        await load(self.state.wlm, request.model_name, parameters)
        return pb.RepositoryModelLoadResponse()

    @_rpc(pb.RepositoryModelUnloadRequest)
    async def repository_unload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        self.authorize(context)
        parameters = json_parameters(request.parameters)
        await unload(self.state.wlm, request.model_name, parameters)
        return pb.RepositoryModelUnloadResponse()

    # Helpers ------------------------------------------------------------------------------------

    def request_id(self, context: Context) -> str:
        """The call's ``x-request-id`` metadata, otherwise a new id."""
        value = _metadata(context, REQUEST_ID)
        return value or self.state.request_ids.next()

    async def abort(self, context: Context, error: MMServerError, rid: str) -> None:
        """End the call with ``error``'s status and REST's message (raises ``AbortError``)."""
        await context.abort(
            status_code(error.status_code),
            shown_message(self.state, error, rid),
            trailing_metadata=((REQUEST_ID, rid),),
        )

    def check_visible(self, context: Context, name: str) -> None:
        """Raise unless the call's caller may see model ``name`` (a server with tenants)."""
        gate = self.state.tenants
        check_visible(gate, viewer(gate, _metadata(context, AUTHORIZATION)), name)

    def authorize(self, context: Context) -> None:
        """The management access rule of the HTTP repository calls, for this call."""
        check_authorization(self.state.config, _metadata(context, AUTHORIZATION))


def _metadata(context: Context, key: str) -> str | None:
    """The value of the call's metadata ``key`` (a text one), ``None`` when it has none."""
    for item in context.invocation_metadata() or ():
        if item[0] == key and isinstance(item[1], str):
            return str(item[1])
    return None


def parse(kind: type[M], message: bytes) -> M:
    """The message of type ``kind`` in ``message``; :class:`InvalidInput` when it is not one."""
    try:
        return kind.FromString(message)
    except DecodeError as exc:
        raise InvalidInput(f"the message is not a valid {kind.__name__}: {exc}") from None


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()
