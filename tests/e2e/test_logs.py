"""``--log-format json``: every line the real server writes is one JSON object, with the model
(and the request id) of the records that have them."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import aiohttp
import pytest

from mmserver.ops.logs import JsonFormatter
from tests.e2e.server_process import ServerProcess, one_model_store, predict_ok

pytestmark = pytest.mark.e2e


async def test_json_lines_with_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another program's variable: logged while the options are read, before the log is set up.
    monkeypatch.setenv("MMSERVER_OTHER_PROGRAM_SETTING", "1")
    store = one_model_store(tmp_path)
    async with (
        ServerProcess(store, tmp_path / "server.log", "--log-format", "json") as server,
        aiohttp.ClientSession() as session,
    ):
        await predict_ok(session, server.url)
        server.signal(signal.SIGTERM)
        assert await server.wait(30) == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line)
        assert line["time"].endswith("+00:00")
    loaded = [line for line in lines if line["message"].startswith("model sklearn-0 loaded")]
    assert loaded and loaded[0]["model"] == "sklearn-0"
    assert loaded[0]["logger"] == "mmserver.lifecycle.loading"
    assert lines[-1]["message"] == "mmserver stopped"
    early = [line for line in lines if "MMSERVER_OTHER_PROGRAM_SETTING" in line["message"]]
    assert [line["level"] for line in early] == ["WARNING"]
    assert early[0]["logger"] == "mmserver.config.server"


def test_a_record_with_a_request_id_and_an_exception() -> None:
    try:
        raise ValueError("bad row")
    except ValueError as exc:
        record = logging.LogRecord(
            "mmserver.api", logging.ERROR, __file__, 1, "failed %s", ("x",), (type(exc), exc, None)
        )
    record.request_id = "abc-1"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "failed x"
    assert line["request_id"] == "abc-1"
    assert "model" not in line
    assert "ValueError: bad row" in line["exception"]
