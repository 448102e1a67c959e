"""Explanations: how a request asks for one, and how attributions travel back (run where the
model runs, as every body's decoding and encoding).

Three doors ask for the same numbers:

- SageMaker's ``X-Amzn-SageMaker-Enable-Explanations`` header (boto3's ``EnableExplanations``):
  a JMESPath expression evaluated over each record's prediction as SageMaker Clarify evaluates
  it (the record as a list of its values: ``[0]>`0.5``` compares the first); the records for
  which it is true are explained, and the answer is Clarify's JSON (:func:`encode_clarify`);
- KServe V1's ``POST /v1/models/{model}:explain``: every instance explained, answered
  ``{"explanations": [...]}`` (:func:`encode_kserve`);
- the Open Inference Protocol's request parameter ``explain: true``: an ``attributions``
  output (:func:`v2_tensor`).

The first two travel as a :data:`~mmserver.codecs.requests.Request` whose kind says the door,
the body's own content type and the expression (:func:`explain_request`); the third is a V2
request like any other. :class:`Attributions` is what a model's explainer answers for a batch:
per row, per output explained (a regressor's value, each class's probability or margin), per
input column, with the base value each row's attributions add up from.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mmserver.codecs.requests import Request, make_request
from mmserver.errors import InvalidInput

#: The header SageMaker Runtime sends ``EnableExplanations`` in.
ENABLE_EXPLANATIONS = "X-Amzn-SageMaker-Enable-Explanations"
#: The V2 output that carries the attributions (asked for with ``parameters.explain``).
ATTRIBUTIONS = "attributions"
#: The doors, as a request's kind starts: ``explain:<door>\n<content type>\n<expression>``.
CLARIFY, KSERVE = "clarify", "kserve"
_PREFIX = "explain:"
#: Clarify's answer format's version.
CLARIFY_VERSION = "1.0"
#: What the methods are called in answers and in a model's description.
TREE, LINEAR, KERNEL = "tree_shap", "linear", "kernel_shap"


def explain_request(
    door: str, body: bytes, content_type: str | None, accept: str | None, expression: str
) -> Request:
    """The :data:`Request` of a body to explain through ``door`` (:data:`CLARIFY`,
    :data:`KSERVE`), sent with these headers; ``expression`` selects the records explained.
    Raises what :func:`~mmserver.codecs.requests.make_request` raises for its headers."""
    body, kind, csv_answer = make_request(body, content_type, accept)
    if "\n" in expression or "\r" in expression:
        raise InvalidInput(f"{ENABLE_EXPLANATIONS} must be one line")
    return body, f"{_PREFIX}{door}\n{kind}\n{expression.strip()}", csv_answer


def is_explained(kind: str) -> bool:
    """Whether a request of this kind asks for an explanation (:func:`explain_request`)."""
    return kind.startswith(_PREFIX)


def explained_kind(kind: str) -> tuple[str, str, str]:
    """The door, the body's content type and the expression of an explained request's kind."""
    door, content_type, expression = kind[len(_PREFIX) :].split("\n", 2)
    return door, content_type, expression


def content_type_of(kind: str) -> str:
    """The body's own content type of a request's kind (as sent; ``""``: none)."""
    return explained_kind(kind)[1] if is_explained(kind) else kind


@functools.lru_cache(maxsize=256)
def _compiled(expression: str) -> Any:
    import jmespath
    import jmespath.exceptions

    try:
        return jmespath.compile(expression)
    except jmespath.exceptions.JMESPathError as exc:
        raise InvalidInput(
            f"{ENABLE_EXPLANATIONS}: {expression[:80]!r} is not a JMESPath expression "
            f"({str(exc).splitlines()[0]})"
        ) from None


def selected(expression: str, predictions: Sequence[Any]) -> list[bool]:
    """Per record, whether ``expression`` is true of its prediction: the record as a list of
    its values (a single value as a list of one), as Clarify reads a record of the model's
    answer. Raises :class:`InvalidInput` for an expression JMESPath does not parse."""
    compiled = _compiled(expression)
    chosen = []
    for prediction in predictions:
        record = (
            prediction.tolist() if isinstance(prediction, np.ndarray | np.generic) else prediction
        )
        if not isinstance(record, list):
            record = [record]
        try:
            chosen.append(compiled.search(record) is True)
        except Exception:  # a function given the wrong type: not true of this record
            chosen.append(False)
    return chosen


@dataclass(frozen=True)
class Attributions:
    """A batch's attributions: ``values[row, output, column]`` and ``base[row, output]``, so
    that ``base + values.sum(-1)`` is the model's output explained for each row.

    ``columns`` are the model's input columns (one-hot encoded ones summed back to their
    source column); ``outputs`` names the outputs explained (a classifier's classes; ``None``:
    one output); ``explained`` what they are (``value``, ``probability``, ``margin``);
    ``method`` how they were computed and ``exact`` whether they are the exact Shapley values
    (a sampled Kernel SHAP's are not). Sliced by rows (``attributions[a:b]``)."""

    columns: tuple[str, ...]
    outputs: tuple[str, ...] | None
    explained: str
    method: str
    exact: bool
    values: np.ndarray
    base: np.ndarray
    #: The columns' Clarify feature types (``numerical``, ``categorical``, ``text``).
    kinds: tuple[str, ...] = ()

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def __getitem__(self, rows: slice) -> Attributions:
        return replace(self, values=self.values[rows], base=self.base[rows])

    def taken(self, rows: Sequence[int]) -> Attributions:
        """These rows' attributions."""
        index = np.asarray(rows, dtype=np.intp)
        return replace(self, values=self.values[index], base=self.base[index])

    def about(self) -> dict[str, Any]:
        """How they were made: method, exactness, what was explained and its outputs."""
        about: dict[str, Any] = {"method": self.method, "exact": self.exact}
        about["explained"] = self.explained
        if self.outputs is not None:
            about["outputs"] = list(self.outputs)
        return about

    def record(self, row: int) -> dict[str, Any]:
        """One row's explanation: its base value and one attribution per input column (a list
        per column, one per output, for several outputs)."""
        values, base = self.values[row], self.base[row]
        if self.outputs is None:
            return {
                "base_value": float(base[0]),
                "attributions": dict(zip(self.columns, values[0].tolist(), strict=True)),
            }
        return {
            "base_value": base.tolist(),
            "attributions": dict(zip(self.columns, values.T.tolist(), strict=True)),
        }


def encode_kserve(attributions: Attributions, predictions: Sequence[Any]) -> dict[str, Any]:
    """KServe V1's explain answer: per instance its prediction and its explanation."""
    about = attributions.about()
    return {
        "explanations": [
            {"prediction": _plain(p), **about, **attributions.record(i)}
            for i, p in enumerate(predictions)
        ]
    }


def encode_clarify(
    attributions: Attributions | None,
    chosen: Sequence[bool],
    predictions: bytes,
    content_type: str,
) -> dict[str, Any]:
    """SageMaker Clarify's answer: the model's answer as it would be sent (``predictions``, of
    ``content_type``) and, under ``explanations``, Clarify's ``kernel_shap`` list (one entry
    per record, empty for a record not chosen; per column its ``feature_header``,
    ``feature_type`` and ``attributions``, one value per output explained), with how they were
    made and each explained record's base value beside it; ``{}`` when no record was chosen.
    ``attributions`` holds the chosen records' rows, in order."""
    answer: dict[str, Any] = {
        "version": CLARIFY_VERSION,
        "predictions": {
            "content_type": content_type,
            "data": predictions.decode("utf-8", "replace"),
        },
        "explanations": {},
    }
    if attributions is None or not any(chosen):
        return answer
    records: list[list[dict[str, Any]]] = []
    bases: list[list[float] | None] = []
    kinds = attributions.kinds or ("numerical",) * len(attributions.columns)
    row = 0
    for wanted in chosen:
        if not wanted:
            records.append([])
            bases.append(None)
            continue
        values = attributions.values[row]
        records.append(
            [
                {
                    "feature_header": column,
                    "feature_type": kind,
                    "attributions": [{"attribution": values[:, j].tolist()}],
                }
                for j, (column, kind) in enumerate(zip(attributions.columns, kinds, strict=True))
            ]
        )
        bases.append(attributions.base[row].tolist())
        row += 1
    explanations = answer["explanations"]
    explanations["kernel_shap"] = records
    explanations.update(attributions.about())
    explanations["base_values"] = bases
    return answer


def v2_tensor(attributions: Attributions) -> tuple[np.ndarray, dict[str, Any]]:
    """The V2 ``attributions`` output: a tensor of ``[rows, columns]`` (``[rows, outputs,
    columns]`` for several outputs), and its parameters (the columns, the base values, how
    they were made)."""
    values = attributions.values
    base = attributions.base
    if attributions.outputs is None:
        values, base = values[:, 0, :], base[:, 0]
    parameters = {
        **attributions.about(),
        "columns": list(attributions.columns),
        "base_values": base.tolist(),
    }
    return values, parameters


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value
