"""``access_log``: one line per answered request, the lean path's and aiohttp's alike, with
the method, path, status, latency, model, request id and bytes, as text or as JSON."""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys

import pytest
from aiohttp import web

from mmserver.api.accesslog import FLUSH_LINES, AccessLog
from mmserver.api.web import STATE
from tests.integration.harness import Serve


def _written(app: web.Application, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The access lines written so far (the current loop turn's too)."""
    access = app[STATE].access_log
    assert access is not None
    access.flush()
    return [line for line in capsys.readouterr().err.splitlines() if "mmserver.access" in line]


async def test_a_json_line_per_request_from_either_path(
    serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = await serve(access_log=True, log_format="json")
    ok = await harness.post("/predictions/sklearn-1", "[[0.5]]", **{"X-Request-Id": "r-1"})
    assert ok.status == 200
    bad = await harness.post("/predictions/sklearn-1", "[[0.5]", **{"X-Request-Id": "r-2"})
    assert bad.status == 400
    listed = await harness.client.get("/models", headers={"X-Request-Id": "r-3"})
    assert listed.status == 200
    lines = [json.loads(line) for line in _written(harness.client.app, capsys)]
    records = {line["request_id"]: line for line in lines}
    assert set(records) == {"r-1", "r-2", "r-3"}
    first = records["r-1"]
    assert (first["method"], first["path"], first["status"], first["model"]) == (
        "POST",
        "/predictions/sklearn-1",
        200,
        "sklearn-1",
    )
    assert (first["level"], first["logger"]) == ("INFO", "mmserver.access")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first["time"])
    assert first["bytes"] == len(await ok.read())
    assert first["latency_ms"] > 0
    assert first["message"].startswith("POST /predictions/sklearn-1 200 ")
    assert first["message"].endswith(f" model=sklearn-1 bytes={first['bytes']} r-1")
    assert records["r-2"]["status"] == 400
    assert (records["r-3"]["method"], records["r-3"]["status"], records["r-3"]["model"]) == (
        "GET",
        200,
        "-",
    )


async def test_text_lines_as_the_rest_of_the_log(
    serve: Serve, capsys: pytest.CaptureFixture[str]
) -> None:
    harness = await serve(access_log=True)
    for rid in ("t-1", "t-2"):
        ok = await harness.post("/predictions/sklearn-1", "[[0.5]]", **{"X-Request-Id": rid})
        assert ok.status == 200
    lines = _written(harness.client.app, capsys)
    assert len(lines) == 2
    for line, rid in zip(lines, ("t-1", "t-2"), strict=True):
        assert re.fullmatch(
            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO mmserver\.access: "
            r"POST /predictions/sklearn-1 200 \d+\.\d\d ms model=sklearn-1 bytes=\d+ " + rid,
            line,
        ), line


async def test_off_writes_nothing(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    harness = await serve()
    assert harness.client.app[STATE].access_log is None
    ok = await harness.post("/predictions/sklearn-1", "[[0.5]]")
    assert ok.status == 200
    assert "mmserver.access" not in capsys.readouterr().err


async def test_a_json_line_is_what_json_writes(capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON line is built by hand for speed: it must be what ``json.dumps`` writes, also
    for strings that need escaping."""
    access = AccessLog("json")
    access.write("POST", '/predictions/a"b\\c\u00e9', 503, 0.0123456, "a\nb", "r\t1", 7)
    access.flush()
    (line,) = capsys.readouterr().err.splitlines(keepends=True)
    parsed = json.loads(line)
    assert line == json.dumps(parsed) + "\n"
    assert (parsed["path"], parsed["model"], parsed["request_id"]) == (
        '/predictions/a"b\\c\u00e9',
        "a\nb",
        "r\t1",
    )
    assert (parsed["status"], parsed["latency_ms"], parsed["bytes"]) == (503, 12.346, 7)


async def test_lines_are_written_together(capsys: pytest.CaptureFixture[str]) -> None:
    """Lines are kept until FLUSH_LINES of them are, then written in one call, in order."""
    access = AccessLog("text")
    for n in range(FLUSH_LINES - 1):
        access.write("POST", "/predictions/m", 200, 0.001, "m", f"w-{n}", 3)
    assert "w-0" not in capsys.readouterr().err  # kept
    access.write("POST", "/predictions/m", 200, 0.001, "m", "last", 3)
    written = capsys.readouterr().err.splitlines()
    assert [line.rsplit(" ", 1)[1] for line in written] == [
        *(f"w-{n}" for n in range(FLUSH_LINES - 1)),
        "last",
    ]


class _Stream(io.StringIO):
    """A stream that says when something is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = asyncio.Event()

    def write(self, text: str) -> int:
        self.written.set()
        return super().write(text)


async def test_a_lone_line_is_written_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line is not kept past FLUSH_S when no others follow it."""
    stream = _Stream()
    monkeypatch.setattr(sys, "stderr", stream)
    access = AccessLog("text")
    access.write("POST", "/predictions/m", 200, 0.001, "m", "alone", 3)
    assert stream.getvalue() == ""
    await asyncio.wait_for(stream.written.wait(), 30)
    assert stream.getvalue().rstrip("\n").endswith(" alone")
