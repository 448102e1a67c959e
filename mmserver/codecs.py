"""Request bodies to arrays, and predictions to response bodies.

A request travels to the model as a :data:`Request`, ``(body, media type, csv answer)``, made by
:func:`make_request` on the event loop: only the headers are looked at there. The body is decoded
where the model runs (a backend process): :func:`decode_as` turns it into the 2-D float64 array of
rows, and :func:`encode_as` turns one output per row into the answer's body. The frontend is one
process for every request of every model; the backends are as many as the cores, so parsing and
formatting bodies there keeps the frontend's time per request small.

Accepted bodies, by ``Content-Type`` (parameters such as ``charset`` are ignored; no
``Content-Type`` means JSON):

- ``application/json``: a 2-D array of numbers (rows), a 1-D array (one row), or an object whose
  ``inputs`` (or ``instances``) member holds either;
- ``text/csv``: one row per line, comma-separated, no header;
- ``application/x-npy``: a NumPy ``.npy`` array of integers or floats, 1-D or 2-D. The header is
  checked against the body's size before anything is allocated, and object arrays are refused:
  nothing is ever unpickled.

Every value must be a finite number. Anything else raises :class:`~mmserver.errors.InvalidInput`
with a message that says what was expected; an unknown content type raises
:class:`~mmserver.errors.UnsupportedMediaType`.

Responses are JSON ``{"predictions": [...]}`` unless ``Accept`` prefers ``text/csv`` (one line per
row). An ``Accept`` naming neither gets JSON.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmserver.errors import InvalidInput, ModelError, UnsupportedMediaType

JSON = "application/json"
CSV = "text/csv"
NPY = "application/x-npy"
SUPPORTED_TYPES = (JSON, CSV, NPY)

JSON_RESPONSE_TYPE = "application/json"
CSV_RESPONSE_TYPE = "text/csv; charset=utf-8"

_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 10_000
_SHAPE_HINT = "a 2-D array of numbers (one list per row) or a 1-D array (one row)"

# ------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------


def media_type(content_type: str | None) -> str:
    """The bare, lower-case media type of a ``Content-Type`` value (``JSON`` when absent)."""
    if not content_type:
        return JSON
    if content_type == JSON:  # the common case, without any string work
        return JSON
    return content_type.partition(";")[0].strip().lower() or JSON


#: A request on its way to a model: the body, its media type (one of ``SUPPORTED_TYPES``), and
#: whether the answer is CSV (else JSON). A plain tuple: it is pickled once per request.
Request = tuple[bytes, str, bool]


def make_request(body: bytes, content_type: str | None, accept: str | None) -> Request:
    """The :data:`Request` for ``body`` sent with these headers. Raises
    :class:`UnsupportedMediaType` for a content type not in ``SUPPORTED_TYPES``; the body itself
    is checked only when decoded."""
    kind = media_type(content_type)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedMediaType(
            f"content type {kind!r} is not supported; send one of {', '.join(SUPPORTED_TYPES)}"
        )
    return (body, kind, wants_csv(accept))


def decode_as(body: bytes, kind: str) -> np.ndarray:
    """Decode a request body of media type ``kind`` (one of ``SUPPORTED_TYPES``, as
    :func:`make_request` checked) into a C-contiguous 2-D float64 array, one row per input.

    Raises :class:`InvalidInput` for a body that is empty, malformed, ragged, non-numeric or
    non-finite.
    """
    if kind == JSON:
        return _decode_json(body)
    if kind == CSV:
        return _decode_csv(body)
    return _decode_npy(body)


def _decode_json(body: bytes) -> np.ndarray:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        if not body.strip():  # only now: a valid body is not copied to be checked for this
            raise InvalidInput(f"the request body is empty; expected JSON: {_SHAPE_HINT}") from None
        raise InvalidInput(
            f"the body is not valid JSON ({short(exc)}); expected {_SHAPE_HINT}"
        ) from None
    if isinstance(data, dict):
        for key in ("inputs", "instances"):
            if key in data:
                data = data[key]
                break
        else:
            raise InvalidInput(
                "a JSON object body needs an 'inputs' or 'instances' member holding " + _SHAPE_HINT
            )
    if not isinstance(data, list):
        raise InvalidInput(f"expected {_SHAPE_HINT}, got a JSON {json_kind(data)}")
    # Fast path: numpy infers the shape and dtype in C. It turns JSON booleans into numbers
    # silently, so a body that may hold one is checked value by value first.
    if (
        b"true" in body
        or b"false" in body
        or body[:2] in (b"\xff\xfe", b"\xfe\xff")
        or (
            len(body) > 1 and 0 in body[:2]  # UTF-16 or UTF-32 without a BOM
        )
    ):
        _check_json_rows(data)
    try:
        array = np.array(data)
    except (ValueError, TypeError, RecursionError):
        _check_json_rows(data)
        raise InvalidInput(f"expected {_SHAPE_HINT}") from None
    if array.dtype.kind not in "iuf":
        # Strings, booleans, nulls, objects, or integers too large for int64.
        _check_json_rows(data)
        try:
            array = np.array(data, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            raise InvalidInput(f"expected {_SHAPE_HINT}") from None
    return _as_rows(array)


def _check_json_rows(data: list[Any]) -> None:
    """Raise :class:`InvalidInput` naming the first value or row that is not as expected."""
    if data and isinstance(data[0], list):
        width = len(data[0])
        for i, row in enumerate(data):
            if not isinstance(row, list):
                raise InvalidInput(
                    f"row {i} is a JSON {json_kind(row)}; expected every row to be a list "
                    "of numbers"
                )
            if len(row) != width:
                raise InvalidInput(
                    f"rows have different lengths: row 0 has {width} values, row {i} has "
                    f"{len(row)}; every row needs the same number of features"
                )
            for j, value in enumerate(row):
                _check_number(value, f"row {i}, column {j}")
    else:
        for j, value in enumerate(data):
            _check_number(value, f"position {j}")


def _check_number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(
            f"value at {where} is a JSON {json_kind(value)} ({preview(value)}); expected a number"
        )


def _decode_csv(body: bytes) -> np.ndarray:
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidInput("the CSV body is not valid UTF-8 text") from None
    try:
        # Blank lines (a trailing newline, say) are skipped; a line of empty cells is not.
        rows = [
            row
            for row in csv.reader(io.StringIO(text), strict=True)
            if len(row) > 1 or _filled(row)
        ]
    except csv.Error as exc:
        raise InvalidInput(f"the body is not valid CSV ({exc})") from None
    if not rows:
        raise InvalidInput("the request body is empty; expected CSV: one row of numbers per line")
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width:
            raise InvalidInput(
                f"CSV rows have different lengths: line 1 has {width} values, line {i + 1} "
                f"has {len(row)}; every row needs the same number of features"
            )
    try:
        array = np.array(rows, dtype=np.float64)
    except ValueError:
        for i, row in enumerate(rows):
            for j, cell in enumerate(row):
                try:
                    float(cell)
                except ValueError:
                    raise InvalidInput(
                        f"CSV value {preview(cell)} at line {i + 1}, column {j + 1} is not a "
                        "number; expected numbers only, with no header line"
                    ) from None
        raise InvalidInput("expected CSV of numbers, one row per line") from None
    return _as_rows(array)


def _filled(row: list[str]) -> bool:
    return bool(row) and bool(row[0].strip())


def _decode_npy(body: bytes) -> np.ndarray:
    if not body:
        raise InvalidInput("the request body is empty; expected a .npy array")
    if not body.startswith(_NPY_MAGIC):
        raise InvalidInput(
            "the body is not a .npy array (it does not start with the NumPy magic bytes); "
            "write it with numpy.save"
        )
    fmt = np.lib.format
    stream = io.BytesIO(body)
    try:
        version = fmt.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = fmt.read_array_header_1_0(
                stream, max_header_size=_NPY_MAX_HEADER
            )
        elif version == (2, 0):
            shape, fortran_order, dtype = fmt.read_array_header_2_0(
                stream, max_header_size=_NPY_MAX_HEADER
            )
        else:
            raise InvalidInput(f".npy format version {version} is not supported; use 1.0 or 2.0")
    except InvalidInput:
        raise
    except Exception as exc:  # numpy's header parser raises many types on untrusted input
        raise InvalidInput(f"the .npy header is invalid ({short(exc)})") from None
    if dtype.hasobject or dtype.kind not in "iuf":
        raise InvalidInput(f".npy array has dtype {dtype.str!r}; expected integers or floats")
    # numpy's header parser takes any integers as the shape; reshape would read a negative one
    # as "infer this dimension".
    if any(dim < 0 for dim in shape):
        raise InvalidInput(f".npy array has shape {shape}; dimensions must not be negative")
    count = math.prod(shape)
    offset = stream.tell()
    if len(body) - offset != count * dtype.itemsize:
        raise InvalidInput(
            f".npy array of shape {shape} and dtype {dtype.str!r} needs "
            f"{count * dtype.itemsize} bytes of data, the body has {len(body) - offset}"
        )
    flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    try:
        # A copy: float64, C order, and independent of the request body's buffer.
        array = flat.reshape(shape, order="F" if fortran_order else "C").astype(
            np.float64, order="C"
        )
    except ValueError as exc:  # an empty array whose other dimensions overflow numpy's index
        raise InvalidInput(f".npy array of shape {shape} cannot be made ({short(exc)})") from None
    return _as_rows(array)


def _as_rows(array: np.ndarray) -> np.ndarray:
    """Check shape and values; return the rows as a C-contiguous float64 array."""
    if array.ndim == 1:
        if array.shape[0] == 0:
            raise InvalidInput(f"the input is empty; expected {_SHAPE_HINT}")
        array = array.reshape(1, -1)
    elif array.ndim != 2:
        raise InvalidInput(f"expected {_SHAPE_HINT}, got a {array.ndim}-D array")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InvalidInput(f"the input has no values (shape {array.shape}); expected {_SHAPE_HINT}")
    if array.dtype != np.float64 or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, dtype=np.float64)
    check_finite(array)
    return array


def check_finite(array: np.ndarray, where: str = "") -> None:
    """Raise :class:`InvalidInput` naming the first NaN or infinity of the 2-D ``array`` (its
    message starts with ``where``)."""
    finite = np.isfinite(array)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        raise InvalidInput(
            f"{where}value {float(array[i, j])!r} at row {i}, column {j} is not finite; "
            "expected finite numbers (no NaN or infinity)"
        )


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def preview(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(exc: BaseException, limit: int = 120) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------------


def wants_csv(accept: str | None) -> bool:
    """Whether an ``Accept`` value prefers CSV to JSON: the higher q-value wins, then the type
    listed first. Types naming neither are ignored; with no preference the answer is JSON."""
    if not accept or accept == JSON or accept == "*/*":
        return False
    if accept == CSV:
        return True
    best: tuple[float, int] = (0.0, 0)
    choice_csv = False
    for position, part in enumerate(accept.split(",")):
        kind, _, params = part.partition(";")
        kind = kind.strip().lower()
        if kind in (CSV, "text/*"):
            is_csv = True
        elif kind in (JSON, "application/*", "*/*"):
            is_csv = False
        else:
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        rank = (q, -position)
        if q > 0 and (best[0] == 0 or rank > best):
            best, choice_csv = rank, is_csv
    return choice_csv


def response_type(csv_answer: bool) -> str:
    """The ``Content-Type`` of an answer encoded by :func:`encode_as`."""
    return CSV_RESPONSE_TYPE if csv_answer else JSON_RESPONSE_TYPE


def encode_as(outputs: np.ndarray | Sequence[Any], csv_answer: bool) -> bytes:
    """Encode one output per row as an answer's body: CSV if ``csv_answer`` (the request's
    ``Accept`` preferred it, :func:`wants_csv`), else JSON; its type is :func:`response_type`.

    Outputs may be an array (any numeric dtype, 1-D or 2-D) or a list whose items are numbers,
    strings, lists or dicts (a custom handler's results). Non-finite floats become JSON ``null``
    so the body stays valid JSON; in CSV a dict row is written as its values and a nested list
    or dict as one JSON-encoded cell. Raises :class:`ModelError` for an output that has no JSON
    form.
    """
    values = outputs.tolist() if isinstance(outputs, np.ndarray) else outputs
    try:
        if csv_answer:
            return _encode_csv(values)
        try:
            text = _ENCODER.encode({"predictions": values})
        except ValueError:  # NaN or infinity somewhere
            text = _ENCODER.encode({"predictions": _finite(values)})
    except TypeError as exc:
        raise ModelError(f"the model's output cannot be encoded: {exc}") from None
    return text.encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"prediction value of type {type(value).__name__} cannot be sent as JSON")


# Built once: json.dumps with keyword arguments builds a new encoder on every call.
_ENCODER = json.JSONEncoder(allow_nan=False, default=_json_default)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.ndarray | np.generic):
        return _finite(value.tolist())
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def _encode_csv(values: Sequence[Any]) -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in values:
        if isinstance(row, np.ndarray | np.generic):
            row = row.tolist()
        if isinstance(row, dict):
            writer.writerow(_csv_cell(v) for v in row.values())
        elif isinstance(row, list | tuple):
            writer.writerow(_csv_cell(v) for v in row)
        else:
            writer.writerow((_csv_cell(row),))
    return buffer.getvalue().encode()


def _csv_cell(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=_json_default)
    return value
