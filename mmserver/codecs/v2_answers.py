"""A model's outputs to Open Inference Protocol (KServe V2) answers (:func:`encode_v2`), run where
the model runs; the terms it shares with the requests are in :mod:`mmserver.codecs.v2`.

An output is JSON ``data`` (flat, row-major) or binary data when the request asks for it
(:class:`~mmserver.codecs.v2.InferRequest`); its datatype follows the values: FP64, INT64, BOOL,
BYTES for strings... Outputs that are not a tensor raise :class:`~mmserver.errors.ModelError`.

An encoded answer travels back to the frontend as one ``bytes``: the JSON answer itself, or,
when some outputs are binary, :data:`_BINARY` and the JSON header's length followed by the header
and the binary data (:func:`split_answer` takes it apart again).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmserver.codecs.answers import json_encoder
from mmserver.codecs.explanations import Attributions, v2_tensor
from mmserver.codecs.v2 import BYTES_LENGTH, NUMERIC, VERSION, InferRequest, datatype_of
from mmserver.errors import ModelError

_BINARY = b"\x00"
_LENGTH = struct.Struct("!Q")


def encode_v2(request: InferRequest, results: Mapping[str, Any], model: str) -> bytes:
    """The answer to ``request`` from model ``model``, whose outputs for the request's rows are
    ``results`` (output name -> one item per row). Raises :class:`ModelError` for outputs that
    are not a tensor."""
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, binary in zip(request.outputs, request.binary, strict=True):
        result = results[name]
        parameters = None
        if isinstance(result, Attributions):
            result, parameters = v2_tensor(result)
        array = _tensor(result, name)
        datatype = datatype_of(array.dtype)
        output: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if parameters is not None:
            output["parameters"] = parameters
        if binary:
            blob = _binary(array, datatype)
            output["parameters"] = {**(parameters or {}), "binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            output["data"] = _json_values(array, datatype)
        outputs.append(output)
    name, _, version = model.partition("/")  # a version's key: NAME/2
    answer: dict[str, Any] = {"model_name": name, "model_version": version or VERSION}
    if request.id is not None:
        answer["id"] = request.id
    answer["outputs"] = outputs
    try:
        text = _ENCODER(answer)
    except ValueError:  # NaN or infinity: JSON has none, null stands for them
        text = _ENCODER(_plain(answer))
    header = text.encode()
    if not blobs:
        return header
    return b"".join((_BINARY, _LENGTH.pack(len(header)), header, *blobs))


def split_answer(answer: bytes) -> tuple[bytes | memoryview, int | None]:
    """An answer made by :func:`encode_v2`: the response body, and the length of its JSON
    header when binary data follows it (``None``: the body is all JSON)."""
    if answer[:1] != _BINARY:
        return answer, None
    start = 1 + _LENGTH.size
    (length,) = _LENGTH.unpack_from(answer, 1)
    return memoryview(answer)[start:], length


def _tensor(values: Any, name: str) -> np.ndarray:
    try:
        array = np.asarray(values)
    except ValueError:
        array = None
    if array is None or (
        array.dtype.kind == "O"
        and any(isinstance(v, list | tuple | np.ndarray) for v in array.flat)
    ):
        raise ModelError(
            f"the model's {name} output is not a regular tensor (rows of different lengths?); "
            "the V2 API answers tensors"
        )
    return array


def _binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for item in array.flat:
            data = _as_bytes(item)
            parts.append(BYTES_LENGTH.pack(len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=NUMERIC[datatype]).tobytes()


def _json_values(array: np.ndarray, datatype: str) -> list[Any]:
    if datatype == "BYTES":
        return [_as_bytes(item).decode("utf-8", "replace") for item in array.flat]
    values: list[Any] = array.ravel().tolist()
    return values


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, dict):
        return _ENCODER(_plain(item)).encode()
    if isinstance(item, np.generic):
        return str(item.item()).encode()
    return str(item).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_ENCODER = json_encoder(str)
