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


_TALKATIVE = """\
import sys
import warnings


def load(model_dir, properties):
    print("loading the talkative model")
    return None


def predict(model, batch):
    print("predicting", len(batch), "row(s)")
    print("a native library's complaint", file=sys.stderr)
    warnings.warn("this estimator will change its default", FutureWarning)
    return [float(row[0]) for row in batch]
"""


async def test_what_backend_processes_write_is_json_too_with_the_model(tmp_path: Path) -> None:
    """A model's prints, what it writes to stderr and Python's warnings in a backend process
    are JSON lines of the log, each naming the model."""
    store = one_model_store(tmp_path)
    talkative = store / "talkative"
    talkative.mkdir()
    (talkative / "model.py").write_text(_TALKATIVE)
    async with (
        ServerProcess(
            store, tmp_path / "server.log", "--log-format", "json", "--backend-processes", "1"
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(f"{server.url}/predictions/talkative", json=[[1.5]]) as response:
            assert response.status == 200, await response.text()
        await predict_ok(session, server.url)
        server.signal(signal.SIGTERM)
        assert await server.wait(30) == 0
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    said = {
        (line["logger"], line["level"], line["message"]): line.get("model")
        for line in lines
        if line["logger"] in ("mmserver.model.output", "py.warnings")
    }
    assert said[("mmserver.model.output", "INFO", "loading the talkative model")] == "talkative"
    assert said[("mmserver.model.output", "INFO", "predicting 1 row(s)")] == "talkative"
    assert said[("mmserver.model.output", "WARNING", "a native library's complaint")] == (
        "talkative"
    )
    warned = [m for (logger, _, m) in said if logger == "py.warnings"]
    assert any("FutureWarning: this estimator will change its default" in m for m in warned)


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
