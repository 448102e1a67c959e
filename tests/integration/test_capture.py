"""Data capture: sampled requests and answers written in SageMaker's data capture format, to a
folder and to S3, by a thread fed through a bounded buffer; a shadow that answers differently
captured with both answers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from mmserver.api import STATE
from mmserver.capture import Capture, Record, hour_folder
from mmserver.metrics import Metrics
from tests.integration.harness import Harness, Serve, wait_until
from tests.integration.s3server import s3_environment
from tests.integration.test_versions import make_versioned_store, write_version

pytestmark = pytest.mark.timeout(60)

SAGEMAKER_KEYS = {"captureData", "eventMetadata", "eventVersion"}


def capture_of(harness: Harness) -> Capture:
    capture = harness.client.app[STATE].capture
    assert capture is not None
    return capture


def lines_under(folder: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(folder.rglob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def captured_store(root: Path, percent: int = 100) -> Path:
    store = make_versioned_store(root)
    (store / "versioned" / "serving.properties").write_text(
        f"option.base=10\noption.capture_percent={percent}\n"
    )
    return store


async def test_requests_and_answers_are_written_as_sagemaker_writes_them(
    serve: Serve, tmp_path: Path
) -> None:
    store = captured_store(tmp_path / "store")
    folder = tmp_path / "capture"
    harness = await serve(model_store=str(store), capture_path=str(folder))
    response = await harness.post("/predictions/versioned", "[[0.5]]", **{"X-Request-Id": "r-1"})
    assert response.status == 200
    json_answer = await response.read()
    response = await harness.post(
        "/predictions/versioned/1", "0.5\n", "text/csv", Accept="text/csv"
    )
    assert response.status == 200
    csv_answer = await response.read()
    response = await harness.post("/predictions/plain", "[[0.5]]")  # captures nothing
    assert response.status == 200
    capture = capture_of(harness)
    await wait_until(lambda: capture.written == 2)

    now = time.time()
    by_version = {version: lines_under(folder / "versioned" / version) for version in ("1", "2")}
    assert not (folder / "plain").exists()
    [first] = by_version["2"]
    assert set(first) == SAGEMAKER_KEYS and first["eventVersion"] == "0"
    assert first["captureData"]["endpointInput"] == {
        "observedContentType": "application/json",
        "mode": "INPUT",
        "data": "[[0.5]]",
        "encoding": "JSON",
    }
    assert first["captureData"]["endpointOutput"] == {
        "observedContentType": "application/json",
        "mode": "OUTPUT",
        "data": json_answer.decode(),
        "encoding": "JSON",
    }
    metadata = first["eventMetadata"]
    assert metadata["inferenceId"] == "r-1" and len(metadata["eventId"]) == 36
    assert metadata["inferenceTime"].endswith("Z")
    [second] = by_version["1"]
    data = second["captureData"]
    assert (data["endpointInput"]["data"], data["endpointInput"]["encoding"]) == ("0.5\n", "CSV")
    assert (data["endpointOutput"]["data"], data["endpointOutput"]["encoding"]) == (
        csv_answer.decode(),
        "CSV",
    )
    # Files per model, version and hour.
    hour = hour_folder("versioned/2", now)
    assert hour.startswith("versioned/2/") and list((folder / hour).glob("*.jsonl"))
    assert (await harness.samples())[("mmserver_capture_dropped_total", ())] == 0


def test_a_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    metrics = Metrics()
    capture = Capture(str(tmp_path / "capture"), 3, metrics)
    records = [
        Record("m", time.time(), f"r-{i}", b"[[1]]", "application/json", b"[2]", "application/json")
        for i in range(5)
    ]
    for record in records:  # the writer has not started: the buffer holds three
        capture.offer(record)
    assert metrics.capture_dropped.labels().value == 2
    capture.start()
    capture.close()
    written = lines_under(tmp_path / "capture" / "m" / "1")
    assert [r["eventMetadata"]["inferenceId"] for r in written] == ["r-0", "r-1", "r-2"]
    assert capture.written == 3


async def test_a_shadow_that_answers_differently_is_captured_with_both_answers(
    serve: Serve, tmp_path: Path
) -> None:
    store = captured_store(tmp_path / "store", percent=0)
    write_version(store / "versioned" / "3", 3)
    folder = tmp_path / "capture"
    harness = await serve(model_store=str(store), capture_path=str(folder))
    assert (await harness.client.put("/models/versioned/2/set-default")).status == 200
    path = "/models/versioned/3/set-shadow?percent=100"
    assert (await harness.client.put(path)).status == 200
    assert (await harness.post("/predictions/versioned", "[[0.5]]")).status == 200
    capture = capture_of(harness)
    await wait_until(lambda: capture.written == 1)
    [record] = lines_under(folder)
    data = record["captureData"]
    assert json.loads(data["endpointOutput"]["data"])["predictions"] == [12.0]
    assert json.loads(data["shadowOutput"]["data"])["predictions"] == [13.0]
    assert data["shadowOutput"]["version"] == "3"


async def test_capture_to_an_object_store(serve: Serve, tmp_path: Path) -> None:
    store = captured_store(tmp_path / "store")
    with s3_environment(tmp_path / "aws", "captures") as s3:
        harness = await serve(model_store=str(store), capture_path="s3://captures/data")
        for _ in range(3):
            assert (await harness.post("/predictions/versioned", "[[0.5]]")).status == 200
        capture = capture_of(harness)
        await wait_until(lambda: capture.written == 3)
        client = s3.client()
        keys = [o["Key"] for o in client.list_objects_v2(Bucket="captures")["Contents"]]
        assert all(k.startswith("data/versioned/2/") and k.endswith(".jsonl") for k in keys)
        records = [
            json.loads(line)
            for key in keys
            for line in client.get_object(Bucket="captures", Key=key)["Body"].read().splitlines()
        ]
        assert len(records) == 3 and all(set(r) == SAGEMAKER_KEYS for r in records)
