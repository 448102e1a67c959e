"""The Open Inference Protocol (KServe V2): what its requests and answers share.

A V2 request is decoded where the model runs (a backend process), as the other protocols' are
(:mod:`mmserver.codecs.requests`): the frontend only checks the
``Inference-Header-Content-Length`` header (:func:`v2_request`) and queues the body as it came.
There :func:`~mmserver.codecs.v2_requests.decode_v2` turns the body into an
:class:`InferRequest` (the rows, the id, the outputs asked for), and
:func:`~mmserver.codecs.v2_answers.encode_v2` turns the model's outputs into the answer.

This module holds their common terms: the datatypes and their binary layout (:data:`NUMERIC`),
the kind of a V2 request, a decoded request, and the ``parameters`` object every part of a body
may carry (:func:`parameters_of`).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserver.codecs.requests import Request
from mmserver.codecs.tabular import Table, json_kind
from mmserver.errors import InvalidInput

#: The kind (see :data:`mmserver.codecs.requests.Request`) of a V2 request with a JSON body; with
#: binary data the kind is ``"v2:<length of the JSON header>"``.
V2 = "v2"
HEADER_LENGTH = "Inference-Header-Content-Length"
#: Every model has one version.
VERSION = "1"

#: Numeric datatypes and how their binary data is laid out.
NUMERIC: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPES = (*NUMERIC, "BYTES", "BF16")
#: A BYTES item's length before its bytes, in binary data.
BYTES_LENGTH = struct.Struct("<I")


def v2_request(body: bytes, header_length: str | None) -> Request:
    """The :data:`Request` for a V2 body sent with this ``Inference-Header-Content-Length``
    (``None`` when absent: the whole body is JSON). Raises :class:`InvalidInput` for a value
    that is not a length within the body."""
    if header_length is None:
        return (body, V2, False)
    text = header_length.strip()
    if not text.isdigit() or not text.isascii():
        raise InvalidInput(
            f"{HEADER_LENGTH} is {header_length[:40]!r}; expected the length in bytes of the "
            "JSON header at the start of the body"
        )
    length = int(text)
    if length > len(body):
        raise InvalidInput(
            f"{HEADER_LENGTH} is {length} but the body has only {len(body)} bytes; it must be "
            "the length of the JSON header at the start of the body"
        )
    return (body, f"{V2}:{length}", False)


def is_v2(kind: str) -> bool:
    """Whether a request of this kind is a V2 request (:func:`v2_request`)."""
    return kind.startswith(V2)


@dataclass(slots=True)
class InferRequest:
    """A decoded V2 request: its rows, its id, and the outputs to answer, in order, with
    whether each goes as binary data."""

    id: str | None
    rows: np.ndarray | Table
    outputs: list[str]
    binary: list[bool]


def parameters_of(
    obj: Mapping[str, Any], where: str, *, allow_null: bool = True
) -> Mapping[str, Any]:
    """The ``parameters`` object of ``obj`` (a request, a tensor, a requested output, a
    repository call's parameters), ``{}`` when it has none; ``where`` names ``obj`` in the
    error when they are not an object. A JSON null counts as none, unless ``allow_null`` is
    false (the repository calls refuse it)."""
    parameters = obj.get("parameters")
    if parameters is None and (allow_null or "parameters" not in obj):
        return {}
    if not isinstance(parameters, dict):
        raise InvalidInput(
            f"{where}: 'parameters' is a JSON {json_kind(parameters)}; expected an object"
        )
    return parameters


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The V2 datatype of values of ``dtype``: BYTES for strings and objects."""
    return _DATATYPE_OF.get((dtype.kind, dtype.itemsize), "BYTES")


_DATATYPE_OF = {(dtype.kind, dtype.itemsize): name for name, dtype in NUMERIC.items()}
