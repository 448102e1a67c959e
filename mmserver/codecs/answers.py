"""Predictions to response bodies, and the answer's content type (runs where the model runs).

:func:`encode_as` turns one output per row into the answer's body: JSON ``{"predictions": [...]}``
unless the request's ``Accept`` prefers ``text/csv`` (one line per row). An ``Accept`` naming
neither gets JSON. :func:`encode_sagemaker_xgboost` answers as the SageMaker XGBoost container.
An answer whose content type is its own (a raw handler's, say) travels typed
(:func:`typed_answer`); the frontend reads the body and type with :func:`answer_body`.
"""

from __future__ import annotations

import csv
import io
import json
import json.encoder
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmserver.errors import ModelError

JSON = "application/json"
CSV = "text/csv"
JSON_RESPONSE_TYPE = "application/json"
CSV_RESPONSE_TYPE = "text/csv; charset=utf-8"


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


def response_type(csv_answer: bool | None) -> str:
    """The ``Content-Type`` of an answer encoded by :func:`encode_as`."""
    return CSV_RESPONSE_TYPE if csv_answer else JSON_RESPONSE_TYPE


#: The first byte of an answer that says its own content type (:func:`typed_answer`); an
#: answer of :func:`encode_as` starts with a JSON or CSV character, never this one.
_TYPED = 1


def typed_answer(body: bytes, content_type: str) -> bytes:
    """An answer whose ``Content-Type`` is its own (a custom handler's bytes, say), as it
    travels to the frontend: the marker, the type's length and the type before the body.
    Raises :class:`ModelError` for a type that is not a header value (printable ASCII, at most
    255 characters)."""
    if not _HEADER_VALUE.fullmatch(content_type):
        raise ModelError(
            f"the content type {content_type[:60]!r} the model answered with is not a header "
            "value (printable ASCII, at most 255 characters)"
        )
    kind = content_type.encode("ascii")
    return bytes((_TYPED, len(kind))) + kind + body


_HEADER_VALUE = re.compile(r"[\x20-\x7e]{1,255}")


def is_typed(answer: bytes) -> bool:
    """Whether an answer from the backend carries its own content type (:func:`typed_answer`)."""
    return answer[:1] == _TYPED_BYTE


_TYPED_BYTE = bytes((_TYPED,))


def answer_body(answer: bytes, csv_answer: bool | None) -> tuple[bytes, str]:
    """The body of an answer from the backend and its ``Content-Type``: the type it carries
    (:func:`typed_answer`), else the one the request's ``Accept`` chose."""
    if not answer or answer[0] != _TYPED:
        return answer, response_type(csv_answer)
    end = 2 + answer[1]
    return answer[end:], answer[2:end].decode("latin-1")


def encode_as(outputs: np.ndarray | Sequence[Any], csv_answer: bool | None) -> bytes:
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
            body = _encode_csv(values)
            # A first byte that would read as a typed answer's marker is sent typed.
            return typed_answer(body, CSV_RESPONSE_TYPE) if body[:1] == b"\x01" else body
        try:
            text = _ENCODER({"predictions": values})
        except ValueError:  # NaN or infinity somewhere
            text = _ENCODER({"predictions": _finite(values)})
    except (TypeError, RecursionError) as exc:
        raise ModelError(f"the model's output cannot be encoded: {exc}") from None
    return text.encode()


def encode_sagemaker_xgboost(outputs: np.ndarray | Sequence[Any], csv_answer: bool | None) -> bytes:
    """An answer as the SageMaker XGBoost container writes it: CSV unless JSON was asked for,
    the predictions comma-separated on one line (a row of several values as its list), or a
    bare JSON array. Typed (:func:`typed_answer`): its content type is its own."""
    values = outputs.tolist() if isinstance(outputs, np.ndarray) else list(outputs)
    if csv_answer is False:
        return typed_answer(encode_json(values), JSON_RESPONSE_TYPE)
    return typed_answer(",".join(map(str, values)).encode(), CSV)


def encode_json(value: Any) -> bytes:
    """Any value JSON can hold as a JSON body (NaN and infinities as ``null``); raises
    :class:`ModelError` for one that has no JSON form."""
    try:
        try:
            return _ENCODER(value).encode()
        except ValueError:
            return _ENCODER(_finite(value)).encode()
    except (TypeError, RecursionError) as exc:
        raise ModelError(f"the model's output cannot be encoded: {exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"prediction value of type {type(value).__name__} cannot be sent as JSON")


def json_encoder(default: Callable[[Any], Any]) -> Callable[[Any], str]:
    """``json.JSONEncoder(allow_nan=False, default=default).encode``, with the C encoder under
    it built once rather than on every call: 2.0 µs for a one-value answer where ``encode``
    takes 4.8 (measured here), on every batch's every request. Without the circular-reference
    check (what is encoded is a model's output, made of lists, dicts and numbers): a value
    that holds itself raises ``RecursionError``, which the callers treat as one with no JSON
    form."""
    plain = json.JSONEncoder(allow_nan=False, default=default)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # an interpreter without json's C accelerator
        return plain.encode
    encode = make(
        None, default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, False
    )

    def encoded(value: Any) -> str:
        return "".join(encode(value, 0))

    return encoded


_ENCODER = json_encoder(_json_default)


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
