"""The request a recommendation sends: the user's own (``--payload FILE``, JSON), or one made
from the model's inputs as its V2 metadata lists them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class PayloadError(Exception):
    """The payload file cannot be used; the message says why."""


def read_payload(path: Path | None) -> str | None:
    """The request body of ``--payload FILE`` on one line; None without the option."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise PayloadError(f"--payload {path}: cannot read it: {exc}") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise PayloadError(f"--payload {path} is not JSON: {exc}") from None
    if "\n" in text:  # wrk's script takes the body from one environment variable
        text = json.dumps(json.loads(text), separators=(",", ":"))
    body: str = text
    return body


def sample_body(inputs: list[dict[str, Any]]) -> str:
    """One request made from the model's V2 inputs: a row of 0.5s (as wide as the model takes),
    or one record for a model of named columns (0.5, or ``"a"`` for a string column)."""
    if len(inputs) == 1 and len(inputs[0].get("shape", [])) == 2:
        width = int(inputs[0]["shape"][1])
        return json.dumps([[0.5] * max(1, width)])
    if inputs:
        record = {i["name"]: "a" if i.get("datatype") == "BYTES" else 0.5 for i in inputs}
        return json.dumps([record])
    return "[[0.5]]"
