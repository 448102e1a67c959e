"""Open Inference Protocol (KServe V2) request bodies to rows (:func:`decode_v2`), run where the
model runs; the terms it shares with the answers are in :mod:`mmserver.codecs.v2`.

Inputs: each tensor has a ``name``, a ``shape``, a ``datatype`` and its values, as JSON
``data`` (flat or nested, row-major) or, with Triton's binary tensor data extension, as
``parameters.binary_data_size`` bytes after the JSON header (little-endian, row-major; a BOOL is
one byte; BYTES items each a 4-byte little-endian length and the bytes). Numeric datatypes (BOOL,
INT8..INT64, UINT8..UINT64, FP16, FP32, FP64) are read as the declared datatype, then as float64;
a JSON ``null`` is a missing value. A tensor of shape ``[n, k]`` is ``n`` rows of ``k``
features, one of shape ``[n]`` (or ``[n, 1]``) is ``n`` rows of one feature; several inputs are
placed side by side, in order, as columns of the same rows. For a model with named columns
(:mod:`mmserver.codecs.schema`), inputs named after its columns are its columns, in any order, as
MLServer's pandas codec sends a DataFrame: one input per column, ``BYTES`` for strings.

Outputs asked for: the outputs a model has are named after the estimator's methods
(``predict``, ``predict_proba``, ``decision_function``, ``transform``), the one
``option.method`` names first; with no ``outputs`` in the request, that one is answered. A
custom handler has one output, ``predict``. An output goes as binary data when the request asks
(``binary_data`` on the output, or ``binary_data_output`` on the request).

Anything else raises :class:`~mmserver.errors.InvalidInput` saying what was expected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from mmserver.codecs.explanations import ATTRIBUTIONS
from mmserver.codecs.requests import STRICT, check_finite, preview, short
from mmserver.codecs.schema import Inputs
from mmserver.codecs.tabular import Table, dense, json_kind, table, to_columns
from mmserver.codecs.v2 import (
    BYTES_LENGTH,
    DATATYPES,
    HEADER_LENGTH,
    NUMERIC,
    InferRequest,
    parameters_of,
)
from mmserver.errors import InvalidInput

#: Float datatypes narrower than a JSON number: a value beyond their range would become
#: infinite.
_NARROW_FLOATS = frozenset({"FP16", "FP32"})

_TENSOR_HINT = "an object with name, shape, datatype and data"


def decode_v2(
    body: bytes,
    kind: str,
    available: Sequence[str],
    inputs: Inputs = STRICT,
    model: str = "the model",
) -> InferRequest:
    """Decode a V2 request of ``kind`` for a model whose outputs are ``available`` (the first
    is the default) and that takes ``inputs``. Raises :class:`InvalidInput` saying what is
    wrong."""
    _, _, length = kind.partition(":")
    header_length = int(length) if length else len(body)
    try:
        data = json.loads(body[:header_length])
    except (ValueError, RecursionError) as exc:
        where = f"the first {header_length} bytes ({HEADER_LENGTH})" if length else "the body"
        raise InvalidInput(
            f"{where} must be the JSON inference request; it is not valid JSON ({short(exc)})"
        ) from None
    if not isinstance(data, dict):
        raise InvalidInput(
            f"the inference request is a JSON {json_kind(data)}; expected an object with "
            "'inputs', a list of tensors"
        )
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput(f"'id' is a JSON {json_kind(request_id)}; expected a string")
    parameters = parameters_of(data, "the request")
    binary_default = _flag(parameters, "binary_data_output", "the request", default=False)
    tensors = data.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidInput("the inference request needs 'inputs', a non-empty list of tensors")
    binary = memoryview(body)[header_length:]
    offset = 0
    columns: list[tuple[str, np.ndarray]] = []
    # A JSON true or false among numbers would become 1 or 0: looked for only when the text
    # has one (JSON's literals are ASCII in every encoding json.loads reads but UTF-16/32).
    head = body[:header_length]
    strings = inputs.frame and not inputs.dense  # a model with string or category columns
    booleans = b"true" in head or b"false" in head or head[:2] in (b"\xff\xfe", b"\xfe\xff")
    for index, tensor in enumerate(tensors):
        name, array, offset = _input(tensor, index, binary, offset, booleans, strings)
        if columns and any(name == seen for seen, _ in columns):
            raise InvalidInput(f"two inputs are named {name!r}; input names must be unique")
        columns.append((name, array))
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary)} bytes of binary data follow the JSON header, but the inputs' "
            f"binary_data_size add up to {offset}"
        )
    outputs, binary_outputs = _outputs(data.get("outputs"), available, binary_default)
    if _flag(parameters, "explain", "the request", default=False):
        # The model's explanation of these rows: as JSON, unless every output goes as binary
        # data (gRPC's answers, whose tensors are all raw).
        outputs.append(ATTRIBUTIONS)
        binary_outputs.append(binary_default)
    return InferRequest(request_id, _rows(columns, inputs, model), outputs, binary_outputs)


def _input(
    tensor: Any,
    index: int,
    binary: memoryview,
    offset: int,
    booleans: bool = True,
    strings: bool = False,
) -> tuple[str, np.ndarray, int]:
    """One input tensor: its name, its values as float64 in its shape (strings in an object
    array for BYTES, which only a model that takes strings, ``strings``, is sent), and the
    offset of the next input's binary data."""
    if not isinstance(tensor, dict):
        raise InvalidInput(f"input {index} is a JSON {json_kind(tensor)}; expected {_TENSOR_HINT}")
    name = tensor.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"input {index} needs a 'name' string; expected {_TENSOR_HINT}")
    where = f"input {preview(name)}"
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and all(type(dim) is int and dim >= 0 for dim in shape)):
        raise InvalidInput(f"{where} needs 'shape', a list of non-negative integers")
    datatype = tensor.get("datatype")
    if not isinstance(datatype, str) or (
        datatype not in NUMERIC and (datatype != "BYTES" or not strings)
    ):
        if datatype in DATATYPES:
            raise InvalidInput(
                f"{where} has datatype {datatype}; the model takes numbers: send one of "
                f"{', '.join(NUMERIC)}"
            )
        raise InvalidInput(
            f"{where} has datatype {preview(datatype)}; expected one of {', '.join(DATATYPES)}"
        )
    parameters = parameters_of(tensor, where)
    for key in parameters:
        if key.startswith("shared_memory"):
            raise InvalidInput(
                f"{where} names a shared memory region; the shared memory extension is not "
                "supported: send the values as data or as binary data"
            )
    count = math.prod(shape)
    if datatype == "BYTES":
        texts, offset = _strings(tensor, parameters, count, binary, offset, where)
        return name, texts.reshape(shape), offset
    dtype = NUMERIC[datatype]
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise InvalidInput(f"{where}: binary_data_size must be a non-negative integer")
        if "data" in tensor:
            raise InvalidInput(f"{where} has both 'data' and binary_data_size; send one of them")
        if size != count * dtype.itemsize:
            raise InvalidInput(
                f"{where} of shape {shape} and datatype {datatype} needs "
                f"{count * dtype.itemsize} bytes of binary data; its binary_data_size is {size}"
            )
        if offset + size > len(binary):
            raise InvalidInput(
                f"{where} needs {size} bytes of binary data from byte {offset} after the JSON "
                f"header, but only {len(binary)} bytes follow the header"
            )
        array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
        if datatype == "BOOL" and bool((array.view(np.uint8) > 1).any()):
            raise InvalidInput(f"{where} is BOOL; its binary data must be bytes 0 or 1")
        offset += size
    elif "data" in tensor:
        array = _json_data(tensor["data"], datatype, shape, where, booleans)
    else:
        raise InvalidInput(
            f"{where} has no 'data' (nor parameters.binary_data_size for binary data)"
        )
    try:
        return name, array.astype(np.float64, copy=False).reshape(shape), offset
    except ValueError:  # a dimension past what an array can have, e.g. [0, 2**70]
        raise InvalidInput(f"{where} has shape {preview(shape)}, beyond any array") from None


def _strings(
    tensor: Mapping[str, Any],
    parameters: Mapping[str, Any],
    count: int,
    binary: memoryview,
    offset: int,
    where: str,
) -> tuple[np.ndarray, int]:
    """A BYTES tensor's items as an object array of strings (``None`` for a JSON null), and the
    offset of the next input's binary data. The shape's count is checked against the data before
    anything is allocated."""
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size must be a non-negative integer within the "
                f"{len(binary)} bytes after the JSON header"
            )
        if count > size // 4:  # each item takes at least its 4-byte length
            raise InvalidInput(
                f"{where} has {count} item(s) by its shape, more than its {size} bytes of "
                "binary data can hold"
            )
        out = np.empty(count, dtype=object)
        end, at = offset + size, offset
        for i in range(count):
            if at + 4 > end:
                raise InvalidInput(f"{where}: its binary data holds fewer than {count} items")
            (length,) = BYTES_LENGTH.unpack_from(binary, at)
            if at + 4 + length > end:
                raise InvalidInput(f"{where}: item {i} runs past its binary data")
            out[i] = _text(bytes(binary[at + 4 : at + 4 + length]), where, i)
            at += 4 + length
        if at != end:
            raise InvalidInput(f"{where}: its binary data holds more than {count} items")
        return out, end
    if "data" not in tensor:
        raise InvalidInput(f"{where} has no 'data' (nor parameters.binary_data_size)")
    data = tensor["data"]
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: 'data' is a JSON {json_kind(data)}; expected an array")
    items = list(_leaves(data))
    if len(items) != count:
        raise InvalidInput(
            f"{where} has {count} value(s) by its shape, but its data has {len(items)}"
        )
    out = np.empty(count, dtype=object)
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, str):
            raise InvalidInput(
                f"{where} is BYTES; item {i} is a JSON {json_kind(item)} ({preview(item)}); "
                "expected strings (or null for a missing value)"
            )
        out[i] = item
    return out, offset


def _text(data: bytes, where: str, index: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{where}: item {index} is not UTF-8 text") from None


def _json_data(
    data: Any, datatype: str, shape: list[int], where: str, booleans: bool = True
) -> np.ndarray:
    """JSON tensor data (flat or nested) as an array of ``datatype``; ``booleans``: whether
    the data may hold a JSON true or false (which only a BOOL tensor takes)."""
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: 'data' is a JSON {json_kind(data)}; expected an array")
    try:
        array = np.array(data)
    except (ValueError, TypeError, RecursionError):
        raise InvalidInput(
            f"{where}: 'data' is not a regular array (nested lists of different lengths?)"
        ) from None
    count = math.prod(shape)
    if array.size != count:
        raise InvalidInput(
            f"{where} has shape {shape}, {count} value(s), but its data has {array.size}"
        )
    kind = array.dtype.kind
    if count and kind not in "biuf":
        bad = next((v for v in _leaves(data) if not _is_number(v)), _END)
        if (
            bad is None
            and datatype != "BOOL"
            and all(v is None or (_is_number(v) and type(v) is not bool) for v in _leaves(data))
        ):
            # A null is a missing value: NaN, refused later where the model takes none.
            return np.array(data, dtype=np.float64)
        if bad is _END:  # numbers, but an integer beyond 64 bits
            raise InvalidInput(f"{where}: an integer is beyond 64 bits; datatype {datatype}")
        raise InvalidInput(
            f"{where}: value {preview(bad)} is not a number; datatype {datatype} takes "
            + ("true or false" if datatype == "BOOL" else "numbers")
        )
    if datatype == "BOOL":
        if count and kind != "b":
            raise InvalidInput(f"{where} is BOOL; its data must be true or false")
    elif count and booleans and (kind == "b" or any(type(v) is bool for v in _leaves(data))):
        raise InvalidInput(
            f"{where} is {datatype}; its data holds a JSON true or false where numbers are expected"
        )
    elif datatype[0] in "IU":
        info = np.iinfo(NUMERIC[datatype])
        if kind == "f" or (count and (array.min() < info.min or array.max() > info.max)):
            raise InvalidInput(
                f"{where} is {datatype}; its data must be integers from {info.min} to {info.max}"
            )
    elif datatype in _NARROW_FLOATS and count:
        with np.errstate(over="ignore"):
            narrowed = array.astype(NUMERIC[datatype])
        infinite = np.isinf(narrowed)
        if infinite.any():  # rare: only then is the culprit looked for
            overflowed = infinite & np.isfinite(array)
            if overflowed.any():
                value = array.flat[int(np.argmax(overflowed))].item()
                largest = float(np.finfo(NUMERIC[datatype]).max)
                raise InvalidInput(
                    f"{where}: value {value!r} is beyond the range of {datatype} "
                    f"(±{largest:g}); send it as FP64"
                )
        return narrowed
    return array.astype(NUMERIC[datatype], copy=False)


def _leaves(data: list[Any]) -> Iterator[Any]:
    """The values of nested lists, depth first (without recursion: JSON may nest deeply)."""
    stack = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            yield item


_END = object()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float)


def _rows(columns: list[tuple[str, np.ndarray]], inputs: Inputs, model: str) -> np.ndarray | Table:
    """The inputs as the model takes them: its named columns when every input is named after
    one of them, else side by side, one row per first dimension (a C-contiguous float64 matrix
    of finite numbers, NaN where the model takes missing values)."""
    names = set(inputs.names)
    if inputs.frame and all(name in names for name, _ in columns):
        return _named(columns, inputs, model)
    if inputs.frame and not inputs.dense:
        stray = next(name for name, _ in columns if name not in names)
        raise InvalidInput(
            f"input {preview(stray)} is not one of {model}'s columns; it takes one input per "
            f"column, named {', '.join(inputs.names)}"
        )
    parts: list[np.ndarray] = []
    first, count = "", 0
    for name, array in columns:
        if array.ndim not in (1, 2):
            raise InvalidInput(
                f"input {preview(name)} has shape {list(array.shape)}; expected [rows] (one "
                "feature) or [rows, features]"
            )
        if not parts:
            first, count = name, len(array)
        elif len(array) != count:
            raise InvalidInput(
                f"inputs have different numbers of rows: {preview(first)} has {count}, "
                f"{preview(name)} has {len(array)}; each input is one or more columns of the "
                "same rows"
            )
        if array.dtype.kind == "O":
            raise InvalidInput(
                f"input {preview(name)} is BYTES; {model} takes numbers"
                + (
                    f" unless inputs are named after its columns ({', '.join(inputs.names)})"
                    if inputs.frame
                    else ""
                )
            )
        parts.append(array.reshape(-1, 1) if array.ndim == 1 else array)
    rows = parts[0] if len(parts) == 1 else np.hstack(parts)
    if rows.size == 0:
        raise InvalidInput("the inputs hold no values; expected at least one row of features")
    if not np.isfinite(rows).all():
        for (name, _), part in zip(columns, parts, strict=True):
            check_finite(part, f"input {preview(name)}: ", inputs.missing)
    return np.ascontiguousarray(rows, dtype=np.float64)


def _named(columns: list[tuple[str, np.ndarray]], inputs: Inputs, model: str) -> np.ndarray | Table:
    """One input per column (MLServer's pandas codec): each of shape [rows] or [rows, 1]."""
    lists: list[list[Any]] = []
    for name, array in columns:
        if array.ndim == 2 and array.shape[1] == 1:
            array = array.reshape(-1)
        if array.ndim != 1:
            raise InvalidInput(
                f"input {preview(name)} has shape {list(array.shape)}; a column is [rows] or "
                "[rows, 1]"
            )
        values = array.tolist()
        if array.dtype.kind == "f":  # NaN: a missing value, as null is
            values = [None if v != v else v for v in values]
        lists.append(values)
    values, rows = to_columns(("columns", [n for n, _ in columns], lists), inputs, model)
    if rows == 0:
        raise InvalidInput("the inputs hold no values; expected at least one row")
    return dense(values, rows, inputs) if inputs.dense else table(values, rows, inputs)


def _outputs(
    requested: Any, available: Sequence[str], binary_default: bool
) -> tuple[list[str], list[bool]]:
    if requested is None or requested == []:
        return [available[0]], [binary_default]
    if not isinstance(requested, list):
        raise InvalidInput(
            f"'outputs' is a JSON {json_kind(requested)}; expected a list of objects with a name"
        )
    names: list[str] = []
    binary: list[bool] = []
    for index, output in enumerate(requested):
        name = output.get("name") if isinstance(output, dict) else None
        if not isinstance(name, str):
            raise InvalidInput(f"output {index} needs a 'name' string")
        where = f"output {preview(name)}"
        if name not in available:
            raise InvalidInput(
                f"the model has no output {preview(name)}; its outputs are {', '.join(available)}"
            )
        if name in names:
            raise InvalidInput(f"{where} is asked for twice")
        parameters = parameters_of(output, where)
        if "classification" in parameters:
            raise InvalidInput(
                f"{where}: the classification extension is not supported; ask for "
                "predict_proba for the classes' probabilities"
            )
        names.append(name)
        binary.append(_flag(parameters, "binary_data", where, default=binary_default))
    return names, binary


def _flag(parameters: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"{where}: parameter {key} is {preview(value)}; expected true or false")
    return value
