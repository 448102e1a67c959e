"""Data capture: sampled requests and answers written in SageMaker's data capture format, to a
folder and to S3, by a thread fed through a bounded buffer; a shadow that answers differently
captured with both answers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from mmserver.api.web import STATE
from mmserver.ops.capture import ENCODE_BATCH, Capture, Record, hour_folder
from mmserver.ops.metrics import Metrics
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


def record_of(model: str, at: float, rid: str) -> Record:
    return Record(model, at, rid, b"[[1]]", "application/json", b"[2]", "application/json")


def test_lines_of_several_models_and_hours_are_written_in_order(tmp_path: Path) -> None:
    """Records of two models (one with versions) and two hours, more than two batches of
    lines made on the way and the rest made by the writer at close: each file holds its
    records in the order offered, and none is lost."""
    metrics = Metrics()
    capture = Capture(str(tmp_path / "capture"), 10_000, metrics)
    hours = (1_796_115_600.0, 1_796_119_200.0)  # 2026-12-01 09:00 and 10:00 UTC
    models = ("a", "b/2")
    count = 2 * ENCODE_BATCH + 7
    offered: dict[str, list[str]] = {}
    for i in range(count):
        model, at = models[i % 2], hours[(i // 3) % 2] + i
        offered.setdefault(hour_folder(model, at), []).append(f"r-{i}")
        capture.offer(record_of(model, at, f"r-{i}"))
    capture.start()
    capture.close()
    assert sorted(offered) == [
        "a/1/2026/12/01/09",
        "a/1/2026/12/01/10",
        "b/2/2026/12/01/09",
        "b/2/2026/12/01/10",
    ]
    for folder, ids in offered.items():
        [path] = (tmp_path / "capture" / folder).glob("*.jsonl")
        written = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["eventMetadata"]["inferenceId"] for r in written] == ids
        assert all(set(r) == SAGEMAKER_KEYS for r in written)
    assert capture.written == count
    assert metrics.capture_dropped.labels().value == 0


def test_the_buffer_bound_counts_records_in_batches_and_not(tmp_path: Path) -> None:
    """The bound holds whether a waiting record's line is made (a batch) or not yet: past it,
    records are dropped and counted, and the ones kept are written in order."""
    metrics = Metrics()
    bound = ENCODE_BATCH + 10
    capture = Capture(str(tmp_path / "capture"), bound, metrics)
    for i in range(bound + 5):
        capture.offer(record_of("m", 1_796_115_600.0 + i, f"r-{i}"))
    assert metrics.capture_dropped.labels().value == 5
    capture.start()
    capture.close()
    written = lines_under(tmp_path / "capture" / "m" / "1")
    assert [r["eventMetadata"]["inferenceId"] for r in written] == [f"r-{i}" for i in range(bound)]
    assert capture.written == bound
    assert metrics.capture_dropped.labels().value == 5


def test_a_failed_write_drops_and_counts_its_records(tmp_path: Path) -> None:
    """A folder that cannot be made (a file stands in its place): those records are counted
    as dropped, and the other folders' are written."""
    metrics = Metrics()
    root = tmp_path / "capture"
    root.mkdir()
    (root / "blocked").write_text("not a folder")
    capture = Capture(str(root), 10_000, metrics)
    for i in range(ENCODE_BATCH + 3):
        capture.offer(record_of("blocked" if i % 2 else "open", 1_796_115_600.0, f"r-{i}"))
    capture.start()
    capture.close()
    assert len(lines_under(root / "open")) == ENCODE_BATCH // 2 + 2
    assert metrics.capture_dropped.labels().value == ENCODE_BATCH // 2 + 1
    assert capture.written == ENCODE_BATCH // 2 + 2


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
