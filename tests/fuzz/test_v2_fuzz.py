"""Open Inference Protocol bodies: any body, any header length and any tensor description decode
to finite rows or to a documented 400, never another exception; over HTTP, never a 500."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from mmserver.codecs.v2 import DATATYPES, NUMERIC, InferRequest, v2_request
from mmserver.codecs.v2_requests import decode_v2
from mmserver.errors import InvalidInput
from tests.fuzz.strategies import FAST, SCALE, SLOW, assert_client_error, json_values
from tests.integration.harness import Harness, Serve

pytestmark = pytest.mark.timeout(90)

OUTPUTS = ("predict_proba", "predict", "decision_function")


def decoded_or_refused(body: bytes, header_length: str | None) -> InferRequest | None:
    """What the server does with a V2 body: the frontend's header check, then the backend's
    decode; ``None`` when refused with a documented error."""
    try:
        decoded = decode_v2(*v2_request(body, header_length)[:2], OUTPUTS)
    except Exception as exc:
        assert_client_error(exc, InvalidInput)
        return None
    rows = decoded.rows
    assert rows.dtype == np.float64 and rows.ndim == 2 and rows.flags.c_contiguous
    assert rows.shape[0] >= 1 and rows.shape[1] >= 1 and np.isfinite(rows).all()
    assert decoded.outputs and set(decoded.outputs) <= set(OUTPUTS)
    assert len(decoded.binary) == len(decoded.outputs)
    return decoded


header_lengths = st.one_of(
    st.none(),
    st.integers(min_value=0, max_value=400).map(str),
    st.sampled_from(["", "-1", " 12", "1e3", "\uff10", "99999999999999999999"]),
)
shapes = st.lists(st.integers(min_value=-1, max_value=4), max_size=3)
datatypes = st.one_of(st.sampled_from(DATATYPES), st.just("FLOAT"), json_values)
tensor_data = st.one_of(
    json_values,
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8),
    st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=8),
    st.lists(st.booleans(), max_size=8),
    st.lists(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=2), max_size=4),
)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """An input tensor, well formed or not, and the binary data it brings (if any)."""
    shape = draw(shapes)
    datatype = draw(datatypes)
    tensor: dict[str, Any] = {
        "name": draw(st.sampled_from(["x", "y", "z"])),
        "shape": shape,
        "datatype": datatype,
    }
    if draw(st.booleans()):
        tensor["data"] = draw(tensor_data)
        return tensor, b""
    dtype = NUMERIC.get(datatype) if isinstance(datatype, str) else None
    count = math.prod(shape) if all(d >= 0 for d in shape) else 0
    size = count * dtype.itemsize if dtype is not None else draw(st.integers(0, 16))
    size = draw(st.one_of(st.just(size), st.integers(min_value=-1, max_value=40)))
    tensor["parameters"] = {"binary_data_size": size}
    return tensor, draw(st.binary(min_size=max(size, 0), max_size=max(size, 0)))


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A V2 body as tritonclient would send it, perturbed: its inputs, outputs, parameters."""
    drawn = draw(st.lists(tensors(), min_size=0, max_size=3))
    header: dict[str, Any] = {"inputs": [t for t, _ in drawn]}
    if draw(st.booleans()):
        header["outputs"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from([*OUTPUTS, "label"])},
                    optional={
                        "parameters": st.dictionaries(
                            st.sampled_from(["binary_data", "classification"]),
                            json_values,
                            max_size=2,
                        )
                    },
                ),
                max_size=3,
            )
        )
    if draw(st.booleans()):
        header["parameters"] = {"binary_data_output": draw(st.one_of(st.booleans(), json_values))}
    if draw(st.booleans()):
        header["id"] = draw(st.one_of(st.text(max_size=5), json_values))
    text = json.dumps(header).encode()
    binary = b"".join(data for _, data in drawn)
    extra = draw(st.sampled_from([b"", b"\x00"]))
    length = str(len(text) + draw(st.sampled_from([0, 0, 0, -1, 1])))
    return text + binary + extra, (None if not binary and not extra else length)


@FAST
@given(st.binary(max_size=300), header_lengths)
@example(b'{"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [true]}]}', None)
@example(b'{"inputs": [{"name": "x", "shape": [], "datatype": "FP64", "data": [1]}]}', None)
def test_any_bytes_with_any_header_length(body: bytes, header_length: str | None) -> None:
    decoded_or_refused(body, header_length)


@FAST
@given(requests())
def test_perturbed_requests(request: tuple[bytes, str | None]) -> None:
    decoded = decoded_or_refused(*request)
    event("accepted" if decoded is not None else "refused")


@FAST
@given(
    st.lists(st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=3), min_size=1, max_size=5),
    st.sampled_from(["FP64", "FP32", "INT64"]),
    st.booleans(),
)
def test_well_formed_requests_decode_to_their_values(
    rows: list[list[float]], datatype: str, binary: bool
) -> None:
    array = np.array(rows).astype(NUMERIC[datatype])
    tensor: dict[str, Any] = {"name": "x", "shape": list(array.shape), "datatype": datatype}
    if binary:
        tensor["parameters"] = {"binary_data_size": array.nbytes}
        text = json.dumps({"inputs": [tensor]}).encode()
        decoded = decoded_or_refused(text + array.tobytes(), str(len(text)))
    else:
        tensor["data"] = array.tolist()
        decoded = decoded_or_refused(json.dumps({"inputs": [tensor]}).encode(), None)
    assert decoded is not None and decoded.rows.tolist() == array.astype(np.float64).tolist()


@pytest.fixture
async def fuzzed(serve: Serve) -> Harness:
    return await serve(max_request_size=4096)


@settings(SLOW, max_examples=200 * SCALE)
@given(
    request=requests(),
    model=st.sampled_from(["sklearn-0", "iris-classifier", "custom-handler"]),
)
async def test_v2_inference_answers_within_the_documented_set(
    fuzzed: Harness, request: tuple[bytes, str | None], model: str
) -> None:
    body, header_length = request
    headers = {"Inference-Header-Content-Length": header_length} if header_length else {}
    response = await fuzzed.post(f"/v2/models/{model}/infer", body, None, **headers)
    event(f"status {response.status}")
    assert response.status in (200, 400, 413), (response.status, await response.text())
    if response.status != 200:
        assert set(json.loads(await response.read())) == {"error"}
