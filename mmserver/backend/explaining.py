"""Answering the requests of a batch that ask for an explanation through SageMaker Clarify's
header or KServe's explain verb (:mod:`mmserver.codecs.explanations`), where the model runs.

They are answered after the batch's other requests, with two calls to the model for all of
them: one prediction of every row (what Clarify's expression is evaluated over, and what both
answers show), then one explanation of every row chosen (every row of a KServe request; those
for which the expression is true for Clarify). A request whose body does not decode, or whose
expression JMESPath cannot read, gets its own error; a model that has no explanation answers
each of these requests with that error (400, saying what it lacks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmserver import errors
from mmserver.backend.rows import Rows, merge, split, take
from mmserver.codecs.answers import encode_as, encode_json, response_type
from mmserver.codecs.explanations import (
    ATTRIBUTIONS,
    CLARIFY,
    Attributions,
    encode_clarify,
    encode_kserve,
    explained_kind,
    selected,
)
from mmserver.codecs.requests import Request, decode_as
from mmserver.codecs.schema import Inputs


def answer_explained(
    requests: Sequence[Request],
    indices: Sequence[int],
    answers: list[Any],
    predict: Any,
    inputs: Inputs,
    name: str,
) -> None:
    """Answer the explained requests at ``indices`` of ``requests`` (in ``answers``), with
    ``predict`` (``predict(rows)``, and ``predict(rows, ATTRIBUTIONS)`` for their
    :class:`~mmserver.codecs.explanations.Attributions`)."""
    decoded: list[tuple[int, str, str, Rows]] = []
    for i in indices:
        body, kind, _ = requests[i]
        door, content_type, expression = explained_kind(kind)
        try:
            rows = decode_as(body, content_type, inputs, f"model {name}")
            width = inputs.width
            if width is not None and rows.shape[1] != width:
                raise errors.InvalidInput(
                    f"model {name} expects {width} feature(s) per row, got {rows.shape[1]}"
                )
            if door == CLARIFY:
                selected(expression, [])  # an expression JMESPath cannot read: this request's
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)
            continue
        decoded.append((i, door, expression, rows))
    if not decoded:
        return
    counts = [len(rows) for _, _, _, rows in decoded]
    merged = merge([rows for _, _, _, rows in decoded])
    predictions = split(predict(merged), counts)
    chosen: list[list[bool]] = []
    for (_, door, expression, _), piece in zip(decoded, predictions, strict=True):
        chosen.append(selected(expression, piece) if door == CLARIFY else [True] * len(piece))
    flat = [c for request in chosen for c in request]
    attributions: Attributions | None = None
    if any(flat):
        try:
            attributions = predict(take(merged, [j for j, c in enumerate(flat) if c]), ATTRIBUTIONS)
        except errors.InvalidInput as exc:  # the model has no explanation: each request's 400
            for i, *_ in decoded:
                answers[i] = (type(exc).__name__, exc.message)
            return
    start = 0
    for (i, door, _, _), piece, wanted in zip(decoded, predictions, chosen, strict=True):
        count = sum(wanted)
        mine = attributions[start : start + count] if attributions is not None else None
        start += count
        csv_answer = requests[i][2]
        try:
            if door == CLARIFY:
                body = encode_as(piece, csv_answer)
                answer = encode_clarify(mine, wanted, body, response_type(csv_answer))
            else:
                assert mine is not None
                answer = encode_kserve(mine, piece)
            answers[i] = encode_json(answer)
        except errors.MMServerError as exc:
            answers[i] = (type(exc).__name__, exc.message)
