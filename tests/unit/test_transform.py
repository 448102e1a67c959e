"""The pure parts of ``mmserver transform``: records into payloads, answers into output lines,
the journal's torn entries, the options' checks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mmserver.commands.transform.failures import FileFailed, TransformError
from mmserver.commands.transform.journal import Journal
from mmserver.commands.transform.options import MIB, TransformOptions, parse
from mmserver.commands.transform.places import Places
from mmserver.commands.transform.progress import Display, Tally, line, summary
from mmserver.commands.transform.records import (
    Framing,
    Payload,
    _number_lines,
    answers,
    output_lines,
    pack,
    part,
    split_records,
)

BASE = ("--model", "m", "--input", "in", "--output", "out")


def _part(
    records: list[bytes], body: bytes, response_type: str, options: TransformOptions
) -> bytes:
    """:func:`part` of a payload of ``records``."""
    return part(len(records), records, body, response_type, options)


def _options(*extra: str) -> TransformOptions:
    return parse([*BASE, *extra])


def test_lines_are_records_and_blank_lines_are_not() -> None:
    assert split_records(b"1,2\r\n\n3,4\n  \n5,6", "Line") == [b"1,2", b"3,4", b"5,6"]
    assert split_records(b"1,2\n3,4\n", "None") == [b"1,2\n3,4\n"]
    assert split_records(b"\n\n", "None") == []


@pytest.mark.parametrize(
    ("limit", "single", "ranges"),
    [
        (100, False, [(0, 4)]),  # everything fits
        (8, False, [(0, 2), (2, 4)]),  # 4 bytes a record: two a payload
        (11, False, [(0, 2), (2, 4)]),
        (12, False, [(0, 3), (3, 4)]),
        (100, True, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_payloads_take_the_records_that_fit(
    limit: int, single: bool, ranges: list[tuple[int, int]]
) -> None:
    records = [b"1,2", b"3,4", b"5,6", b"7,8"]
    payloads = pack(records, Framing(_options()), limit, single)
    assert [(p.start, p.end) for p in payloads] == ranges
    assert [p.index for p in payloads] == list(range(len(ranges)))
    for p in payloads:
        assert len(Framing(_options()).body(records[p.start : p.end])) <= limit


def test_a_record_over_the_limit_fails_its_file() -> None:
    with pytest.raises(FileFailed, match="record 2 is 9 bytes, more than the payload limit of 8"):
        pack([b"1", b"123456789"], Framing(_options()), 8, False)


def test_json_lines_go_as_one_array() -> None:
    framing = Framing(_options("--content-type", "application/jsonlines"))
    assert framing.content_type == "application/json"
    records = [b"[1,2]", b'{"a":1}']
    assert framing.body(records) == b'[[1,2],{"a":1}]'
    assert pack(records, framing, 15, False) == [Payload(0, 0, 2, 14)]
    assert pack(records, framing, 14, False) == [Payload(0, 0, 1, 6), Payload(1, 1, 2, 8)]


def test_answers_become_one_line_a_record_joined_as_sagemaker_joins() -> None:
    records = [b"1.5,2", b"3,4"]
    csv = _options("--join-source", "Input")
    assert _part(records, b"7.0\n9.5\n", "text/csv; charset=utf-8", csv) == b"1.5,2,7.0\n3,4,9.5\n"
    answer = json.dumps({"predictions": [[0.25, 0.75], [1.0, 0.0]]}).encode()
    assert _part(records, answer, "application/json", csv) == b"1.5,2,0.25,0.75\n3,4,1.0,0.0\n"
    jsonl = _options("--content-type", "application/jsonlines", "--join-source", "Input")
    joined = _part([b'{"id":7,"x":1}', b"[2]"], b'{"predictions":[3,5]}', "application/json", jsonl)
    assert joined == (
        b'{"id":7,"x":1,"SageMakerOutput":3}\n{"SageMakerInput":[2],"SageMakerOutput":5}\n'
    )
    assert _part(records, answer, "application/json", _options()) == b"0.25,0.75\n1.0,0.0\n"
    raw = _options("--assemble-with", "None")
    assert _part(records, answer, "application/json", raw) == answer
    with pytest.raises(ValueError, match="the model answered 1 values for 2 records"):
        _part(records, b"7.0\n", "text/csv", _options())


def _split_line_by_line(data: bytes) -> list[bytes]:
    """What a split reads as records, line by line: the rule the split's quick check keeps."""
    return [line.rstrip(b"\r") for line in data.split(b"\n") if line.rstrip(b"\r").strip()]


@pytest.mark.parametrize(
    "data",
    [
        b"1\n2\n3\n",
        b"1\n2\n3",
        b"1 ,2\n3,4\n",  # blanks inside a record
        b"1\n\n2\n",
        b"\n1\n2",
        b"1\n2\n\n",
        b"1\n \t\n2",
        b"1\n\x0b\n2",
        b"  \n1",
        b"1\n  ",
        b"1\r\n2\r\n",
        b"1\n2\r",
        b" ",
    ],
)
def test_a_split_reads_every_layout_of_lines_as_line_by_line(data: bytes) -> None:
    assert split_records(data, "Line") == _split_line_by_line(data)


@pytest.mark.parametrize(
    "answer",
    [
        {"predictions": [1.5, -2, 1e-05, 3e16, 0.1 + 0.2, -0.0, 12345678901234567890]},
        [7.25, 8],
        {"predictions": [1.0, None]},  # not numbers only: parsed
        {"predictions": [[0.25, 0.75], [1.0, 0.0]]},
        {"predictions": ["a", "b"]},
    ],
)
@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
def test_number_answers_become_lines_as_written_and_others_as_parsed(
    answer: object, separators: tuple[str, str]
) -> None:
    body = json.dumps(answer, separators=separators).encode()
    values = answers(body, "application/json")
    records = [b"0"] * len(values)
    # Numbers only are written as the answer's text, not parsed and written again.
    numbers = all(type(v) in (int, float) for v in values)
    assert (_number_lines(body) is not None) == numbers
    for options in (_options(), _options("--accept", "application/jsonlines")):
        # What the answer's values, parsed, are written as (a number: its repr, the text
        # json.dumps wrote).
        want = b"".join(line + b"\n" for line in output_lines(records, values, options))
        assert _part(records, body, "application/json", options) == want
    with pytest.raises(ValueError, match=f"answered {len(values)} values for 1 records"):
        _part([b"0"], body, "application/json", _options())


@pytest.mark.parametrize(
    "body", [b"[1,,2]", b"[,1, 2]", b"[1, 2,]", b"[1, 2", b"[]x", b'{"predictions": 1, 2]}']
)
def test_an_answer_that_is_not_json_fails_its_payload(body: bytes) -> None:
    with pytest.raises(ValueError):
        _part([b"0", b"0"], body, "application/json", _options())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-payload-mb", "0"), "give a size above 0 and at most 100 MiB"),
        (("--max-payload-mb", "101"), "give a size above 0 and at most 100 MiB"),
        (("--content-type", "application/json"), "is not split into lines"),
        (("--join-source", "Input", "--split-type", "None", "--content-type", "text/csv"), "needs"),
        (("--url", "localhost:8080"), "give http://host:port"),
    ],
)
def test_bad_options_are_refused(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(TransformError, match=message):
        _options(*args)


def test_the_journal_cuts_a_torn_entry_and_keeps_the_whole_ones(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", "f1", {"model": "m"})
    header = {"size": 10, "records": 3, "payloads": 3}
    assert journal.parts("a.csv", header) == {}
    journal.add_part("a.csv", 0, b"1\n")
    journal.add_part("a.csv", 2, b"3\n")
    path = next((tmp_path / "j" / "parts").iterdir())
    whole = path.stat().st_size
    with open(path, "ab") as torn:
        torn.write(b"1 20\nonly part")
    again = Journal(tmp_path / "j", "f1", {"model": "m"})
    assert again.parts("a.csv", header) == {0: b"1\n", 2: b"3\n"}
    assert path.stat().st_size == whole
    # Recorded for another split of the file: redone from the start.
    assert again.parts("a.csv", {**header, "size": 11}) == {}
    again.finish("a.csv")
    assert Journal(tmp_path / "j", "f1", {}).done() == {"a.csv"}
    with pytest.raises(TransformError, match="holds the progress of another job"):
        Journal(tmp_path / "j", "f2", {})


def test_progress_shows_records_size_files_rate_and_time_left() -> None:
    tally = Tally(started=100.0, total_files=4, total_bytes=4 * MIB)
    tally.records, tally.bytes_done, tally.files_done = 5000, MIB, 1
    assert line(tally, 110.0, bar=False) == (
        " 25%  5,000 records  1.0/4.0 MB  1/4 files  500 records/s  0:30 left"
    )
    assert line(tally, 110.0, bar=True).startswith("[######..................]  25%")
    tally.files_failed, tally.records_failed = 1, 70
    assert "2/4 files (1 failed)" in line(tally, 110.0, bar=False)
    assert summary(tally, 3700.0) == (
        "1 of 4 files written, 1 failed; 5,000 records (70 in failed files) in 1:00:00 "
        "(3600.0 s), 1 records/s"
    )


def test_a_continued_job_counts_only_its_own_records_in_its_rate() -> None:
    tally = Tally(started=0.0, total_files=2, total_bytes=0)
    tally.files_done, tally.files_resumed, tally.records, tally.records_resumed = 2, 1, 300, 100
    assert summary(tally, 10.0) == (
        "2 of 2 files written, 0 failed; 300 records (0 in failed files) in 0:10 (10.0 s), "
        "20 records/s; continued an earlier run: 1 files and 100 records were already done"
    )


def test_the_display_draws_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tally = Tally(started=0.0, total_files=1, total_bytes=0)
    terminal, log = Terminal(), io.StringIO()
    Display(tally, terminal, "auto").finish(1.0)
    Display(tally, log, "auto").finish(1.0)
    assert terminal.getvalue().startswith("\r[........................]   0%  0 records")
    assert log.getvalue().splitlines()[0].startswith("  0%  0 records  0.0 MB  0/1 files")
    assert log.getvalue().splitlines()[1].startswith("0 of 1 files written")
    quiet = io.StringIO()
    Display(tally, quiet, "none").finish(1.0)
    assert quiet.getvalue().startswith("0 of 1 files written")


def test_a_folder_lists_its_files_but_not_hidden_ones_nor_the_output_inside_it(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    for name in ("a.csv", "day/b.csv", ".hidden", "scored/a.csv.out", ".mmserver-transform/x"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_text("1\n")
    options = parse(["--model", "m", "--input", str(data), "--output", str(data / "scored")])
    files = Places(options).list_inputs()
    assert [(f.name, f.size) for f in files] == [("a.csv", 2), ("day/b.csv", 2)]
    with pytest.raises(TransformError, match="does not exist: give a folder or a file"):
        Places(parse([*BASE[:2], "--input", str(tmp_path / "no"), "--output", "o"])).list_inputs()
