"""``access_log``: one record per answered request, the lean path's and aiohttp's alike, with
the method, path, status, latency, model, request id and bytes."""

from __future__ import annotations

import logging

import pytest

from tests.integration.harness import Serve


async def test_a_record_per_request_from_either_path(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    harness = await serve(access_log=True)
    with caplog.at_level(logging.INFO, logger="mmserver.access"):
        ok = await harness.post("/predictions/sklearn-1", "[[0.5]]", **{"X-Request-Id": "r-1"})
        assert ok.status == 200
        bad = await harness.post("/predictions/sklearn-1", "[[0.5]", **{"X-Request-Id": "r-2"})
        assert bad.status == 400
        listed = await harness.client.get("/models", headers={"X-Request-Id": "r-3"})
        assert listed.status == 200
    records = {
        getattr(r, "request_id", ""): r for r in caplog.records if r.name == "mmserver.access"
    }
    assert set(records) == {"r-1", "r-2", "r-3"}
    first = records["r-1"]
    assert (first.method, first.path, first.status, first.model) == (  # type: ignore[attr-defined]
        "POST",
        "/predictions/sklearn-1",
        200,
        "sklearn-1",
    )
    assert first.bytes == len(await ok.read())  # type: ignore[attr-defined]
    assert first.latency_ms > 0  # type: ignore[attr-defined]
    assert first.getMessage().startswith("POST /predictions/sklearn-1 200 ")
    assert records["r-2"].status == 400  # type: ignore[attr-defined]
    assert (records["r-3"].method, records["r-3"].status, records["r-3"].model) == (  # type: ignore[attr-defined]
        "GET",
        200,
        "-",
    )
