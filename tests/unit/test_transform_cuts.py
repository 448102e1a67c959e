"""A file cut into payloads: the slices of a file of regular lines are the payloads its records
make, byte for byte, with the same indices, records and sizes (the journal's); other files keep
their records."""

from __future__ import annotations

import pytest

from mmserver.commands.transform.cuts import cut
from mmserver.commands.transform.failures import FileFailed
from mmserver.commands.transform.options import TransformOptions, parse
from mmserver.commands.transform.records import Framing, pack, part, split_records

BASE = ("--model", "m", "--input", "in", "--output", "out")


def _options(*extra: str) -> TransformOptions:
    return parse([*BASE, *extra])


def _by_records(data: bytes, options: TransformOptions, limit: int) -> list[tuple[bytes, tuple]]:
    """Each payload's body and its (index, start, end, size), from the list of records."""
    framing = Framing(options)
    records = split_records(data, options.split_type)
    single = options.batch_strategy == "SingleRecord"
    return [
        (framing.body(records[p.start : p.end]), (p.index, p.start, p.end, p.size))
        for p in pack(records, framing, limit, single)
    ]


def _by_cut(data: bytes, options: TransformOptions, limit: int) -> tuple[bool, list]:
    pieces = cut(data, options, Framing(options), limit)
    bodies = [(pieces.body(p), (p.index, p.start, p.end, p.size)) for p in pieces.payloads]
    assert pieces.count == sum(p.end - p.start for p in pieces.payloads)
    return pieces.records is None, bodies


REGULAR = [
    b"1,2\n3,4\n5,6\n",
    b"1,2\n3,4\n5,6",  # a last line without its newline
    b"10,20\n3,4\n5,60000\n7,8",
    b"1 ,2\n3, 4\n",  # blanks inside records
    b"x",
    b"12345\n",
]


@pytest.mark.parametrize("data", REGULAR)
@pytest.mark.parametrize("limit", range(6, 30))
def test_slices_of_a_regular_file_are_its_records_payloads(data: bytes, limit: int) -> None:
    options = _options()
    try:
        want = _by_records(data, options, limit)
    except FileFailed as failed:
        with pytest.raises(FileFailed) as sliced:
            _by_cut(data, options, limit)
        assert sliced.value.message == failed.message
        return
    sliced, got = _by_cut(data, options, limit)
    assert sliced
    assert got == want


def test_a_limit_at_a_newline_ends_the_payload_there() -> None:
    data = b"1,2\n3,4\n5,6\n"
    sliced, got = _by_cut(data, _options(), 8)  # exactly two lines with their newlines
    assert sliced
    assert got == [(b"1,2\n3,4\n", (0, 0, 2, 8)), (b"5,6\n", (1, 2, 3, 4))]
    _, got = _by_cut(data, _options(), 7)  # one byte short of the second newline
    assert got == [(b"1,2\n", (0, 0, 1, 4)), (b"3,4\n", (1, 1, 2, 4)), (b"5,6\n", (2, 2, 3, 4))]
    _, got = _by_cut(b"1,2\n3,4", _options(), 8)  # the last line's newline is counted
    assert got == [(b"1,2\n3,4\n", (0, 0, 2, 8))]


@pytest.mark.parametrize(
    "data",
    [
        b"1,2\r\n3,4\r\n",  # CRLF
        b"1,2\n\n3,4\n",  # an empty line
        b"1,2\n \t\n3,4",  # a blank line
        b"\n1,2\n3,4\n",
        b"1,2\n3,4\n\n",
        b"1,2\r\n3,4",
    ],
)
@pytest.mark.parametrize("limit", [5, 8, 100])
def test_an_irregular_file_keeps_its_records_and_the_same_payloads(data: bytes, limit: int) -> None:
    sliced, got = _by_cut(data, _options(), limit)
    assert not sliced
    assert got == _by_records(data, _options(), limit)
    assert [body for body, _ in got][-1].endswith(b"3,4\n")


@pytest.mark.parametrize(
    ("extra", "limit"),
    [
        (("--batch-strategy", "SingleRecord"), 13),
        (("--join-source", "Input"), 13),
        (("--content-type", "application/jsonlines"), 13),
        (("--split-type", "None"), 100),
    ],
)
def test_payloads_that_need_the_records_keep_them(extra: tuple[str, ...], limit: int) -> None:
    data = b"[1,2]\n[3,4]\n[5,6]\n"
    options = _options(*extra)
    sliced, got = _by_cut(data, options, limit)
    assert not sliced
    assert got == _by_records(data, options, limit)
    assert len(got) == (1 if limit == 100 else 3 if "--batch-strategy" in extra else 2)


def test_a_line_over_the_limit_fails_its_file_with_its_number_and_size() -> None:
    with pytest.raises(FileFailed, match="record 3 is 9 bytes, more than the payload limit of 8"):
        cut(b"1\n2\n123456789\n4\n", _options(), Framing(_options()), 8)
    with pytest.raises(FileFailed, match="record 2 is 8 bytes, more than the payload limit of 8"):
        cut(b"1\n12345678", _options(), Framing(_options()), 8)
    with pytest.raises(FileFailed, match="the file holds no record"):
        cut(b"\n \n", _options(), Framing(_options()), 8)


def test_an_answer_to_a_slice_is_counted_against_its_records() -> None:
    pieces = cut(b"1\n2\n3", _options(), Framing(_options()), 100)
    (payload,) = pieces.payloads
    assert pieces.records_of(payload) is None
    body = b'{"predictions": [0.5, 1.5, 2.5]}'
    records = [b"1", b"2", b"3"]
    assert part(3, None, body, "application/json", _options()) == b"0.5\n1.5\n2.5\n"
    assert part(3, None, body, "application/json", _options()) == part(
        3, records, body, "application/json", _options()
    )
    words = b'{"predictions": ["a", "b", "c"]}'
    assert part(3, None, words, "application/json", _options()) == b"a\nb\nc\n"
    jsonl = _options("--accept", "application/jsonlines")
    assert part(3, None, words, "application/json", jsonl) == b'"a"\n"b"\n"c"\n'
    with pytest.raises(ValueError, match="the model answered 3 values for 2 records"):
        part(2, None, body, "application/json", _options())
