"""Open Inference Protocol bodies: JSON and binary tensors to rows, outputs to V2 answers."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from mmserver.codecs.v2 import InferRequest, is_v2, v2_request
from mmserver.codecs.v2_answers import encode_v2, split_answer
from mmserver.codecs.v2_requests import decode_v2
from mmserver.errors import InvalidInput, ModelError

OUTPUTS = ("predict_proba", "predict")


def tensor(data: Any, shape: list[int], datatype: str = "FP64", name: str = "x") -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def decode(request: dict[str, Any], outputs: tuple[str, ...] = OUTPUTS) -> InferRequest:
    body, kind, _ = v2_request(json.dumps(request).encode(), None)
    return decode_v2(body, kind, outputs)


def binary_request(
    inputs: list[tuple[str, np.ndarray, str]], extra: dict[str, Any] | None = None
) -> tuple[bytes, str]:
    """A body with every input as binary data, as tritonclient sends it, and its kind."""
    header = {
        "inputs": [
            {
                "name": n,
                "shape": list(a.shape),
                "datatype": d,
                "parameters": {"binary_data_size": a.nbytes},
            }
            for n, a, d in inputs
        ],
        **(extra or {}),
    }
    text = json.dumps(header).encode()
    body = text + b"".join(a.tobytes() for _, a, _ in inputs)
    _, kind, _ = v2_request(body, str(len(text)))
    return body, kind


def refused(request: dict[str, Any]) -> str:
    with pytest.raises(InvalidInput) as info:
        decode(request)
    assert info.value.status_code == 400
    return info.value.message


def test_json_tensors_flat_or_nested_are_rows() -> None:
    flat = decode({"inputs": [tensor([1, 2, 3, 4], [2, 2])]})
    nested = decode({"inputs": [tensor([[1, 2], [3, 4]], [2, 2])], "id": "a"})
    assert flat.rows.tolist() == nested.rows.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert flat.rows.dtype == np.float64 and flat.rows.flags.c_contiguous
    assert (flat.id, nested.id) == (None, "a")
    assert flat.outputs == ["predict_proba"] and flat.binary == [False]


def test_one_dimensional_inputs_are_columns_side_by_side() -> None:
    request = decode(
        {
            "inputs": [
                tensor([1, 2], [2], "INT32", "a"),
                tensor([[10, 11], [20, 21]], [2, 2], "FP32", "b"),
                tensor([True, False], [2], "BOOL", "c"),
            ]
        }
    )
    assert request.rows.tolist() == [[1, 10, 11, 1], [2, 20, 21, 0]]


def test_values_are_read_as_their_datatype() -> None:
    request = decode({"inputs": [tensor([0.1], [1, 1], "FP32")]})
    assert request.rows[0, 0] == float(np.float32(0.1))


def test_binary_tensors_follow_the_json_header() -> None:
    x = np.array([[1.5, 2.5], [3.5, 4.5]], dtype=np.float32)
    flags = np.array([True, False])
    body, kind = binary_request(
        [("x", x, "FP32"), ("f", flags, "BOOL")],
        {
            "parameters": {"binary_data_output": True},
            "outputs": [
                {"name": "predict", "parameters": {"binary_data": False}},
                {"name": "predict_proba"},
            ],
        },
    )
    assert is_v2(kind) and kind.startswith("v2:")
    request = decode_v2(body, kind, OUTPUTS)
    assert request.rows.tolist() == [[1.5, 2.5, 1.0], [3.5, 4.5, 0.0]]
    assert request.outputs == ["predict", "predict_proba"] and request.binary == [False, True]


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (
            {"inputs": [tensor([1, 2, 3], [2, 2])]},
            "has shape [2, 2], 4 value(s), but its data has 3",
        ),
        ({"inputs": [tensor([1], [1], "BYTES")]}, "has datatype BYTES; the model takes numbers"),
        ({"inputs": [tensor([1], [1], "FLOAT")]}, "datatype 'FLOAT'; expected one of BOOL"),
        ({"inputs": [tensor([1.5], [1], "INT64")]}, "is INT64; its data must be integers from"),
        (
            {"inputs": [tensor([300], [1], "UINT8")]},
            "is UINT8; its data must be integers from 0 to 255",
        ),
        ({"inputs": [tensor([1], [1], "BOOL")]}, "is BOOL; its data must be true or false"),
        (
            {"inputs": [tensor([0.0, 65520.0], [2], "FP16")]},
            "value 65520.0 is beyond the range of FP16 (±65504); send it as FP64",
        ),
        (
            {"inputs": [tensor([-1e39], [1], "FP32")]},
            "value -1e+39 is beyond the range of FP32",
        ),
        ({"inputs": [tensor(["a"], [1])]}, "value 'a' is not a number; datatype FP64"),
        ({"inputs": [tensor([[1, 2], [3]], [3])]}, "not a regular array"),
        (
            {"inputs": [tensor([-1, 2**63], [2], "INT64")]},
            "must be integers from -9223372036854775808",
        ),
        ({"inputs": [tensor([2**64], [1])]}, "an integer is beyond 64 bits; datatype FP64"),
        ({"inputs": [tensor([1], [1, 1, 1])]}, "expected [rows] (one feature) or [rows, features]"),
        (
            {"inputs": [tensor([1, 2], [2], name="a"), tensor([1], [1], name="b")]},
            "'a' has 2, 'b' has 1",
        ),
        ({"inputs": [tensor([1], [1]), tensor([2], [1])]}, "two inputs are named 'x'"),
        ({"inputs": [tensor([], [0, 2])]}, "the inputs hold no values"),
        ({"inputs": []}, "needs 'inputs', a non-empty list of tensors"),
        (
            {"inputs": [{"name": "x", "shape": [-1], "datatype": "FP64", "data": [1]}]},
            "needs 'shape', a list of non-negative integers",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP64"}]}, "has no 'data'"),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": ["FP64"], "data": [1]}]},
            "expected one of BOOL",
        ),
        (
            {"inputs": [tensor([1], [1])], "outputs": [{"name": "score"}]},
            "the model has no output 'score'; its outputs are predict_proba, predict",
        ),
        (
            {"inputs": [tensor([1], [1])], "outputs": [{"name": "predict"}, {"name": "predict"}]},
            "output 'predict' is asked for twice",
        ),
        (
            {
                "inputs": [tensor([1], [1])],
                "outputs": [{"name": "predict", "parameters": {"classification": 2}}],
            },
            "the classification extension is not supported",
        ),
        (
            {"inputs": [tensor([1], [1])], "parameters": {"binary_data_output": "yes"}},
            "parameter binary_data_output is 'yes'; expected true or false",
        ),
        ({"inputs": [tensor([1], [1])], "id": 7}, "'id' is a JSON number; expected a string"),
        (
            {"inputs": [{**tensor([1], [1]), "parameters": {"shared_memory_region": "r"}}]},
            "the shared memory extension is not supported",
        ),
    ],
)
def test_bad_requests_say_what_is_wrong(request_: dict[str, Any], expected: str) -> None:
    assert expected in refused(request_)


def test_narrow_floats_take_every_value_that_rounds_into_their_range() -> None:
    # 65519 rounds to FP16's largest value, 65504; it does not overflow.
    request = decode({"inputs": [tensor([65519.0, -1.5], [2], "FP16")]})
    assert request.rows.tolist() == [[65504.0], [-1.5]]


def test_non_finite_values_are_refused_with_their_place() -> None:
    body = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP64", "data": [1, NaN]}]}'
    with pytest.raises(InvalidInput, match=r"input 'x': value nan at row 0, column 1"):
        decode_v2(body, "v2", OUTPUTS)


def test_binary_sizes_must_match_the_shape_and_the_body() -> None:
    x = np.array([[1.0, 2.0]])
    body, kind = binary_request([("x", x, "FP64")])
    header_length = int(kind.partition(":")[2])
    header = json.loads(body[:header_length])
    header["inputs"][0]["parameters"]["binary_data_size"] = 12
    text = json.dumps(header).encode()
    with pytest.raises(InvalidInput, match="needs 16 bytes of binary data; its binary_data_size"):
        decode_v2(text + x.tobytes(), f"v2:{len(text)}", OUTPUTS)
    with pytest.raises(InvalidInput, match="only 8 bytes follow the header"):
        decode_v2(body[:-8], kind, OUTPUTS)
    with pytest.raises(InvalidInput, match="17 bytes of binary data follow the JSON header"):
        decode_v2(body + b"\0", kind, OUTPUTS)
    with pytest.raises(InvalidInput, match="BOOL; its binary data must be bytes 0 or 1"):
        flags, flags_kind = binary_request([("f", np.array([1, 2], dtype=np.uint8), "BOOL")])
        decode_v2(flags, flags_kind, OUTPUTS)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("abc", "is 'abc'; expected the length in bytes"), ("99", "but the body has only 2 bytes")],
)
def test_the_header_length_header_is_checked_on_the_frontend(value: str, expected: str) -> None:
    with pytest.raises(InvalidInput, match=expected):
        v2_request(b"{}", value)


def test_a_header_that_is_not_json_names_the_header_length() -> None:
    with pytest.raises(InvalidInput, match=r"the first 3 bytes \(Inference-Header-Content-Length"):
        decode_v2(b"{x}abc", "v2:3", OUTPUTS)
    with pytest.raises(InvalidInput, match="expected an object with 'inputs'"):
        decode_v2(b"[1]", "v2", OUTPUTS)


def test_json_answers_carry_name_version_id_and_tensors() -> None:
    request = InferRequest("r1", np.zeros((2, 1)), ["predict", "predict_proba"], [False, False])
    answer = encode_v2(
        request,
        {
            "predict": np.array(["setosa", "virginica"]),
            "predict_proba": np.array([[0.25, float("nan")], [1.0, 0.0]]),
        },
        "iris",
    )
    body, header_length = split_answer(answer)
    assert header_length is None
    assert json.loads(body) == {
        "model_name": "iris",
        "model_version": "1",
        "id": "r1",
        "outputs": [
            {"name": "predict", "datatype": "BYTES", "shape": [2], "data": ["setosa", "virginica"]},
            {
                "name": "predict_proba",
                "datatype": "FP64",
                "shape": [2, 2],
                "data": [0.25, None, 1.0, 0.0],
            },
        ],
    }


def test_binary_answers_have_their_header_length_and_data_in_order() -> None:
    request = InferRequest(None, np.zeros((2, 1)), ["predict", "labels"], [True, True])
    answer = encode_v2(
        request, {"predict": np.array([1, 2], dtype=np.int32), "labels": ["a", "bc"]}, "m"
    )
    body, header_length = split_answer(answer)
    assert header_length is not None
    raw = bytes(body)
    header = json.loads(raw[:header_length])
    assert "id" not in header
    assert [o["datatype"] for o in header["outputs"]] == ["INT32", "BYTES"]
    assert [o["parameters"]["binary_data_size"] for o in header["outputs"]] == [8, 11]
    data = raw[header_length:]
    assert np.frombuffer(data[:8], "<i4").tolist() == [1, 2]
    assert data[8:] == struct.pack("<I", 1) + b"a" + struct.pack("<I", 2) + b"bc"


def test_outputs_that_are_not_tensors_are_model_errors() -> None:
    request = InferRequest(None, np.zeros((2, 1)), ["predict"], [False])
    with pytest.raises(ModelError, match="not a regular tensor"):
        encode_v2(request, {"predict": [[1, 2], [3]]}, "m")
    dicts = encode_v2(request, {"predict": [{"a": 1}, {"a": np.float64(2.0)}]}, "m")
    assert json.loads(dicts)["outputs"][0]["data"] == ['{"a": 1}', '{"a": 2.0}']


@pytest.mark.parametrize(
    ("data", "datatype"), [([True, 2.5], "FP64"), ([True, 2], "INT32"), ([[False, True]], "FP32")]
)
def test_a_json_boolean_in_a_numeric_tensor_is_refused(data: Any, datatype: str) -> None:
    shape = [1, 2]
    with pytest.raises(InvalidInput, match="holds a JSON true or false where numbers"):
        decode({"inputs": [tensor(data, shape, datatype)]})
    assert decode({"inputs": [tensor([1, 2], shape, datatype)]}).rows.tolist() == [[1.0, 2.0]]
