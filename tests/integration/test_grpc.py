"""The Open Inference Protocol over gRPC (the app in process, grpc.aio's client): every RPC, the
tensor forms, errors as status codes with REST's messages, the management rule, the size limit,
the metrics, and answers equal to V2 REST's for the same input."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message
from grpc import aio

from mmserver.api.grpc.proto import grpc_service_pb2 as pb
from mmserver.api.grpc.service import SERVICE, GrpcServer
from mmserver.api.web import STATE
from tests.integration.harness import Harness, Serve
from tests.models import make_linear_model
from tests.tabular_models import ROWS_OF_CUSTOMERS, make_pipeline_model

IRIS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])

#: Each RPC's response type.
RESPONSES: dict[str, type[Message]] = {
    "ServerLive": pb.ServerLiveResponse,
    "ServerReady": pb.ServerReadyResponse,
    "ModelReady": pb.ModelReadyResponse,
    "ServerMetadata": pb.ServerMetadataResponse,
    "ModelMetadata": pb.ModelMetadataResponse,
    "ModelInfer": pb.ModelInferResponse,
    "RepositoryIndex": pb.RepositoryIndexResponse,
    "RepositoryModelLoad": pb.RepositoryModelLoadResponse,
    "RepositoryModelUnload": pb.RepositoryModelUnloadResponse,
}


@dataclass
class GrpcHarness:
    """One server with its gRPC door, and a channel to it."""

    http: Harness
    channel: aio.Channel

    async def call(self, rpc: str, request: Message, **metadata: str) -> Any:
        method = self.channel.unary_unary(
            f"/{SERVICE}/{rpc}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[rpc].FromString,
        )
        return await method(request, metadata=tuple(metadata.items()) or None, timeout=30)

    async def error(
        self, rpc: str, request: Message, code: grpc.StatusCode, **metadata: str
    ) -> str:
        """The message of the error ``rpc`` answers, checked for its code and request id."""
        with pytest.raises(aio.AioRpcError) as info:
            await self.call(rpc, request, **metadata)
        error = info.value
        assert error.code() == code, error.details()
        rid = dict(error.trailing_metadata() or ())["x-request-id"]
        details: str = error.details()
        assert details.endswith(f" (request id {rid})")
        return details.removesuffix(f" (request id {rid})")


GrpcServe = Callable[..., Awaitable[GrpcHarness]]


@pytest.fixture
async def grpc_serve(serve: Serve) -> AsyncIterator[GrpcServe]:
    started: list[tuple[GrpcServer, aio.Channel]] = []

    async def start(**options: Any) -> GrpcHarness:
        http = await serve(**options)
        door = GrpcServer(http.client.app[STATE], 0)
        await door.start()
        channel = aio.insecure_channel(f"127.0.0.1:{door.port}")
        started.append((door, channel))
        return GrpcHarness(http, channel)

    yield start
    for door, channel in reversed(started):
        await channel.close()
        await door.stop(0)


@pytest.fixture
async def node(grpc_serve: GrpcServe) -> GrpcHarness:
    return await grpc_serve()


def infer(
    model: str,
    *tensors: tuple[str, str, list[int], bytes],
    outputs: tuple[str, ...] = (),
    **fields: Any,
) -> pb.ModelInferRequest:
    """A ModelInferRequest with raw inputs ``(name, datatype, shape, data)``."""
    request = pb.ModelInferRequest(model_name=model, **fields)
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    for output in outputs:
        request.outputs.add(name=output)
    return request


def fp64(values: np.ndarray, name: str = "input-0") -> tuple[str, str, list[int], bytes]:
    return name, "FP64", list(values.shape), values.astype("<f8").tobytes()


def strings(items: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(s.encode())) + s.encode() for s in items)


def outputs_of(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """The answer's outputs as arrays (BYTES as lists of bytes)."""
    result: dict[str, Any] = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if output.datatype == "BYTES":
            items = items_of(raw)
            result[output.name] = np.array(items, dtype=object).reshape(list(output.shape))
        else:
            dtype = {"FP64": "<f8", "FP32": "<f4", "INT64": "<i8", "BOOL": "?"}[output.datatype]
            result[output.name] = np.frombuffer(raw, dtype=dtype).reshape(list(output.shape))
    return result


# ------------------------------------------------------------------------------------------------
# Health and metadata
# ------------------------------------------------------------------------------------------------


async def test_health_and_server_metadata(node: GrpcHarness) -> None:
    assert (await node.call("ServerLive", pb.ServerLiveRequest())).live
    assert (await node.call("ServerReady", pb.ServerReadyRequest())).ready
    metadata = await node.call("ServerMetadata", pb.ServerMetadataRequest())
    rest = await (await node.http.client.get("/v2")).json()
    assert (metadata.name, metadata.version, list(metadata.extensions)) == (
        rest["name"],
        rest["version"],
        rest["extensions"],
    )
    node.http.wlm.begin_shutdown()
    assert (await node.call("ServerLive", pb.ServerLiveRequest())).live
    assert not (await node.call("ServerReady", pb.ServerReadyRequest())).ready
    message = await node.error(
        "ModelInfer", infer("sklearn-0", fp64(np.array([[0.5]]))), grpc.StatusCode.UNAVAILABLE
    )
    assert "shutting down" in message


async def test_model_ready_and_metadata_equal_rest_s(node: GrpcHarness) -> None:
    ready = pb.ModelReadyRequest
    assert not (await node.call("ModelReady", ready(name="iris-classifier"))).ready
    metadata = await node.call("ModelMetadata", pb.ModelMetadataRequest(name="iris-classifier"))
    assert (await node.call("ModelReady", ready(name="iris-classifier", version="1"))).ready
    rest = await (await node.http.client.get("/v2/models/iris-classifier")).json()
    assert metadata.name == rest["name"] and list(metadata.versions) == rest["versions"]
    assert metadata.platform == rest["platform"]
    for tensors, expected in (
        (metadata.inputs, rest["inputs"]),
        (metadata.outputs, rest["outputs"]),
    ):
        assert [
            {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors
        ] == expected
    message = await node.error(
        "ModelReady", ready(name="iris-classifier", version="2"), grpc.StatusCode.NOT_FOUND
    )
    assert message == "model iris-classifier has one version, 1; there is no version '2'"
    message = await node.error("ModelReady", ready(name="no-such-model"), grpc.StatusCode.NOT_FOUND)
    assert "not in the store nor registered" in message
    await node.error("ModelReady", ready(name=".hidden"), grpc.StatusCode.INVALID_ARGUMENT)
    await node.error(
        "ModelMetadata", pb.ModelMetadataRequest(name="no-such-model"), grpc.StatusCode.NOT_FOUND
    )


# ------------------------------------------------------------------------------------------------
# Inference
# ------------------------------------------------------------------------------------------------


async def rest_answer(node: GrpcHarness, model: str, request: pb.ModelInferRequest) -> Any:
    """V2 REST's JSON answer to the same input, every output as JSON data."""
    inputs = []
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        if tensor.datatype == "BYTES":
            data: list[Any] = [item.decode() for item in items_of(raw)]
        else:
            dtype = {"FP64": "<f8", "FP32": "<f4", "INT32": "<i4", "INT64": "<i8"}
            data = np.frombuffer(raw, dtype=dtype[tensor.datatype]).tolist()
        inputs.append(
            {
                "name": tensor.name,
                "datatype": tensor.datatype,
                "shape": list(tensor.shape),
                "data": data,
            }
        )
    body: dict[str, Any] = {"inputs": inputs}
    if request.id:
        body["id"] = request.id
    if request.outputs:
        body["outputs"] = [{"name": o.name} for o in request.outputs]
    response = await node.http.client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


def items_of(raw: bytes) -> list[bytes]:
    """The items of BYTES data: each a 4-byte little-endian length and its bytes."""
    items, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        items.append(raw[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return items


def assert_same(response: pb.ModelInferResponse, rest: dict[str, Any]) -> None:
    """The gRPC answer holds REST's outputs: names, datatypes, shapes and values."""
    assert response.model_name == rest["model_name"]
    assert response.model_version == rest["model_version"]
    assert response.id == rest.get("id", "")
    arrays = outputs_of(response)
    assert [o.name for o in response.outputs] == [o["name"] for o in rest["outputs"]]
    for output, expected in zip(response.outputs, rest["outputs"], strict=True):
        assert output.datatype == expected["datatype"]
        assert list(output.shape) == expected["shape"]
        values = arrays[output.name].ravel().tolist()
        if output.datatype == "BYTES":
            values = [v.decode() for v in values]
        assert values == expected["data"]


async def test_fp64_fp32_and_int_inputs_answer_as_rest_does(node: GrpcHarness) -> None:
    cases = [
        infer("iris-classifier", fp64(IRIS), id="r-1"),
        infer(
            "iris-classifier",
            ("x", "FP32", [2, 4], IRIS.astype("<f4").tobytes()),
            outputs=("predict_proba", "predict"),
        ),
        infer("sklearn-1", ("x", "INT32", [3], np.array([1, 2, 3], "<i4").tobytes())),
        infer(
            "sklearn-1",
            ("x", "INT64", [2, 1], np.array([[4], [5]], "<i8").tobytes()),
            model_version="1",
        ),
    ]
    for request in cases:
        response = await node.call("ModelInfer", request)
        assert_same(response, await rest_answer(node, request.model_name, request))
    response = await node.call(
        "ModelInfer", infer("iris-classifier", fp64(IRIS), id="r-1", outputs=("predict",))
    )
    assert response.id == "r-1"
    assert outputs_of(response)["predict"].tolist() == [0, 2]


async def test_typed_contents_are_read_as_raw_ones(node: GrpcHarness) -> None:
    request = pb.ModelInferRequest(model_name="iris-classifier")
    tensor = request.inputs.add(name="x", datatype="FP64", shape=[2, 4])
    tensor.contents.fp64_contents.extend(IRIS.ravel().tolist())
    typed = await node.call("ModelInfer", request)
    raw = await node.call("ModelInfer", infer("iris-classifier", fp64(IRIS)))
    assert typed == raw
    request = pb.ModelInferRequest(model_name="sklearn-1")
    tensor = request.inputs.add(name="x", datatype="INT32", shape=[2])
    tensor.contents.int_contents.extend([1, 2])
    answer = outputs_of(await node.call("ModelInfer", request))["predict"]
    assert answer.tolist() == pytest.approx([3.0, 5.0], abs=0.1)


async def test_a_dataframe_model_takes_bytes_columns(grpc_serve: GrpcServe, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    expected = make_pipeline_model(store / "pipeline")
    make_linear_model(store / "linear")
    node = await grpc_serve(model_store=str(store))
    frame = ROWS_OF_CUSTOMERS
    request = infer(
        "pipeline",
        ("city", "BYTES", [3], strings(list(frame["city"]))),
        fp64(frame["age"].to_numpy(), "age"),
        fp64(frame["income"].to_numpy(), "income"),
    )
    response = await node.call("ModelInfer", request)
    assert outputs_of(response)["predict"].tolist() == expected.predict(frame).tolist()
    # As REST: JSON null for the missing age.
    rest = await rest_answer(node, "pipeline", request)
    assert_same(response, rest)
    # Typed BYTES contents too.
    typed = pb.ModelInferRequest(model_name="pipeline")
    city = typed.inputs.add(name="city", datatype="BYTES", shape=[3])
    city.contents.bytes_contents.extend(c.encode() for c in frame["city"])
    for name in ("age", "income"):
        column = typed.inputs.add(name=name, datatype="FP64", shape=[3])
        column.contents.fp64_contents.extend(frame[name].tolist())
    assert await node.call("ModelInfer", typed) == response
    message = await node.error(
        "ModelInfer",
        infer(
            "pipeline",
            ("city", "BYTES", [1], strings(["paris"])),
            fp64(np.array([1.0]), "agee"),
            fp64(np.array([1.0]), "income"),
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "agee" in message


async def test_a_classifier_with_string_classes_answers_bytes(
    grpc_serve: GrpcServe, tmp_path: Path
) -> None:
    from tests.e2e.test_tritonclient import make_named_classifier_dir

    store = tmp_path / "store"
    make_named_classifier_dir(store / "iris-names")
    node = await grpc_serve(model_store=str(store))
    request = infer("iris-names", fp64(IRIS))
    response = await node.call("ModelInfer", request)
    assert response.outputs[0].datatype == "BYTES"
    assert outputs_of(response)["predict"].tolist() == [b"setosa", b"virginica"]
    assert_same(response, await rest_answer(node, "iris-names", request))


async def rest_error(node: GrpcHarness, model: str, body: dict[str, Any]) -> str:
    response = await node.http.client.post(f"/v2/models/{model}/infer", json=body)
    message: str = (await response.json())["error"]
    return message.removesuffix(f" (request id {response.headers['X-Request-Id']})")


async def test_errors_have_status_codes_and_rest_s_messages(node: GrpcHarness) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    # Wrong number of features: the same message as REST's.
    message = await node.error("ModelInfer", infer("iris-classifier", fp64(np.ones((1, 2)))), bad)
    rest = await rest_error(
        node,
        "iris-classifier",
        {"inputs": [{"name": "input-0", "datatype": "FP64", "shape": [1, 2], "data": [1, 1]}]},
    )
    assert message == rest
    assert "expects 4 feature(s) per row, got 2" in message
    # A shape that does not match the data.
    message = await node.error(
        "ModelInfer",
        infer("iris-classifier", ("x", "FP64", [3, 4], IRIS.astype("<f8").tobytes())),
        bad,
    )
    assert "shape [3, 4]" in message
    # An output the model does not have.
    message = await node.error(
        "ModelInfer", infer("iris-classifier", fp64(IRIS), outputs=("label",)), bad
    )
    assert "the model has no output 'label'; its outputs are predict_proba" in message
    # Unknown model, unknown version, bad name.
    notfound = grpc.StatusCode.NOT_FOUND
    message = await node.error(
        "ModelInfer", infer("no-such-model", fp64(np.ones((1, 1)))), notfound
    )
    assert message == await rest_error(
        node,
        "no-such-model",
        {"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}]},
    )
    message = await node.error(
        "ModelInfer", infer("sklearn-1", fp64(np.ones((1, 1))), model_version="2"), notfound
    )
    assert message == "model sklearn-1 has one version, 1; there is no version '2'"
    await node.error("ModelInfer", infer("../etc", fp64(np.ones((1, 1)))), bad)
    # What has no REST form: raw contents that do not match the inputs.
    request = infer("sklearn-1", fp64(np.ones((1, 1))))
    request.raw_input_contents.append(b"more")
    message = await node.error("ModelInfer", request, bad)
    assert message.startswith("raw_input_contents has 2 entries for 1 inputs")
    typed = pb.ModelInferRequest(model_name="sklearn-1")
    typed.inputs.add(name="x", datatype="FP64", shape=[1]).contents.int_contents.append(1)
    message = await node.error("ModelInfer", typed, bad)
    assert "its contents are in int_contents; a FP64 input's are in fp64_contents" in message
    # A model whose own code raises, one that fails to load.
    await node.error(
        "ModelInfer", infer("raising-handler", fp64(np.ones((1, 1)))), grpc.StatusCode.INTERNAL
    )
    message = await node.error(
        "ModelInfer", infer("broken-model", fp64(np.ones((1, 1)))), grpc.StatusCode.INTERNAL
    )
    assert "model broken-model failed to load" in message


async def test_the_size_limit_applies_to_messages(grpc_serve: GrpcServe) -> None:
    node = await grpc_serve(max_request_size=1000)
    small = infer("sklearn-1", fp64(np.ones((10, 1))))
    assert (await node.call("ModelInfer", small)).outputs[0].name == "predict"
    large = infer("sklearn-1", fp64(np.ones((200, 1))))
    size = large.ByteSize()
    message = await node.error("ModelInfer", large, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert message == (
        f"the request body is {size} bytes; the limit is 1000 bytes (max_request_size). "
        "Send fewer rows per request."
    )
    # Past twice the limit gRPC itself refuses it, unread.
    with pytest.raises(aio.AioRpcError) as info:
        await node.call("ModelInfer", infer("sklearn-1", fp64(np.ones((1000, 1)))))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_calls_are_counted_as_rest_s(node: GrpcHarness) -> None:
    await node.call("ModelInfer", infer("sklearn-2", fp64(np.ones((1, 1)))))
    await node.error(
        "ModelInfer", infer("sklearn-2", fp64(np.ones((1, 3)))), grpc.StatusCode.INVALID_ARGUMENT
    )
    await node.error(
        "ModelInfer", infer("no-such", fp64(np.ones((1, 1)))), grpc.StatusCode.NOT_FOUND
    )
    samples = await node.http.samples()
    requests = "mmserver_requests_total"
    assert samples[(requests, (("code", "200"), ("model", "sklearn-2")))] == 1
    assert samples[(requests, (("code", "400"), ("model", "sklearn-2")))] == 1
    assert samples[(requests, (("code", "404"), ("model", "-")))] == 1


async def test_a_malformed_message_is_invalid_argument(node: GrpcHarness) -> None:
    method = node.channel.unary_unary(f"/{SERVICE}/ModelInfer")
    with pytest.raises(aio.AioRpcError) as info:
        await method(b"\xff\xff\xff", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest" in info.value.details()
    method = node.channel.unary_unary(f"/{SERVICE}/ModelStreamInfer")
    with pytest.raises(aio.AioRpcError) as info:
        await method(b"", timeout=30)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


# ------------------------------------------------------------------------------------------------
# Model repository
# ------------------------------------------------------------------------------------------------


async def test_repository_index_load_and_unload(node: GrpcHarness) -> None:
    load = pb.RepositoryModelLoadRequest
    unload = pb.RepositoryModelUnloadRequest
    await node.call("RepositoryModelLoad", load(model_name="sklearn-7"))
    assert (await node.call("ModelReady", pb.ModelReadyRequest(name="sklearn-7"))).ready
    index = await node.call("RepositoryIndex", pb.RepositoryIndexRequest())
    rest = await (await node.http.client.post("/v2/repository/index")).json()
    assert [
        {"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
        for m in index.models
    ] == rest
    ready = await node.call("RepositoryIndex", pb.RepositoryIndexRequest(ready=True))
    assert [(m.name, m.state) for m in ready.models] == [("sklearn-7", "READY")]
    await node.call("RepositoryModelUnload", unload(model_name="sklearn-7"))
    assert not (await node.call("ModelReady", pb.ModelReadyRequest(name="sklearn-7"))).ready
    message = await node.error(
        "RepositoryModelLoad", load(model_name="no-such-model"), grpc.StatusCode.NOT_FOUND
    )
    assert "model no-such-model is not in the model store" in message
    request = load(model_name="sklearn-7")
    request.parameters["config"].string_param = "{}"
    message = await node.error("RepositoryModelLoad", request, grpc.StatusCode.INVALID_ARGUMENT)
    assert message.startswith("load parameter 'config' is not supported")
    request = unload(model_name="sklearn-7")
    request.parameters["unload_dependents"].string_param = "perhaps"
    await node.error("RepositoryModelUnload", request, grpc.StatusCode.INVALID_ARGUMENT)


async def test_repository_calls_follow_the_management_rule(grpc_serve: GrpcServe) -> None:
    node = await grpc_serve(management_token="s3cret")
    load = pb.RepositoryModelLoadRequest(model_name="sklearn-3")
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    message = await node.error("RepositoryModelLoad", load, unauthenticated)
    assert message == (
        "this management call needs the header 'Authorization: Bearer <management token>'"
    )
    await node.error("RepositoryModelLoad", load, unauthenticated, authorization="Bearer wrong")
    await node.call("RepositoryModelLoad", load, authorization="Bearer s3cret")
    unload = pb.RepositoryModelUnloadRequest(model_name="sklearn-3")
    await node.error("RepositoryModelUnload", unload, unauthenticated)
    await node.call("RepositoryModelUnload", unload, authorization="Bearer s3cret")
    # Reading needs no token.
    await node.call("RepositoryIndex", pb.RepositoryIndexRequest())


async def test_the_request_id_metadata_names_the_call(node: GrpcHarness) -> None:
    with pytest.raises(aio.AioRpcError) as info:
        await node.call(
            "ModelInfer", infer("no-such-model", fp64(np.ones((1, 1)))), **{"x-request-id": "abc"}
        )
    assert info.value.details().endswith(" (request id abc)")
    assert dict(info.value.trailing_metadata() or ())["x-request-id"] == "abc"


def test_the_proto_s_messages_are_triton_s() -> None:
    """Every message field has the number and type of tritonclient's own copy of the proto."""
    from tritonclient.grpc import service_pb2 as triton

    for name, ours in pb.DESCRIPTOR.message_types_by_name.items():
        theirs = triton.DESCRIPTOR.message_types_by_name[name]
        assert json.dumps(_fields(ours)) == json.dumps(_fields(theirs)), name


def _fields(descriptor: Any) -> list[Any]:
    return [(f.name, f.number, f.type, f.is_repeated, _nested(f)) for f in descriptor.fields]


def _nested(field: Any) -> Any:
    return _fields(field.message_type) if field.message_type is not None else None


# ------------------------------------------------------------------------------------------------
# Tenants
# ------------------------------------------------------------------------------------------------


async def test_tenants_call_with_a_token_in_the_metadata(
    grpc_serve: GrpcServe, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        'tenants:\n  acme: {models: ["sklearn-1*"], tokens: ["tok-acme-0001"]}\n'
        '  beta: {models: ["sklearn-2"], tokens: ["tok-beta-0001"]}\n'
    )
    node = await grpc_serve(tenants=str(tenants), management_token="the-management-token")
    acme = {"authorization": "Bearer tok-acme-0001"}
    request = infer("sklearn-1", fp64(np.array([[0.5]])))
    response = await node.call("ModelInfer", request, **acme)
    [answer] = outputs_of(response).values()
    assert answer.ravel().tolist() == [pytest.approx(2.0, abs=0.05)]
    message = await node.error("ModelInfer", request, grpc.StatusCode.UNAUTHENTICATED)
    assert "send 'Authorization: Bearer <your token>'" in message
    other = infer("sklearn-2", fp64(np.array([[0.5]])))
    message = await node.error("ModelInfer", other, grpc.StatusCode.PERMISSION_DENIED, **acme)
    assert "tenant acme may not invoke model sklearn-2" in message
    index = await node.call("RepositoryIndex", pb.RepositoryIndexRequest(), **acme)
    names = [m.name for m in index.models]
    assert len(names) == 111 and all(n.startswith("sklearn-1") for n in names)
    await node.error(
        "ModelMetadata",
        pb.ModelMetadataRequest(name="sklearn-2"),
        grpc.StatusCode.PERMISSION_DENIED,
        **acme,
    )
