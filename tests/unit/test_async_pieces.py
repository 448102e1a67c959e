"""Large line-based inputs in pieces, and the pieces' answers joined into the whole input's."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from mmserver.asynchronous.pieces import AnswerJoiner, pieces, splittable
from mmserver.codecs.answers import answer_body, encode_as
from mmserver.errors import ModelError


def cut(body: bytes, limit: int, content_type: str = "text/csv") -> list[bytes]:
    return list(pieces(io.BytesIO(body), limit, content_type))


@pytest.mark.parametrize(
    ("body", "limit", "expected"),
    [
        (b"1\n2\n3\n", 100, [b"1\n2\n3\n"]),
        (b"1\n2\n3\n", 4, [b"1\n2\n", b"3\n"]),
        (b"1\n2\n3", 4, [b"1\n2\n", b"3"]),  # no line end at the end
        (b"1\n22222\n3\n", 4, [b"1\n", b"22222\n", b"3\n"]),  # a line longer than a piece
        (b"1\n2\n\n", 4, [b"1\n2\n"]),  # nothing but a blank line left
        (b"", 4, []),
    ],
)
def test_pieces_end_at_line_ends_within_the_limit(
    body: bytes, limit: int, expected: list[bytes]
) -> None:
    assert cut(body, limit) == expected
    assert b"".join(expected) == body.rstrip(b"\n") + (b"\n" if body.endswith(b"\n") else b"")


def test_a_csv_header_heads_every_piece() -> None:
    body = b"x,y\n1,2\n3,4\n5,6\n"
    assert cut(body, 11, "text/csv; header=present") == [
        b"x,y\n1,2\n",
        b"x,y\n3,4\n",
        b"x,y\n5,6\n",
    ]


def test_pieces_of_a_body_larger_than_a_read() -> None:
    rows = b"".join(b"%d.5\n" % i for i in range(300_000))  # over one READ_BYTES
    got = cut(rows, 100_000)
    assert b"".join(got) == rows
    assert all(len(p) <= 100_000 and p.endswith(b"\n") for p in got)


@pytest.mark.parametrize("kind", ["text/csv", "text/csv; header=present", "text/libsvm"])
def test_line_types_are_splittable(kind: str) -> None:
    assert splittable(kind)


@pytest.mark.parametrize("kind", ["application/json", "application/x-npy", None])
def test_other_types_are_not(kind: str | None) -> None:
    assert not splittable(kind)


@pytest.mark.parametrize("csv_answer", [False, True])
def test_joined_answers_are_the_whole_inputs_answer(tmp_path: Path, csv_answer: bool) -> None:
    values = np.arange(10, dtype=float) * 1.5
    whole, kind = answer_body(encode_as(values, csv_answer), csv_answer)
    joiner = AnswerJoiner(tmp_path / "answer")
    for part in (values[:3], values[3:3], values[3:9], values[9:]):
        body, part_kind = answer_body(encode_as(part, csv_answer), csv_answer)
        joiner.add(bytes(body), part_kind)
    joiner.close()
    assert joiner.content_type == kind
    assert (tmp_path / "answer").read_bytes() == bytes(whole)


def test_answers_that_cannot_be_joined_fail_and_leave_nothing(tmp_path: Path) -> None:
    joiner = AnswerJoiner(tmp_path / "answer")
    joiner.add(b'{"predictions": [1.0]}', "application/json")
    with pytest.raises(ModelError, match="different content types"):
        joiner.add(b"1.0\n", "text/csv; charset=utf-8")
    with pytest.raises(ModelError, match="cannot be joined"):
        joiner.add(b'{"other": 1}', "application/json")
    joiner.discard()
    assert not (tmp_path / "answer").exists()
