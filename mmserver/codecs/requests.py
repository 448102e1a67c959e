"""Request bodies to a model's inputs.

A request travels to the model as a :data:`Request`, ``(body, content type, csv answer)``, made
by :func:`make_request` on the event loop: only the headers are looked at there. The body is
decoded where the model runs (a backend process): :func:`decode_as` turns it into what the model
takes (:mod:`mmserver.codecs.schema`) — the 2-D float64 matrix of rows for a model fitted on arrays
or on
numbers only, a :class:`~mmserver.codecs.tabular.Table` of typed columns for a model fitted on a
DataFrame with string, boolean or category columns — and :mod:`mmserver.codecs.answers` encodes the
answers there too. The frontend is one process for every request of every model; the
backends are as many as the cores, so parsing and formatting bodies there keeps the frontend's
time per request small.

Accepted bodies, by ``Content-Type`` (no ``Content-Type`` means JSON):

- ``application/json``: rows (a 2-D array, or a 1-D array for one row); records (an array of
  objects, column: value); MLflow's ``{"dataframe_split": {"columns": [...], "data": [...]}}``
  and ``{"dataframe_records": [...]}``; ``{"instances": ...}`` (KServe V1) and ``{"inputs": ...}``
  (TF Serving) holding rows, records or an object of one list per column; for a model with named
  columns, one object is one record;
- ``text/csv``: one row per line, comma-separated, quoted fields as RFC 4180 has them; a header
  line of column names when the type says ``header=present`` (or the model's
  ``option.csv_header`` does); an empty field is a missing value;
- ``text/libsvm`` (and ``text/x-libsvm``): one row per line, ``label index:value ...`` with
  0-based indices (the label is ignored); an index not given is a missing value for XGBoost and
  LightGBM models, as the SageMaker XGBoost container reads it, and 0 for others, as
  scikit-learn's ``load_svmlight_file`` reads it;
- ``application/x-npy``: a NumPy ``.npy`` array of integers or floats, 1-D or 2-D. The header is
  checked against the body's size before anything is allocated, and object arrays are refused:
  nothing is ever unpickled.

Values are numbers, strings, booleans or ``null``; ``null``, ``NaN`` and an empty CSV field are
missing values, which a model takes unless it fails on them (found at load) or its
``option.missing_values=refuse`` says so; an infinity is never one. Anything else raises
:class:`~mmserver.errors.InvalidInput` with a message that says what was expected (naming the
column and row); an unknown content type raises :class:`~mmserver.errors.UnsupportedMediaType`.

Answers are made by :mod:`mmserver.codecs.answers`.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

import numpy as np

from mmserver.codecs.answers import wants_csv
from mmserver.codecs.schema import Inputs
from mmserver.codecs.tabular import Form, Table, csv_cells, dense, json_kind, table, to_columns
from mmserver.errors import InvalidInput, UnsupportedMediaType

JSON = "application/json"
CSV = "text/csv"
NPY = "application/x-npy"
LIBSVM = "text/libsvm"
X_LIBSVM = "text/x-libsvm"
SUPPORTED_TYPES = (JSON, CSV, NPY, LIBSVM, X_LIBSVM)


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


#: A request on its way to a model: the body, its ``Content-Type`` as sent (a media type of
#: ``SUPPORTED_TYPES`` and its parameters; ``""`` when there was none), and whether the answer
#: is CSV (else JSON; ``None``: the client said neither, no ``Accept`` or ``*/*``: JSON, or what
#: the model answers by default). A plain tuple: it is pickled once per request.
Request = tuple[bytes, str, bool | None]


def make_request(body: bytes, content_type: str | None, accept: str | None) -> Request:
    """The :data:`Request` for ``body`` sent with these headers. Raises
    :class:`UnsupportedMediaType` for a content type not in ``SUPPORTED_TYPES``; the body itself
    is checked only when decoded."""
    kind = media_type(content_type)
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedMediaType(
            f"content type {kind!r} is not supported; send one of {', '.join(SUPPORTED_TYPES)}"
        )
    preference = None if not accept or accept == "*/*" else wants_csv(accept)
    return (body, content_type or "", preference)


def sagemaker_container_kind(kind: str) -> bool:
    """Whether a body sent as ``kind`` is one SageMaker's XGBoost container reads (CSV, libsvm,
    or no ``Content-Type``): a model read as the container is answered as the container answers
    it; a JSON or ``.npy`` body, which the container refuses, is answered as mmserver answers."""
    return not kind or media_type(kind) in (CSV, LIBSVM, X_LIBSVM)


def has_header(content_type: str) -> bool:
    """Whether a CSV ``Content-Type`` says its first line names the columns
    (``header=present``, the parameter registered for ``text/csv``)."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "header":
            return value.strip().strip('"').lower() == "present"
    return False


#: The inputs of a model that says nothing of them: numbers, no missing values.
STRICT = Inputs(missing=False)


def decode_as(
    body: bytes,
    kind: str,
    inputs: Inputs = STRICT,
    model: str = "the model",
) -> np.ndarray | Table:
    """Decode a request body sent as ``kind`` (its ``Content-Type``, as :func:`make_request`
    checked) into what a model with these ``inputs`` takes: a C-contiguous 2-D float64 array, one
    row per input, or a :class:`Table` when the model takes columns of other kinds than numbers.

    Raises :class:`InvalidInput` for a body that is empty, malformed, ragged, of the wrong kinds,
    with unknown or lacking columns, or with missing values where the model takes none.
    """
    media = media_type(kind) if kind or not inputs.sagemaker_xgboost else CSV
    if media == JSON:
        return _decode_json(body, inputs, model)
    if media == CSV:
        return _decode_csv(body, inputs, model, inputs.csv_header or has_header(kind))
    if media in (LIBSVM, X_LIBSVM):
        return _decode_libsvm(body, inputs, model)
    if not inputs.dense:
        raise InvalidInput(_NOT_NUMBERS.format(model=model, kind=".npy arrays"))
    return _as_rows(_decode_npy(body), inputs)


_NOT_NUMBERS = (
    "{model} takes named columns that are not all numbers: {kind} cannot hold them; send "
    "JSON (records, rows or dataframe_split) or CSV"
)


def _decode_json(body: bytes, inputs: Inputs, model: str) -> np.ndarray | Table:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        if not body.strip():  # only now: a valid body is not copied to be checked for this
            raise InvalidInput(f"the request body is empty; expected JSON: {_SHAPE_HINT}") from None
        raise InvalidInput(
            f"the body is not valid JSON ({short(exc)}); expected {_SHAPE_HINT}"
        ) from None
    form = _json_form(data, inputs, model)
    if form[0] != "rows" or form[1] is not None or not inputs.dense:
        return _from_form(form, inputs, model)
    data = form[2]
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
        _check_json_rows(data, inputs.missing)
    try:
        array = np.array(data)
    except (ValueError, TypeError, RecursionError):
        _check_json_rows(data, inputs.missing)
        raise InvalidInput(f"expected {_SHAPE_HINT}") from None
    if array.dtype.kind not in "iuf":
        # Strings, booleans, nulls, objects, or integers too large for int64.
        _check_json_rows(data, inputs.missing)
        try:
            array = np.array(data, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            raise InvalidInput(f"expected {_SHAPE_HINT}") from None
    return _as_rows(array, inputs)


def _json_form(data: Any, inputs: Inputs, model: str) -> Form:
    """Which of the accepted JSON forms ``data`` is, and its rows."""
    if isinstance(data, dict):
        if "dataframe_split" in data:
            split = data["dataframe_split"]
            if not isinstance(split, dict) or not isinstance(split.get("data"), list):
                raise InvalidInput(
                    "dataframe_split must be an object with 'data', a list of rows, and "
                    "optionally 'columns', a list of column names"
                )
            columns = split.get("columns")
            if columns is not None and not isinstance(columns, list):
                raise InvalidInput("dataframe_split's 'columns' must be a list of column names")
            return ("rows", columns if inputs.frame else None, split["data"])
        if "dataframe_records" in data:
            return _listed(data["dataframe_records"], "dataframe_records", inputs, model)
        for key in ("inputs", "instances"):
            if key in data:
                inner = data[key]
                if isinstance(inner, dict):
                    return _columnar(inner, key, inputs, model)
                return _listed(inner, key, inputs, model)
        if inputs.frame and data:
            return ("records", None, [data])
        raise InvalidInput(
            "a JSON object body needs an 'inputs' or 'instances' member (or MLflow's "
            "'dataframe_split' or 'dataframe_records') holding " + _SHAPE_HINT
        )
    return _listed(data, "the body", inputs, model)


def _listed(data: Any, where: str, inputs: Inputs, model: str) -> Form:
    if not isinstance(data, list):
        raise InvalidInput(f"expected {_SHAPE_HINT}, got a JSON {json_kind(data)} in {where}")
    if data and isinstance(data[0], dict):
        if not inputs.frame:
            raise InvalidInput(_NO_NAMES.format(model=model))
        return ("records", None, data)
    if data and not isinstance(data[0], list) and not inputs.dense:
        return ("rows", None, [data])  # one row
    return ("rows", None, data)


def _columnar(data: dict[str, Any], where: str, inputs: Inputs, model: str) -> Form:
    if not inputs.frame:
        raise InvalidInput(_NO_NAMES.format(model=model))
    for name, values in data.items():
        if not isinstance(values, list):
            raise InvalidInput(
                f"{where}: column {name!r} is a JSON {json_kind(values)}; expected a list of "
                "values, one per row"
            )
    return ("columns", list(data), list(data.values()))


_NO_NAMES = (
    "expected rows of numbers ([[1.0, 2.0], ...]), got a JSON object: {model} was fitted on an "
    "array and has no column names"
)


def _from_form(form: Form, inputs: Inputs, model: str) -> np.ndarray | Table:
    if not inputs.columns:  # a model that does not say its columns: rows of numbers
        _check_json_rows(form[2], inputs.missing)
        return _as_rows(np.array(form[2], dtype=np.float64), inputs)
    values, rows = to_columns(form, inputs, model)
    if rows == 0:
        raise InvalidInput(f"the input has no rows; expected {_SHAPE_HINT}")
    return dense(values, rows, inputs) if inputs.dense else table(values, rows, inputs)


def _check_json_rows(data: Any, missing: bool = False) -> None:
    """Raise :class:`InvalidInput` naming the first value or row that is not as expected
    (``missing``: a ``null`` is a missing value)."""
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
                _check_number(value, f"row {i}, column {j}", missing)
    else:
        for j, value in enumerate(data):
            _check_number(value, f"position {j}", missing)


def _check_number(value: Any, where: str, missing: bool = False) -> None:
    if value is None:
        if missing:
            return
        raise InvalidInput(
            f"value at {where} is null, a missing value; expected a number: this model does not "
            "take missing values"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(
            f"value at {where} is a JSON {json_kind(value)} ({preview(value)}); expected a number"
        )


def _decode_csv(body: bytes, inputs: Inputs, model: str, header: bool) -> np.ndarray | Table:
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
    names: list[str] | None = None
    if header and rows:
        names = [name.strip() for name in rows.pop(0)]
    if not rows:
        raise InvalidInput("the request body is empty; expected CSV: one row of values per line")
    width = len(rows[0]) if names is None else len(names)
    for i, row in enumerate(rows):
        if len(row) != width:
            raise InvalidInput(
                f"CSV rows have different lengths: line 1 has {width} values, line "
                f"{i + 1 + (names is not None)} has {len(row)}; every row needs the same number "
                "of features"
            )
    if inputs.frame and (names is not None or not inputs.dense):
        if names is not None:
            values, _ = to_columns(("rows", names, rows), inputs, model)
            rows = [list(row) for row in zip(*values, strict=True)]
        elif width != len(inputs.columns):
            raise InvalidInput(
                f"CSV rows have {width} values; {model} takes {len(inputs.columns)} "
                f"column(s) ({', '.join(inputs.names)})"
            )
        cells = csv_cells(rows, inputs)
        return dense(cells, len(rows), inputs) if inputs.dense else table(cells, len(rows), inputs)
    try:
        array = np.array(rows, dtype=np.float64)
    except ValueError:
        # An empty field is a missing value (as the SageMaker XGBoost container reads it).
        try:
            array = np.array(
                [[cell if cell.strip() else "nan" for cell in row] for row in rows],
                dtype=np.float64,
            )
        except ValueError:
            _csv_culprit(rows)
            raise InvalidInput("expected CSV of numbers, one row per line") from None
    return _as_rows(array, inputs)


def _csv_culprit(rows: list[list[str]]) -> None:
    for i, row in enumerate(rows):
        for j, cell in enumerate(row):
            try:
                float(cell or "nan")
            except ValueError:
                raise InvalidInput(
                    f"CSV value {preview(cell)} at line {i + 1}, column {j + 1} is not a "
                    "number; expected numbers only (a header line needs "
                    "'Content-Type: text/csv; header=present')"
                ) from None


#: The most values a libsvm body makes for a model that does not say its width (80 MB).
_LIBSVM_MAX_CELLS = 10_000_000


def _decode_libsvm(body: bytes, inputs: Inputs, model: str) -> np.ndarray:
    if not inputs.dense:
        raise InvalidInput(_NOT_NUMBERS.format(model=model, kind="libsvm rows"))
    try:
        lines = [line.split() for line in body.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise InvalidInput("the libsvm body is not valid UTF-8 text") from None
    if not lines:
        raise InvalidInput("the request body is empty; expected libsvm: label index:value ...")
    entries: list[tuple[int, int, float]] = []
    for i, tokens in enumerate(lines):
        for token in tokens[1:] if ":" not in tokens[0] else tokens:
            index, colon, value = token.partition(":")
            try:
                if not colon:
                    raise ValueError
                entries.append((i, int(index), float(value)))
            except ValueError:
                raise InvalidInput(
                    f"libsvm token {preview(token)} on line {i + 1} is not index:value"
                ) from None
    if inputs.sagemaker_xgboost and entries and min(j for _, j, _ in entries) >= 1:
        # XGBoost's own libsvm reader (the container's): indices all from 1 are 1-based.
        entries = [(i, j - 1, number) for i, j, number in entries]
    width = inputs.width or (max((j for _, j, _ in entries), default=-1) + 1) or 1
    if inputs.width is None and width * len(lines) > _LIBSVM_MAX_CELLS:
        raise InvalidInput(
            f"libsvm rows of {width} columns ({len(lines)} rows): {model} does not say its "
            f"width, and at most {_LIBSVM_MAX_CELLS} values are made from a libsvm body"
        )
    fill = np.nan if inputs.sparse_missing else 0.0
    array = np.full((len(lines), width), fill, dtype=np.float64)
    for i, j, number in entries:
        if not 0 <= j < width:
            raise InvalidInput(
                f"libsvm index {j} on line {i + 1} is out of range; {model} takes "
                f"indices 0 to {width - 1}"
            )
        array[i, j] = number
    return _as_rows(array, inputs)


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
    return array


def _as_rows(array: np.ndarray, inputs: Inputs = STRICT) -> np.ndarray:
    """Check shape and values; return the rows as a C-contiguous float64 array. NaN is a
    missing value, refused unless the model takes them (``inputs.missing``)."""
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
    check_finite(array, missing=inputs.missing)
    return array


def check_finite(array: np.ndarray, where: str = "", missing: bool = False) -> None:
    """Raise :class:`InvalidInput` naming the first infinity of the 2-D ``array``, or its first
    NaN unless ``missing`` (the model takes missing values); the message starts with ``where``."""
    finite = np.isfinite(array)
    if not finite.all():
        bad = np.isinf(array) if missing else ~finite
        if not bad.any():
            return
        i, j = np.argwhere(bad)[0]
        value = float(array[i, j])
        raise InvalidInput(
            f"{where}value {value!r} at row {i}, column {j} is not finite; expected finite "
            + (
                "numbers (a missing value is null or NaN)"
                if missing
                else "numbers: this model does not take missing values (NaN or null) nor infinities"
            )
        )


def preview(value: Any, limit: int = 40) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(exc: BaseException, limit: int = 120) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
