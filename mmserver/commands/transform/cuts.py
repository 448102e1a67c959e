"""A file cut into payloads: byte slices of the file itself when its lines are its records, or
runs of its list of records otherwise.

A ``--split-type Line`` file whose every line is a record (no blank line, no carriage return:
:func:`~mmserver.commands.transform.records.regular_lines`), sent ``MultiRecord`` as lines (not as a
JSON array) and not joined to its answers, is never split into records: a payload is the
file's bytes from a line's start to the last newline that fits in the limit (a last line
without one gets it), and its records are its newlines, counted. These are the payloads
:func:`~mmserver.commands.transform.records.pack` makes of the file's records, byte for byte, with
the same indices, records and sizes: the journal of a job holds the same either way. A file of
50,000 lines is not split into 50,000 objects to be joined again, which cost the job ~10 ms of
CPU a file, taken from the server on the same machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmserver.commands.transform.failures import FileFailed
from mmserver.commands.transform.options import TransformOptions
from mmserver.commands.transform.records import (
    Framing,
    Payload,
    pack,
    regular_lines,
    split_records,
    too_large,
)


@dataclass
class Cut:
    """A file's ``count`` records and its payloads: slices of ``data`` when ``records`` is
    ``None``; else runs of ``records`` (and ``data`` is not kept)."""

    data: bytes
    records: list[bytes] | None
    payloads: list[Payload]
    count: int
    framing: Framing

    def body(self, payload: Payload) -> bytes:
        """A payload's request body."""
        if self.records is None:
            body = self.data[payload.first : payload.last]
            return body if body.endswith(b"\n") else body + b"\n"
        return self.framing.body(self.records[payload.start : payload.end])

    def records_of(self, payload: Payload) -> Sequence[bytes] | None:
        """A payload's records, or ``None`` for a slice (never needed then)."""
        return None if self.records is None else self.records[payload.start : payload.end]

    def release(self) -> None:
        """Let go of the file's content once its output is assembled."""
        self.data = b""
        self.records = None


def cut(data: bytes, options: TransformOptions, framing: Framing, limit: int) -> Cut:
    """``data`` (a file's content) cut into the payloads of ``options`` of at most ``limit``
    bytes. Raises :class:`FileFailed` for a file without records or with a record over the
    limit."""
    single = options.batch_strategy == "SingleRecord"
    sliced = options.split_type == "Line" and not single and options.join_source != "Input"
    if sliced and not framing.array and regular_lines(data):
        payloads = slices(data, limit)
        return Cut(data, None, payloads, payloads[-1].end, framing)
    records = split_records(data, options.split_type)
    if not records:
        raise FileFailed("the file holds no record")
    payloads = pack(records, framing, limit, single)
    return Cut(b"", records, payloads, len(records), framing)  # the records hold the bytes


def slices(data: bytes, limit: int) -> list[Payload]:
    """The payloads of a file of regular lines (:func:`regular_lines`, not empty), each as many
    lines as fit in ``limit`` bytes with a newline each. Raises :class:`FileFailed` for a line
    that does not fit on its own."""
    size = len(data)
    # The end of the file's last line with its newline, which a last line may lack.
    end = size if data.endswith(b"\n") else size + 1
    payloads: list[Payload] = []
    first, start = 0, 0
    while first < end:
        if end - first <= limit:
            last = end
        else:
            newline = data.rfind(b"\n", first, first + limit)
            if newline < 0:
                line = data.find(b"\n", first)
                raise too_large(start, (line if line >= 0 else size) - first, limit)
            last = newline + 1
        count = data.count(b"\n", first, last) + (1 if last > size else 0)
        index = len(payloads)
        payloads.append(Payload(index, start, start + count, last - first, first, min(last, size)))
        first, start = last, start + count
    return payloads
