"""gRPC inference messages to and from the V2 REST binary form, which the data plane takes.

:func:`infer_body` writes a ``ModelInferRequest`` as the body of Triton's binary tensor data
extension: a JSON header (the request's id and parameters, each input's name, datatype, shape,
parameters and ``binary_data_size``, every output asked for as binary data), then each input's
bytes: its ``raw_input_contents`` as they came, or its typed ``contents`` packed the same way
(little-endian, row-major; a BYTES item a 4-byte little-endian length and its bytes). The
header's checks are the backend's, as for REST (:func:`mmserver.codecs.v2_requests.decode_v2`):
only what has no REST form is refused here. :func:`infer_response` reads the answer back into a
``ModelInferResponse`` whose outputs are ``raw_output_contents``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmserver.api.grpc.proto import grpc_service_pb2 as pb
from mmserver.codecs.v2 import NUMERIC
from mmserver.errors import InvalidInput

_BYTES_LENGTH = struct.Struct("<I")

#: The typed ``contents`` field of each datatype (FP16 and BF16 have none: raw only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def infer_body(request: pb.ModelInferRequest) -> tuple[bytes, int]:
    """The V2 binary body of ``request`` and the length of its JSON header."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "it needs one per input, in the order of the inputs"
        )
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for index, tensor in enumerate(request.inputs):
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInput(
                    f"input {tensor.name!r} has contents, and the request raw_input_contents; "
                    "send every input one way"
                )
            blob = raw[index]
        else:
            blob = _packed(tensor)
        parameters = json_parameters(tensor.parameters)
        parameters["binary_data_size"] = len(blob)
        inputs.append(
            {
                "name": tensor.name,
                "datatype": tensor.datatype,
                "shape": list(tensor.shape),
                "parameters": parameters,
            }
        )
        blobs.append(blob)
    header: dict[str, Any] = {}
    if request.id:
        header["id"] = request.id
    parameters = json_parameters(request.parameters)
    parameters["binary_data_output"] = True  # every output as raw_output_contents
    header["parameters"] = parameters
    header["inputs"] = inputs
    if request.outputs:
        outputs = []
        for output in request.outputs:
            asked = json_parameters(output.parameters)
            asked["binary_data"] = True
            outputs.append({"name": output.name, "parameters": asked})
        header["outputs"] = outputs
    text = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((text, *blobs)), len(text)


def infer_response(body: bytes | memoryview, header_length: int) -> pb.ModelInferResponse:
    """The ``ModelInferResponse`` of a V2 answer (``body``, whose first ``header_length``
    bytes are its JSON header, every output's data binary after it)."""
    header = json.loads(bytes(body[:header_length]))
    response = pb.ModelInferResponse(
        model_name=header["model_name"], model_version=header["model_version"]
    )
    if "id" in header:
        response.id = header["id"]
    view = memoryview(body)
    offset = header_length
    for output in header["outputs"]:
        parameters = output["parameters"]
        size = parameters["binary_data_size"]
        added = response.outputs.add(
            name=output["name"], datatype=output["datatype"], shape=output["shape"]
        )
        for key, value in parameters.items():
            if key != "binary_data_size":  # an output's own (an explanation's columns)
                _set_parameter(added.parameters[key], value)
        response.raw_output_contents.append(bytes(view[offset : offset + size]))
        offset += size
    return response


def _set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    """``value`` in its kind of ``InferParameter``: a list or an object as JSON text."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        parameter.string_param = json.dumps(value)


def json_parameters(
    parameters: Mapping[str, pb.InferParameter] | Mapping[str, pb.ModelRepositoryParameter],
) -> dict[str, Any]:
    """A ``parameters`` map of a message as the JSON object REST sends (``None`` for a
    parameter with no value)."""
    values: dict[str, Any] = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        values[key] = getattr(value, choice) if choice is not None else None
    return values


def _packed(tensor: pb.ModelInferRequest.InferInputTensor) -> bytes:
    """The raw bytes of an input sent as typed ``contents``."""
    datatype = tensor.datatype
    field = _CONTENTS.get(datatype)
    contents = tensor.contents
    if field is None:
        if datatype in NUMERIC or datatype == "BF16":
            raise InvalidInput(
                f"input {tensor.name!r} is {datatype}, which has no typed contents: send it "
                "in raw_input_contents"
            )
        return b""  # an unknown datatype: the backend says which ones are known
    values = getattr(contents, field)
    for other, _ in contents.ListFields():
        if other.name != field:
            raise InvalidInput(
                f"input {tensor.name!r} is {datatype}, but its contents are in {other.name}; "
                f"a {datatype} input's are in {field}"
            )
    if datatype == "BYTES":
        return b"".join(_BYTES_LENGTH.pack(len(item)) + item for item in values)
    try:
        return np.array(values, dtype=NUMERIC[datatype]).tobytes()
    except OverflowError:
        raise InvalidInput(
            f"input {tensor.name!r} has a value out of the range of {datatype}"
        ) from None
