"""Request bodies to rows and outputs to response bodies: every format, every refusal."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest

from mmserver.codecs.answers import (
    CSV_RESPONSE_TYPE,
    encode_as,
    encode_json,
    json_encoder,
    wants_csv,
)
from mmserver.codecs.requests import media_type
from mmserver.errors import InvalidInput, ModelError, UnsupportedMediaType
from tests.models import decode, encode


def npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def npy_header(header: str, version: bytes = b"\x01\x00") -> bytes:
    """A hand-written .npy header (to describe arrays the body does not hold)."""
    text = header.encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY" + version + len(text).to_bytes(2, "little") + text


# ------------------------------------------------------------------------------------------------
# Accepted bodies
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "expected"),
    [
        (b"[[0.5]]", "application/json", [[0.5]]),
        (b"[[0.5]]", None, [[0.5]]),
        (b"[[0.5]]", "", [[0.5]]),
        (b"[[1, 2], [3, 4.5]]", "application/json; charset=utf-8", [[1, 2], [3, 4.5]]),
        (b"[1, 2, 3]", "Application/JSON", [[1, 2, 3]]),
        (b'{"inputs": [[1, 2], [3, 4]]}', "application/json", [[1, 2], [3, 4]]),
        (b'{"inputs": [7, 8]}', "application/json", [[7, 8]]),
        (b'{"instances": [[0.25]]}', "application/json", [[0.25]]),
        (b'{"instances": [1], "other": true}', "application/json", [[1]]),
        (b"  [[-1e3, 2E-2]]\n", "application/json", [[-1000.0, 0.02]]),
        (b"[[100000000000000000000000000000]]", "application/json", [[1e29]]),
        ("[[0.5]]".encode("utf-16"), "application/json", [[0.5]]),
        (b"1,2\n3,4\n", "text/csv", [[1, 2], [3, 4]]),
        (b"0.5", "text/csv", [[0.5]]),
        (b"1, 2 ,3\r\n4,5,6\r\n", "text/csv; charset=utf-8", [[1, 2, 3], [4, 5, 6]]),
        (b'"1.5","2"\n', "text/csv", [[1.5, 2]]),
        (b"\xef\xbb\xbf1,2\n\n3,4\n\n", "TEXT/CSV", [[1, 2], [3, 4]]),
        (b"-1e-3,+4\n", "text/csv", [[-0.001, 4]]),
    ],
)
def test_decode_accepts(body: bytes, content_type: str | None, expected: list[list[float]]) -> None:
    rows = decode(body, content_type)
    assert rows.dtype == np.float64
    assert rows.ndim == 2
    assert rows.flags.c_contiguous
    assert rows.tolist() == expected


@pytest.mark.parametrize(
    "array",
    [
        np.array([[1.5, 2.5], [3.5, 4.5]]),
        np.array([[1, 2, 3]], dtype=np.int32),
        np.array([[1, 2]], dtype=np.uint8),
        np.array([0.5, 1.5], dtype=np.float32),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.arange(4.0).reshape(2, 2).astype(">f8"),
        np.array([[7]], dtype=np.int64),
    ],
    ids=["f8-2d", "i4", "u1", "f4-1d", "fortran", "big-endian", "i8"],
)
def test_decode_npy(array: np.ndarray) -> None:
    rows = decode(npy(array), "application/x-npy")
    expected = array.reshape(1, -1) if array.ndim == 1 else array
    assert rows.dtype == np.float64
    assert rows.flags.c_contiguous and rows.flags.writeable
    np.testing.assert_array_equal(rows, expected.astype(np.float64))


def test_decode_npy_version_2_header() -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.array([[1.0, 2.0]]), version=(2, 0))
    body = buffer.getvalue()
    assert body[6:8] == b"\x02\x00"
    assert decode(body, "application/x-npy").tolist() == [[1.0, 2.0]]


def test_decode_npy_does_not_share_the_body() -> None:
    body = bytearray(npy(np.array([[1.0, 2.0]])))
    rows = decode(bytes(body), "application/x-npy")
    rows[0, 0] = 9.0
    assert decode(bytes(body), "application/x-npy").tolist() == [[1.0, 2.0]]


def test_decode_large_json_batch() -> None:
    data = np.random.default_rng(0).normal(size=(2000, 5))
    rows = decode(json.dumps(data.tolist()).encode(), "application/json")
    np.testing.assert_array_equal(rows, data)


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        (None, "application/json"),
        ("", "application/json"),
        ("application/json", "application/json"),
        ("text/csv; header=absent", "text/csv"),
        (" Application/X-NPY ; q=1", "application/x-npy"),
        (";charset=utf-8", "application/json"),
    ],
)
def test_media_type(content_type: str | None, expected: str) -> None:
    assert media_type(content_type) == expected


# ------------------------------------------------------------------------------------------------
# Refused bodies: the error type and what the message tells the client
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        # JSON
        (b"", "application/json", "the request body is empty; expected JSON"),
        (b"  \n", None, "the request body is empty"),
        (b"[1,", "application/json", "the body is not valid JSON"),
        (b"{'a': 1}", "application/json", "the body is not valid JSON"),
        (b"\xff\xfe\xfa", "application/json", "the body is not valid JSON"),
        (b"[" * 100_000, "application/json", "the body is not valid JSON"),
        (b"[]", "application/json", "the input is empty"),
        (b"[[]]", "application/json", "the input has no values (shape (1, 0))"),
        (b"[[], []]", "application/json", "the input has no values (shape (2, 0))"),
        (b"5", "application/json", "got a JSON number"),
        (b'"abc"', "application/json", "got a JSON string"),
        (b"null", "application/json", "got a JSON null"),
        (b'{"data": [1]}', "application/json", "needs an 'inputs' or 'instances' member"),
        (b'{"inputs": 3}', "application/json", "got a JSON number"),
        (b'{"inputs": {"a": 1}}', "application/json", "got a JSON object"),
        (b"[[1, 2], [3]]", "application/json", "row 0 has 2 values, row 1 has 1"),
        (b"[[1], 2]", "application/json", "row 1 is a JSON number"),
        (b"[1, [2]]", "application/json", "value at position 1 is a JSON array"),
        (b'[[1, "a"]]', "application/json", "value at row 0, column 1 is a JSON string ('a')"),
        (b'["1.5"]', "application/json", "value at position 0 is a JSON string ('1.5')"),
        (b"[[1, null]]", "application/json", "value at row 0, column 1 is null, a missing value"),
        (b"[[true, 2]]", "application/json", "value at row 0, column 0 is a JSON boolean"),
        (b"[false]", "application/json", "value at position 0 is a JSON boolean"),
        (b'[[1, {"a": 1}]]', "application/json", "value at row 0, column 1 is a JSON object"),
        (b"[[[1]]]", "application/json", "got a 3-D array"),
        (b"[[1, NaN]]", "application/json", "value nan at row 0, column 1 is not finite"),
        (b"[Infinity]", "application/json", "value inf at row 0, column 0 is not finite"),
        (b"[[0], [-1e999]]", "application/json", "value -inf at row 1, column 0 is not finite"),
        # CSV
        (b"", "text/csv", "the request body is empty; expected CSV"),
        (b"\n \n", "text/csv", "the request body is empty"),
        (b"x,y\n1,2\n", "text/csv", "CSV value 'x' at line 1, column 1 is not a number"),
        (b"1,2\n3,abc\n", "text/csv", "CSV value 'abc' at line 2, column 2 is not a number"),
        (b"1,,2\n", "text/csv", "value nan at row 0, column 1 is not finite"),
        (b"1,2\n3\n", "text/csv", "line 1 has 2 values, line 2 has 1"),
        (b"1,nan\n", "text/csv", "value nan at row 0, column 1 is not finite"),
        (b"inf\n", "text/csv", "value inf at row 0, column 0 is not finite"),
        (b"\xff\xfe1,2", "text/csv", "the CSV body is not valid UTF-8 text"),
        (b'"1,2\n', "text/csv", "not valid CSV"),
        # NPY
        (b"", "application/x-npy", "the request body is empty; expected a .npy array"),
        (b"[[1.0]]", "application/x-npy", "does not start with the NumPy magic bytes"),
        (b"PK\x03\x04zipfile", "application/x-npy", "does not start with the NumPy magic"),
        (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8',", "application/x-npy", "header is invalid"),
        (b"\x93NUMPY\x03\x00\x00\x00\x00\x00", "application/x-npy", "version (3, 0) is not"),
        (
            npy_header("__import__('os').system('true')"),
            "application/x-npy",
            "the .npy header is invalid",
        ),
        (
            npy_header("{'descr': '<f8', 'fortran_order': False, 'shape': (10**12,), }"),
            "application/x-npy",
            "the .npy header is invalid",
        ),
        (
            npy_header("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }"),
            "application/x-npy",
            "needs 8000000000000 bytes of data, the body has 0",
        ),
        (npy(np.zeros(3))[:-1], "application/x-npy", "needs 24 bytes of data, the body has 23"),
        (
            npy(np.zeros(3)) + b"\x00",
            "application/x-npy",
            "needs 24 bytes of data, the body has 25",
        ),
        (
            npy(np.array(["a", "b"])),
            "application/x-npy",
            "dtype '<U1'; expected integers or floats",
        ),
        (npy(np.array([True])), "application/x-npy", "dtype '|b1'; expected integers or floats"),
        (npy(np.array([1 + 2j])), "application/x-npy", "dtype '<c16'"),
        (
            npy(np.array([[1, None]], dtype=object), allow_pickle=True),
            "application/x-npy",
            "dtype '|O'; expected integers or floats",
        ),
        (
            npy(np.zeros(2, dtype=[("a", "<f8"), ("b", "<i4")])),
            "application/x-npy",
            "expected integers or floats",
        ),
        (npy(np.zeros((2, 2, 2))), "application/x-npy", "got a 3-D array"),
        (npy(np.array(3.0)), "application/x-npy", "got a 0-D array"),
        (npy(np.zeros((0, 3))), "application/x-npy", "the input has no values (shape (0, 3))"),
        (npy(np.zeros(0)), "application/x-npy", "the input is empty"),
        (npy(np.array([1.0, np.nan])), "application/x-npy", "value nan at row 0, column 1"),
    ],
)
def test_decode_refuses(body: bytes, content_type: str | None, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        decode(body, content_type)
    assert type(caught.value) is InvalidInput
    assert caught.value.status_code == 400
    assert caught.value.amzn_error_type == "ValidationError"
    assert message in caught.value.message


@pytest.mark.parametrize(
    "message_part", ["expected a 2-D array of numbers (one list per row) or a 1-D array"]
)
def test_decode_messages_say_what_was_expected(message_part: str) -> None:
    for body in (b"[]", b"5", b"[[[1]]]", b"[1,"):
        with pytest.raises(InvalidInput) as caught:
            decode(body, "application/json")
        assert message_part in caught.value.message


@pytest.mark.parametrize(
    "content_type",
    ["application/xml", "text/plain", "application/octet-stream", "multipart/form-data; b=x"],
)
def test_decode_unsupported_media_type(content_type: str) -> None:
    with pytest.raises(UnsupportedMediaType) as caught:
        decode(b"[[1]]", content_type)
    assert caught.value.status_code == 415
    assert caught.value.amzn_error_type == "ValidationError"
    kind = content_type.partition(";")[0]
    assert caught.value.message == (
        f"content type {kind!r} is not supported; send one of application/json, text/csv, "
        "application/x-npy, text/libsvm, text/x-libsvm"
    )


def test_decode_never_unpickles() -> None:
    """A pickle in a .npy body is refused by its dtype; nothing is ever loaded from it."""

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (pytest.fail, ("unpickled",))

    body = npy(np.array([Boom()], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInput) as caught:
        decode(body, "application/x-npy")
    assert caught.value.message == ".npy array has dtype '|O'; expected integers or floats"


# ------------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        (np.array([2.0, 3.5]), [2.0, 3.5]),
        (np.array([[0.1, 0.9], [0.8, 0.2]]), [[0.1, 0.9], [0.8, 0.2]]),
        (np.array([1, 0, 2]), [1, 0, 2]),
        (np.array(["setosa", "virginica"]), ["setosa", "virginica"]),
        ([{"value": 0.5, "doubled": 1.0}], [{"value": 0.5, "doubled": 1.0}]),
        ([np.float32(1.5), np.int64(2), np.array([1.0, 2.0])], [1.5, 2, [1.0, 2.0]]),
        ([float("nan"), float("inf"), 1.0], [None, None, 1.0]),
        (np.array([[np.nan, 1.0]]), [[None, 1.0]]),
        ([], []),
    ],
)
@pytest.mark.parametrize("accept", [None, "application/json", "*/*", "image/png", ""])
def test_encode_json(outputs: Any, expected: list[Any], accept: str | None) -> None:
    body, content_type = encode(outputs, accept)
    assert content_type == "application/json"
    assert json.loads(body) == {"predictions": expected}
    assert b"NaN" not in body and b"Infinity" not in body


@pytest.mark.parametrize(
    ("outputs", "expected"),
    [
        (np.array([2.0, 3.5]), "2.0\n3.5\n"),
        (np.array([[0.1, 0.9], [0.8, 0.2]]), "0.1,0.9\n0.8,0.2\n"),
        (np.array([1, 2]), "1\n2\n"),
        (["a,b", 'say "hi"'], '"a,b"\n"say ""hi"""\n'),
        ([{"value": 0.5, "doubled": 1.0}, {"value": 1, "doubled": 2}], "0.5,1.0\n1,2\n"),
        ([[1, [2, 3]], [np.float64(4.5), {"k": 1}]], '1,"[2, 3]"\n4.5,"{""k"": 1}"\n'),
        ([], ""),
    ],
)
def test_encode_csv(outputs: Any, expected: str) -> None:
    body, content_type = encode(outputs, "text/csv")
    assert content_type == CSV_RESPONSE_TYPE == "text/csv; charset=utf-8"
    assert body.decode() == expected


def test_encode_csv_round_trips_floats() -> None:
    values = np.random.default_rng(1).normal(size=(50, 3))
    body, _ = encode(values, "text/csv")
    np.testing.assert_array_equal(decode(body, "text/csv"), values)


def test_encode_refuses_values_without_a_json_form() -> None:
    with pytest.raises(ModelError) as caught:
        encode([object()], None)
    assert caught.value.status_code == 424
    assert caught.value.message == (
        "the model's output cannot be encoded: prediction value of type object cannot be sent "
        "as JSON"
    )


@pytest.mark.parametrize(
    ("accept", "csv"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("application/json", False),
        ("text/csv", True),
        ("TEXT/CSV; charset=utf-8", True),
        ("text/*", True),
        ("text/csv, application/json", True),
        ("application/json, text/csv", False),
        ("text/csv;q=0.5, application/json", False),
        ("application/json;q=0.1, text/csv", True),
        ("application/json;q=0.5, text/csv;q=0.9, */*;q=0.1", True),
        ("text/csv;q=0", False),
        ("text/csv;q=abc, application/json;q=0.1", False),
        ("image/png, text/csv;q=0.2", True),
        ("image/png", False),
        ("application/*, text/csv", False),
    ],
)
def test_wants_csv(accept: str | None, csv: bool) -> None:
    assert wants_csv(accept) is csv


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-16-le", "utf-32"])
def test_a_json_boolean_is_refused_in_any_encoding(encoding: str) -> None:
    with pytest.raises(InvalidInput, match="is a JSON boolean"):
        decode("[[true, 2.5]]".encode(encoding), "application/json")
    assert decode("[[1.0, 2.5]]".encode(encoding), "application/json").tolist() == [[1.0, 2.5]]


@pytest.mark.parametrize(
    "value",
    [
        {"predictions": [1.5, 2, -3.25e-12]},
        {"predictions": [[0.1, 0.9], [1.0, 0.0]]},
        {"predictions": ['a\u00e9"b', True, None, {"k": [1, 2.5]}]},
        [],
        "text",
    ],
)
def test_the_json_encoder_writes_what_json_dumps_writes(value: Any) -> None:
    assert json_encoder(str)(value) == json.dumps(value, allow_nan=False)


def test_an_output_that_holds_itself_has_no_json_form() -> None:
    looped: list[Any] = [1.0]
    looped.append(looped)
    with pytest.raises(ModelError, match="cannot be encoded"):
        encode_json(looped)
    with pytest.raises(ModelError, match="cannot be encoded"):
        encode_as(looped, None)
    assert encode_as(np.array([1.0, np.nan]), None) == b'{"predictions": [1.0, null]}'
