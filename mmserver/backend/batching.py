"""Answering a batch where the model runs: in a backend process, or a thread slot's thread.

A batch's requests come as they came to the frontend (bodies, not arrays): :func:`answer_batch`
decodes each body into what the model takes (:mod:`mmserver.codecs.schema`), makes one call to the
model
for all the valid rows — one matrix, or one DataFrame for a model that takes one — and encodes
one answer per request. A body that does not decode, or has the wrong number of features, gets
its own error; the others in its batch are answered.

The common batch — every body a JSON list of rows of finite numbers, for a model that takes a
matrix — is decoded together (:func:`rows_together`): each body parsed alone (no body can change
how another is read), their rows made one matrix and checked in one numpy call. Any other batch,
or one where a body is otherwise, is decoded body by body, each body getting its own answer or
error as :func:`~mmserver.codecs.requests.decode_as` gives it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mmserver import errors
from mmserver.backend.explaining import answer_explained
from mmserver.backend.rows import Rows, merge, split
from mmserver.codecs.answers import encode_as, encode_sagemaker_xgboost
from mmserver.codecs.explanations import is_explained
from mmserver.codecs.requests import (
    JSON,
    STRICT,
    Request,
    decode_as,
    media_type,
    sagemaker_container_kind,
)
from mmserver.codecs.schema import Inputs, matrix_inputs
from mmserver.codecs.v2 import is_v2
from mmserver.codecs.v2_answers import encode_v2
from mmserver.codecs.v2_requests import decode_v2

#: One request's answer from :func:`answer_batch`: the encoded body, or the name of an
#: :class:`~mmserver.errors.MMServerError` class and its message.
Answer = bytes | tuple[str, str]


class Predict(Protocol):
    """The model of a batch: ``predict(rows)`` answers one output per row; with ``output``,
    one of the outputs the model names (:attr:`mmserver.execution.predictor.Predictor.outputs`)."""

    def __call__(self, batch: Rows, output: str | None = None, /) -> Any: ...


def answer_batch(
    requests: Sequence[Request],
    predict: Predict,
    inputs: Inputs | int | None,
    name: str,
    output_names: Sequence[str] = ("predict",),
) -> list[Answer]:
    """Decode each request, predict every valid row in one call, and encode each answer.

    ``inputs`` is what the model takes (a width alone: that many numbers, no missing values;
    ``None``: numbers, any width). A request that does not decode, or whose rows do not have the
    model's width, is answered with its error and left out of the call. When the model does not
    say how many features it takes, requests of different widths go to it in one call per
    width. V2 requests go in calls of their own (:func:`answer_v2`); ``output_names`` are the
    outputs they may ask for, the first being what ``predict(rows)`` answers. Requests for an
    explanation go last (:func:`~mmserver.backend.explaining.answer_explained`). An exception from
    ``predict``, or outputs that do not match the rows, is the whole batch's and is raised."""
    if not isinstance(inputs, Inputs):
        inputs = STRICT if inputs is None else matrix_inputs(inputs, missing=False)
    n_features = inputs.width
    answers: list[Answer] = [b""] * len(requests)
    together = rows_together(requests, inputs) if len(requests) > 1 else None
    if together is not None:
        matrix, counts = together
        _answer_group(requests, answers, list(enumerate(counts)), matrix, predict, inputs)
        return answers
    model = f"model {name}"
    groups: dict[int, list[tuple[int, Rows]]] = {}
    v2: list[int] = []
    explained: list[int] = []
    for i, (body, kind, _) in enumerate(requests):
        if is_v2(kind):
            v2.append(i)
            continue
        if is_explained(kind):
            explained.append(i)
            continue
        try:
            rows = decode_as(body, kind, inputs, model)
            if n_features is not None and rows.shape[1] != n_features:
                raise feature_error(name, n_features, rows.shape[1])
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)
            continue
        groups.setdefault(rows.shape[1], []).append((i, rows))
    for group in groups.values():
        counted = [(i, len(rows)) for i, rows in group]
        _answer_group(requests, answers, counted, merge([r for _, r in group]), predict, inputs)
    if v2:
        answer_v2(requests, v2, answers, predict, inputs, name, output_names)
    if explained:
        answer_explained(requests, explained, answers, predict, inputs, name)
    return answers


def _answer_group(
    requests: Sequence[Request],
    answers: list[Answer],
    counted: list[tuple[int, int]],
    rows: Rows,
    predict: Predict,
    inputs: Inputs,
) -> None:
    """Predict ``rows`` (the rows of the requests at the indices of ``counted``, each with its
    count of rows, in order) in one call and encode each request's answer into ``answers``."""
    pieces = split(predict(rows), [count for _, count in counted])
    for (i, _), piece in zip(counted, pieces, strict=True):
        _, kind, csv_answer = requests[i]
        container = inputs.sagemaker_xgboost and sagemaker_container_kind(kind)
        try:
            if container:
                answers[i] = encode_sagemaker_xgboost(piece, csv_answer)
            else:
                answers[i] = encode_as(piece, csv_answer)
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)


def rows_together(
    requests: Sequence[Request], inputs: Inputs
) -> tuple[np.ndarray, list[int]] | None:
    """The rows of every request as one float64 matrix, and each request's count of rows, when
    every request is a JSON list of rows of finite numbers of the model's width (the common
    batch); ``None`` when any is not, or the model does not take a matrix: the batch is then
    decoded body by body, each body getting its own answer or error.

    Each body is parsed alone, so no body can change how another is read; what stays per body
    is the parse and a look at its rows' types, the checks of shape, kinds and values being one
    numpy call for the batch. A body with a JSON boolean, or not in ASCII (UTF-16, say), or a
    value that is not a finite number (strings, nulls, NaN and infinities, nesting) leaves the
    batch to :func:`~mmserver.codecs.requests.decode_as`, which reads or refuses each as it does
    alone."""
    if not inputs.dense:
        return None
    loads = json.loads
    rows: list[Any] = []
    counts: list[int] = []
    for body, kind, _ in requests:
        if kind != JSON and (media_type(kind) != JSON if kind else inputs.sagemaker_xgboost):
            return None
        if not body.startswith(b"[[") or b"true" in body or b"false" in body or not body.isascii():
            return None
        try:
            data = loads(body)
        except (ValueError, RecursionError):
            return None
        for row in data:
            if type(row) is not list:
                return None
        rows += data
        counts.append(len(data))
    try:
        array = np.array(rows)
    except (ValueError, TypeError, RecursionError):  # ragged rows
        return None
    if array.ndim != 2 or array.dtype.kind not in "iuf" or not array.shape[1]:
        return None
    width = inputs.width
    if width is not None and array.shape[1] != width:
        return None
    if array.dtype != np.float64:
        array = array.astype(np.float64)
    if not np.isfinite(array).all():
        return None
    return array, counts


def answer_v2(
    requests: Sequence[Request],
    indices: Sequence[int],
    answers: list[Answer],
    predict: Predict,
    inputs: Inputs,
    name: str,
    output_names: Sequence[str],
) -> None:
    """Answer the V2 requests at ``indices`` of ``requests`` (in ``answers``): one call per
    output asked for (and per width, when the model does not say its own), the rows of every
    request asking for it together."""
    n_features = inputs.width
    decoded = {}
    groups: dict[tuple[str, int], list[tuple[int, Rows]]] = {}
    for i in indices:
        body, kind, _ = requests[i]
        try:
            request = decode_v2(body, kind, output_names, inputs, f"model {name}")
            width = request.rows.shape[1]
            if n_features is not None and width != n_features:
                raise feature_error(name, n_features, width)
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)
            continue
        decoded[i] = (request, dict[str, Any]())
        for output in request.outputs:
            groups.setdefault((output, width), []).append((i, request.rows))
    for (output, _), group in groups.items():
        merged = merge([rows for _, rows in group])
        results = predict(merged) if output == output_names[0] else predict(merged, output)
        for (i, _), piece in zip(group, split(results, [len(r) for _, r in group]), strict=True):
            decoded[i][1][output] = piece
    for i, (request, results) in decoded.items():
        try:
            answers[i] = encode_v2(request, results, name)
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)


def feature_error(name: str, expected: int, got: int) -> errors.InvalidInput:
    return errors.InvalidInput(f"model {name} expects {expected} feature(s) per row, got {got}")
