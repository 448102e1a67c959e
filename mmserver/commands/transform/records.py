"""Files to records, records to payloads, answers back to output lines (pure functions).

With ``--split-type Line`` a record is a line of the file (``\\n`` or ``\\r\\n``; blank lines are
not records); with ``None`` it is the whole file. A payload is a run of consecutive records sent
as one request: as many as fit in ``--max-payload-mb`` (``MultiRecord``) or one
(``SingleRecord``). CSV and LIBSVM records are sent as lines; JSON lines as one JSON array (the
server takes an array of rows or records). An answer is split back into one output per record
(a CSV line, or an element of ``predictions``), so ``MultiRecord`` and ``SingleRecord`` write the
same output; ``--join-source Input`` joins each to its record as SageMaker does.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from mmserver.commands.transform.failures import FileFailed
from mmserver.commands.transform.options import CSV, JSON, JSON_LINES, TransformOptions


@dataclass(frozen=True)
class Payload:
    """Records ``start`` to ``end`` (excluded) of a file: its ``index``-th request; ``size``:
    their bytes with a separator each; ``first`` to ``last``: their bytes in the file, when
    the payload is a slice of it (:mod:`~mmserver.commands.transform.cuts`)."""

    index: int
    start: int
    end: int
    size: int = 0
    first: int = 0
    last: int = 0


#: A line that is empty or blank, or a carriage return: what the plain split cannot take.
_IRREGULAR = re.compile(rb"\r|(?:^|\n)[ \t\f\v]*(?:\n|$)")
#: The blanks a blank line may hold besides none.
_BLANKS = (b" ", b"\t", b"\f", b"\v")


def split_records(data: bytes, split_type: str) -> list[bytes]:
    """The records of a file's content."""
    if split_type == "None":
        return [data] if data.strip() else []
    if regular_lines(data):  # every line a record, the common case
        records = data.split(b"\n")
        if data.endswith(b"\n"):
            records.pop()
        return records
    records = []
    for line in data.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.strip():
            records.append(line)
    return records


def regular_lines(data: bytes) -> bool:
    """Whether every line of ``data`` (its last newline aside) is a record: no empty or blank
    line, no carriage return. Looked for byte by byte in C, in place (a file of numbers holds
    none of these bytes); the regular expression, ~60 ms for 50,000 lines, only for a file
    holding blanks."""
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    if end <= 0 or data[:1] == b"\n" or data[end - 1 : end] == b"\n":
        return False
    if data.find(b"\r", 0, end) >= 0 or data.find(b"\n\n", 0, end) >= 0:
        return False
    if all(data.find(blank, 0, end) < 0 for blank in _BLANKS):
        return True
    return _IRREGULAR.search(data, 0, end) is None


class Framing:
    """How records are put into a request body, and its ``Content-Type``."""

    def __init__(self, options: TransformOptions) -> None:
        self.array = options.content_type == JSON_LINES
        self.whole = options.split_type == "None"
        self.content_type = JSON if self.array else options.content_type

    def base(self) -> int:
        """A body's bytes besides its records' (each adds its length and one separator)."""
        return 1 if self.array and not self.whole else 0

    def body(self, records: Sequence[bytes]) -> bytes:
        if self.array:
            if self.whole:  # a whole JSON-lines file: its lines as one array
                records = split_records(records[0], "Line")
            return b"[" + b",".join(records) + b"]"
        if self.whole:
            return records[0]
        return b"\n".join(records) + b"\n"


def pack(records: Sequence[bytes], framing: Framing, limit: int, single: bool) -> list[Payload]:
    """The payloads of a file's records, in order, each with the size of its records (a
    record's bytes and its separator). Raises :class:`FileFailed` for a record that does not
    fit in ``limit`` bytes on its own. The cuts are found by bisection on the running total of
    the sizes: one step per payload, not per record."""
    if not records:
        return []
    costs = [len(record) + 1 for record in records]
    room = limit - framing.base()
    if max(costs) > room:
        number = next(i for i, cost in enumerate(costs) if cost > room)
        raise too_large(number, len(records[number]), limit)
    if single:
        return [Payload(i, i, i + 1, c) for i, c in enumerate(costs)]
    totals = list(accumulate(costs))
    payloads: list[Payload] = []
    start, before = 0, 0
    while start < len(records):
        end = bisect_right(totals, before + room, lo=start)
        payloads.append(Payload(len(payloads), start, end, totals[end - 1] - before))
        start, before = end, totals[end - 1]
    return payloads


def too_large(number: int, size: int, limit: int) -> FileFailed:
    """The failure of a file whose record ``number`` (from 0), of ``size`` bytes, does not fit
    in a payload of ``limit`` bytes on its own."""
    return FileFailed(
        f"record {number + 1} is {size:,} bytes, more than the payload limit of {limit:,} "
        "bytes (--max-payload-mb); raise the limit or split the record"
    )


def answers(body: bytes, response_type: str) -> list[Any]:
    """One value per record from an answer's body: a CSV line (bytes), or an element of a JSON
    answer's ``predictions``. Raises :class:`ValueError` for a body of neither form."""
    if response_type.partition(";")[0].strip().lower() == CSV:
        text = body.rstrip(b"\n")
        return [line.rstrip(b"\r") for line in text.split(b"\n")] if text else []
    data = json.loads(body)
    if isinstance(data, dict) and isinstance(data.get("predictions"), list):
        return list(data["predictions"])
    if isinstance(data, list):
        return data
    raise ValueError("the answer is neither CSV lines nor JSON with a predictions list")


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _csv_line(value: Any) -> bytes:
    """A value as the server writes it in a CSV answer: a row's cells comma-separated (a dict's
    values), a nested list or dict as JSON, ``None`` as an empty cell."""
    if isinstance(value, bytes):
        return value
    cells = list(value.values()) if isinstance(value, dict) else value
    if not isinstance(cells, list):
        cells = [cells]
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="").writerow(
        json.dumps(c) if isinstance(c, list | dict) else c for c in cells
    )
    return buffer.getvalue().encode()


def _plain_line(value: Any, options: TransformOptions) -> bytes:
    """A record's output line without its input: the answer's value in the accepted form."""
    return _csv_line(value) if options.answer_type == CSV else _compact(_json_value(value))


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):  # a CSV line answered where JSON was asked for
        text = value.decode()
        try:
            return json.loads(f"[{text}]") if "," in text else json.loads(text)
        except ValueError:
            return text
    return value


def output_lines(
    records: Sequence[bytes] | None, values: Sequence[Any], options: TransformOptions
) -> list[bytes]:
    """The output line of each record (its answer value, joined to it with
    ``--join-source Input``: only then are the ``records`` needed)."""
    if options.join_source != "Input" and _plain_numbers(values):
        return [repr(v).encode() for v in values]  # CSV's and JSON's form alike
    if options.join_source != "Input":
        return [_plain_line(value, options) for value in values]
    assert records is not None, "--join-source Input needs the records"
    lines = []
    for record, value in zip(records, values, strict=True):
        if options.content_type == JSON_LINES:
            lines.append(_join_json(record, _json_value(value)))
        else:
            lines.append(record + b"," + _csv_line(value))
    return lines


#: The bytes of a JSON list of numbers besides its brackets.
_LIST_OF_NUMBERS = b"0123456789+-.eE, \t\r\n"
#: The whitespace JSON allows between values.
_JSON_SPACE = b" \t\r\n"
_PREDICTIONS = b'{"predictions":'
#: A comma or a closing bracket becomes a newline.
_LINE_ENDS = bytes.maketrans(b",]", b"\n\n")


def _number_lines(body: bytes) -> tuple[bytes, int] | None:
    """A JSON answer whose values (``predictions``, or the whole body's list) are all plain
    numbers: one line per value, its text as the answer wrote it (the ``repr`` of the number an
    mmserver answer holds), and their count; ``None`` for any other answer. The numbers are not
    parsed to be written again: the answer is taken for the JSON its type says (a value that is
    not, say ``1..2``, is copied as it is), and only its bytes and commas are checked. Parsing
    50,000 values and writing them again cost the job ~100 ms of CPU, taken from the server on
    the same machine."""
    text = body.strip(_JSON_SPACE)
    if text[:1] == b"[":
        inner = text[1:]
    elif text.startswith(_PREDICTIONS) and text[-1:] == b"}":
        inner = text[len(_PREDICTIONS) : -1].strip(_JSON_SPACE)
        if inner[:1] != b"[":
            return None
        inner = inner[1:]
    else:
        return None
    if inner[-1:] != b"]" or inner[:-1].translate(None, _LIST_OF_NUMBERS):
        return None
    # One pass: the white space goes, each comma and the closing bracket end a line.
    lines = inner.translate(_LINE_ENDS, _JSON_SPACE)
    if lines[:1] == b"\n" or b"\n\n" in lines:  # no value, or an empty one (",,", "[,1", "1,]")
        return None
    return lines, lines.count(b"\n")


def _plain_numbers(values: Sequence[Any]) -> bool:
    """Whether every value is a finite float or an int (not a bool): written as ``repr``."""
    return all((type(v) is float and math.isfinite(v)) or type(v) is int for v in values)


def _join_json(record: bytes, value: Any) -> bytes:
    source = json.loads(record)
    if isinstance(source, dict):
        return _compact({**source, "SageMakerOutput": value})
    return _compact({"SageMakerInput": source, "SageMakerOutput": value})


def part(
    count: int,
    records: Sequence[bytes] | None,
    body: bytes,
    response_type: str,
    options: TransformOptions,
) -> bytes:
    """What the answer of a payload of ``count`` records adds to its file's output. The
    records are needed (not ``None``) only with ``--join-source Input``: a payload cut from a
    file's bytes is never split into them. Raises :class:`ValueError` when the answer does not
    hold one value per record."""
    if options.assemble_with == "None":
        return body
    csv_answer = response_type.partition(";")[0].strip().lower() == CSV
    if csv_answer and options.answer_type == CSV and options.join_source != "Input":
        # The answer's lines are the output lines: counted, not taken apart.
        text = body.replace(b"\r\n", b"\n").rstrip(b"\n")
        lines = text.count(b"\n") + 1 if text else 0
        if options.split_type == "Line" and lines != count:
            raise ValueError(f"the model answered {lines} values for {count} records")
        return text + b"\n" if text else b""
    numbers = None if csv_answer or options.join_source == "Input" else _number_lines(body)
    if numbers is not None and options.split_type == "Line":
        text, values_count = numbers
        if values_count != count:
            raise ValueError(f"the model answered {values_count} values for {count} records")
        return text
    values = answers(body, response_type)
    if options.split_type == "None":
        return b"".join(_plain_line(v, options) + b"\n" for v in values)
    if len(values) != count:
        raise ValueError(f"the model answered {len(values)} values for {count} records")
    if options.join_source != "Input" and _plain_numbers(values):
        return ("\n".join(map(repr, values)) + "\n").encode()
    return b"".join(line + b"\n" for line in output_lines(records, values, options))
