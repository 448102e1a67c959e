"""V2 over gRPC without a server: the status of each error, the ``grpc_port`` option, and a
``ModelInferRequest`` to the V2 binary body and back."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

from mmserver import errors
from mmserver.api.grpc.proto import grpc_service_pb2 as pb
from mmserver.api.grpc.service import status_code
from mmserver.api.grpc.tensors import infer_body, infer_response, json_parameters
from mmserver.cli import build_config
from mmserver.codecs.v2 import v2_request
from mmserver.codecs.v2_answers import encode_v2, split_answer
from mmserver.codecs.v2_requests import decode_v2
from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError, InvalidInput

Code = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.InvalidInput, Code.INVALID_ARGUMENT),
        (errors.InvalidModelName, Code.INVALID_ARGUMENT),
        (errors.ModelNotFound, Code.NOT_FOUND),
        (errors.Unauthorized, Code.UNAUTHENTICATED),
        (errors.Forbidden, Code.PERMISSION_DENIED),
        (errors.ModelExists, Code.ALREADY_EXISTS),
        (errors.RequestTooLarge, Code.RESOURCE_EXHAUSTED),
        (errors.UnsupportedMediaType, Code.INVALID_ARGUMENT),
        (errors.ModelError, Code.INTERNAL),
        (errors.ModelLoadError, Code.INTERNAL),
        (errors.BackendDied, Code.INTERNAL),
        (errors.QueueFull, Code.UNAVAILABLE),
        (errors.ShuttingDown, Code.UNAVAILABLE),
        (errors.PredictTimeout, Code.DEADLINE_EXCEEDED),
        (errors.InsufficientMemory, Code.RESOURCE_EXHAUSTED),
        (errors.MMServerError, Code.INTERNAL),
    ],
)
def test_each_error_has_the_status_of_its_http_status(
    error: type[errors.MMServerError], code: grpc.StatusCode
) -> None:
    assert status_code(error.status_code) == code


@pytest.mark.parametrize(
    ("status", "code"),
    [(429, Code.RESOURCE_EXHAUSTED), (418, Code.INVALID_ARGUMENT), (502, Code.INTERNAL)],
)
def test_statuses_without_an_error_class(status: int, code: grpc.StatusCode) -> None:
    assert status_code(status) == code


def test_grpc_port_from_flag_env_and_file(tmp_path: Path) -> None:
    assert build_config(["serve"], {}).grpc_port == 0
    conf = tmp_path / "mm.properties"
    conf.write_text("grpc_port=9001\n")
    assert build_config(["serve", "--config", str(conf)], {}).grpc_port == 9001
    env = {"MMSERVER_GRPC_PORT": "9002"}
    assert build_config(["serve", "--config", str(conf)], env).grpc_port == 9002
    assert build_config(["serve", "--grpc-port", "9003"], env).grpc_port == 9003


@pytest.mark.parametrize("port", [65536, 8080])
def test_grpc_port_must_be_a_port_other_than_http_s(port: int) -> None:
    with pytest.raises(ConfigError, match=f"option grpc_port={port}: must be between 1 and 65535"):
        ServerConfig(grpc_port=port)


def request_of(*tensors: tuple[str, str, list[int], bytes]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="r-7")
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def test_raw_inputs_become_the_binary_body_with_every_output_binary() -> None:
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    request = request_of(("x", "FP64", [2, 2], x.tobytes()))
    request.parameters["priority"].int64_param = 3
    output = request.outputs.add(name="predict")
    output.parameters["binary_data"].bool_param = False
    body, length = infer_body(request)
    header = json.loads(body[:length])
    assert header == {
        "id": "r-7",
        "parameters": {"priority": 3, "binary_data_output": True},
        "inputs": [
            {
                "name": "x",
                "datatype": "FP64",
                "shape": [2, 2],
                "parameters": {"binary_data_size": 32},
            }
        ],
        "outputs": [{"name": "predict", "parameters": {"binary_data": True}}],
    }
    assert body[length:] == x.tobytes()
    decoded = decode_v2(*v2_request(body, str(length))[:2], ["predict"])
    assert decoded.id == "r-7" and decoded.binary == [True]
    assert np.array_equal(decoded.rows, x)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "raw"),
    [
        ("FP64", "fp64_contents", [1.5, -2.0], np.array([1.5, -2.0], "<f8").tobytes()),
        ("FP32", "fp32_contents", [1.5], np.array([1.5], "<f4").tobytes()),
        ("INT8", "int_contents", [-3, 4], np.array([-3, 4], "i1").tobytes()),
        ("INT64", "int64_contents", [2**40], np.array([2**40], "<i8").tobytes()),
        ("UINT16", "uint_contents", [65535], np.array([65535], "<u2").tobytes()),
        ("BOOL", "bool_contents", [True, False], b"\x01\x00"),
        ("BYTES", "bytes_contents", [b"ab", b""], b"\x02\x00\x00\x00ab\x00\x00\x00\x00"),
    ],
)
def test_typed_contents_are_packed_as_raw_data(
    datatype: str, field: str, values: list[object], raw: bytes
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[len(values)])
    getattr(tensor.contents, field).extend(values)
    body, length = infer_body(request)
    assert body[length:] == raw


@pytest.mark.parametrize(
    ("datatype", "field", "values", "message"),
    [
        ("FP16", None, [], "input 'x' is FP16, which has no typed contents"),
        ("FP64", "int_contents", [1], "its contents are in int_contents"),
        ("INT8", "int_contents", [300], "input 'x' has a value out of the range of INT8"),
    ],
)
def test_contents_without_a_raw_form_are_refused(
    datatype: str, field: str | None, values: list[int], message: str
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[1])
    if field is not None:
        getattr(tensor.contents, field).extend(values)
    with pytest.raises(InvalidInput, match=message):
        infer_body(request)


def test_raw_and_typed_contents_are_not_mixed() -> None:
    request = request_of(("x", "FP64", [1], b"\x00" * 8))
    request.inputs[0].contents.fp64_contents.append(1.0)
    with pytest.raises(InvalidInput, match="send every input one way"):
        infer_body(request)


def test_the_answer_s_binary_outputs_become_raw_output_contents() -> None:
    decoded = decode_v2(
        b'{"id": "q", "inputs": [{"name": "x", "datatype": "FP64", "shape": [2], "data": [1, 2]}],'
        b' "outputs": [{"name": "a", "parameters": {"binary_data": true}},'
        b' {"name": "b", "parameters": {"binary_data": true}}]}',
        "v2",
        ["a", "b"],
    )
    answer = encode_v2(decoded, {"a": [1.0, 2.0], "b": ["x", "yz"]}, "m")
    body, length = split_answer(answer)
    assert length is not None
    response = infer_response(bytes(body), length)
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "q")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("a", "FP64", [2]),
        ("b", "BYTES", [2]),
    ]
    assert response.raw_output_contents[0] == np.array([1.0, 2.0]).tobytes()
    assert (
        response.raw_output_contents[1]
        == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    )


def test_parameters_as_json() -> None:
    request = pb.RepositoryModelLoadRequest()
    request.parameters["config"].string_param = "{}"
    request.parameters["file:a"].bytes_param = b"\x00"
    request.parameters["n"].int64_param = -1
    request.parameters["none"].CopyFrom(pb.ModelRepositoryParameter())
    assert json_parameters(request.parameters) == {
        "config": "{}",
        "file:a": b"\x00",
        "n": -1,
        "none": None,
    }
