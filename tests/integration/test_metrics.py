"""``GET /metrics`` over real HTTP: the fixed names and labels, and values that move."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gate import Gate
from tests.integration.harness import Harness, Serve, hold_gate, wait_until

FAMILIES = {
    "mmserver_requests": "counter",
    "mmserver_request_seconds": "histogram",
    "mmserver_queue_wait_seconds": "histogram",
    "mmserver_batch_size": "histogram",
    "mmserver_predict_seconds": "histogram",
    "mmserver_queue_length": "gauge",
    "mmserver_workers": "gauge",
    "mmserver_worker_scale": "counter",
    "mmserver_models_loaded": "gauge",
    "mmserver_model_memory_bytes": "gauge",
    "mmserver_model_loads": "counter",
    "mmserver_model_evictions": "counter",
    "mmserver_model_load_seconds": "histogram",
    "mmserver_backend_restarts": "counter",
    "mmserver_model_cpu_seconds": "counter",
    "mmserver_model_waited_batches": "counter",
    "mmserver_model_lane": "gauge",
    "mmserver_model_path_batches": "counter",
    "mmserver_model_load_failures": "counter",
}


@pytest.fixture
async def server(serve: Serve) -> Harness:
    """A server whose every per-model family carries the model label."""
    return await serve(metrics_model_label="all")


def requests(model: str, code: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("mmserver_requests_total", (("code", str(code)), ("model", model)))


def labelled(name: str, model: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, (("model", model),))


async def test_exposition_format_and_families(server: Harness) -> None:
    assert (await server.post("/predictions/sklearn-0", "[[0.5]]")).status == 200
    response = await server.client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in FAMILIES} == FAMILIES
    assert "# TYPE mmserver_requests_total counter" in text
    # The reference model's one batch took the linear product.
    assert 'mmserver_model_path_batches_total{model="sklearn-0",path="linear"} 1.0' in text
    for family in families.values():
        for sample in family.samples:
            labels = {"model", "code", "direction", "lane", "path", "le", "role", "process"}
            labels.add("reason")
            assert set(sample.labels) <= labels, sample


async def test_request_counters_and_latency_move(server: Harness) -> None:
    before = await server.samples()
    assert requests("sklearn-1", 200) not in before
    for _ in range(3):
        assert (await server.post("/predictions/sklearn-1", "[[0.5]]")).status == 200
    assert (await server.post("/predictions/sklearn-1.tar.gz", "[[0.5]]")).status == 200
    assert (await server.post("/predictions/sklearn-1", "[[0.5, 1.0]]")).status == 400

    after = await server.samples()
    assert after[requests("sklearn-1", 200)] == 4.0
    assert after[requests("sklearn-1", 400)] == 1.0
    assert after[labelled("mmserver_request_seconds_count", "sklearn-1")] == 5.0
    assert 0 < after[labelled("mmserver_request_seconds_sum", "sklearn-1")] < 5.0
    # Five batches: the request with two features is refused by its backend, where bodies are
    # decoded, so it went through the queue like the others.
    assert after[labelled("mmserver_predict_seconds_count", "sklearn-1")] == 5.0
    assert after[labelled("mmserver_queue_wait_seconds_count", "sklearn-1")] == 5.0
    assert after[labelled("mmserver_batch_size_count", "sklearn-1")] == 5.0
    assert after[("mmserver_model_loads_total", ())] == 1.0
    assert after[labelled("mmserver_workers", "sklearn-1")] == 1.0
    assert after[labelled("mmserver_queue_length", "sklearn-1")] == 0.0
    assert after[("mmserver_models_loaded", ())] == 1.0
    assert after[("mmserver_model_memory_bytes", ())] > 0


async def test_models_loaded_and_unloads_move(server: Harness) -> None:
    for name in ("sklearn-2", "sklearn-3", "iris-classifier"):
        body = "[[1, 2, 3, 4]]" if name == "iris-classifier" else "[[0.5]]"
        assert (await server.post(f"/predictions/{name}", body)).status == 200
    assert (await server.samples())[("mmserver_models_loaded", ())] == 3.0
    assert (await server.client.delete("/models/sklearn-2")).status == 200
    after = await server.samples()
    assert after[("mmserver_models_loaded", ())] == 2.0
    assert after[("mmserver_model_loads_total", ())] == 3.0
    # The unloaded model's series are gone; what it counted stays in the server's histograms.
    assert "sklearn-2" not in {dict(labels).get("model") for _, labels in after}
    assert {dict(labels).get("model") for _, labels in after} == {
        None,
        "sklearn-3",
        "iris-classifier",
    }
    assert after[("mmserver_request_seconds_count", ())] == 3.0
    assert after[("mmserver_predict_seconds_count", ())] == 3.0


async def test_series_of_evicted_models_are_removed(serve: Serve) -> None:
    server = await serve(metrics_model_label="all", max_loaded_models=2)
    for i in range(6):
        assert (await server.post(f"/predictions/sklearn-{10 + i}", "[[0.5]]")).status == 200
    samples = await server.samples()
    assert {dict(labels).get("model") for _, labels in samples} == {
        None,
        "sklearn-14",
        "sklearn-15",
    }
    assert samples[("mmserver_model_evictions_total", ())] == 4.0
    assert samples[("mmserver_request_seconds_count", ())] == 6.0
    assert server.metrics.model_series() == 2 * 13  # 13 labelled children a loaded model


@pytest.mark.parametrize(
    ("option", "families"),
    [
        ("requests", {"mmserver_requests_total"}),
        ("none", set()),
    ],
)
async def test_the_option_chooses_the_labelled_families(
    serve: Serve, option: str, families: set[str]
) -> None:
    server = await serve(metrics_model_label=option)
    for _ in range(2):
        assert (await server.post("/predictions/sklearn-5", "[[0.5]]")).status == 200
    assert (await server.post("/predictions/sklearn-5", "[[1, 2]]")).status == 400
    samples = await server.samples()
    with_model = {name for name, labels in samples if dict(labels).get("model") == "sklearn-5"}
    assert with_model == families
    if option == "requests":
        assert samples[requests("sklearn-5", 200)] == 2.0
        assert samples[requests("sklearn-5", 400)] == 1.0
    else:
        assert samples[("mmserver_requests_total", (("code", "200"),))] == 2.0
    assert samples[("mmserver_request_seconds_count", ())] == 3.0
    assert samples[("mmserver_predict_seconds_count", ())] == 3.0
    assert samples[("mmserver_workers", ())] == 1.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 1.0
    assert (await server.client.delete("/models/sklearn-5")).status == 200
    samples = await server.samples()
    assert not [name for name, labels in samples if dict(labels).get("model") == "sklearn-5"]
    assert samples[("mmserver_workers", ())] == 0.0


async def test_unresolved_requests_share_one_series(server: Harness) -> None:
    """Unknown or invalid names and refused requests never create a series of their own; a bad
    body sent to a model of the store is that model's (it is decoded where the model runs)."""
    for _ in range(20):
        name = f"unknown-{uuid.uuid4().hex}"
        assert (await server.post(f"/predictions/{name}", "[[0.5]]")).status == 404
    assert (await server.post("/predictions/-invalid-", "[[0.5]]")).status == 400
    assert (await server.post("/predictions/sklearn-4", "[[", "application/json")).status == 400
    assert (await server.post("/predictions/sklearn-4", "[[0.5]]", "text/xml")).status == 415
    assert (await server.post("/invocations", "[[0.5]]")).status == 400

    samples = await server.samples()
    assert samples[requests("-", 404)] == 20.0
    assert samples[requests("-", 400)] == 2.0
    assert samples[requests("sklearn-4", 400)] == 1.0
    assert samples[requests("-", 415)] == 1.0
    models = {dict(labels).get("model") for _, labels in samples}
    assert models <= {None, "-", "sklearn-4"}


async def test_model_errors_are_counted_under_the_model(server: Harness) -> None:
    assert (await server.post("/predictions/raising-handler", "[[0.5]]")).status == 424
    assert (await server.post("/predictions/broken-model", "[[0.5]]")).status == 500
    samples = await server.samples()
    assert samples[requests("raising-handler", 424)] == 1.0
    assert samples[requests("broken-model", 500)] == 1.0


async def test_scrape_answers_while_a_prediction_runs(server: Harness, gate: Gate) -> None:
    running = await hold_gate(server, gate, "/predictions/gated-handler")
    samples = await asyncio.wait_for(server.samples(), timeout=5)
    assert samples[labelled("mmserver_workers", "gated-handler")] == 1.0
    assert samples[requests("gated-handler", 200)] == 0.0
    gate.open()
    assert (await running).status == 200
    assert (await server.samples())[requests("gated-handler", 200)] == 1.0


async def test_server_wide_gauges_follow_the_queues_and_workers(serve: Serve, gate: Gate) -> None:
    """Without the model label on them, the queue length and worker gauges count every model's
    queued jobs and workers as they come and go (kept as they change, not walked at a scrape)."""
    server = await serve(metrics_model_label="requests")
    running = await hold_gate(server, gate, "/predictions/gated-handler")
    queued = asyncio.ensure_future(server.post("/predictions/gated-handler", "[[0.5]]"))
    pool = server.wlm.room.loaded.get("gated-handler")
    assert pool is not None
    await wait_until(lambda: len(pool.queue) == 1)
    samples = await server.samples()
    assert samples[("mmserver_queue_length", ())] == 1.0
    assert samples[("mmserver_workers", ())] == 1.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 1.0
    gate.open()
    assert (await running).status == 200
    assert (await queued).status == 200
    assert (await server.post("/predictions/sklearn-1", "[[0.5]]")).status == 200
    samples = await server.samples()
    assert samples[("mmserver_queue_length", ())] == 0.0
    assert samples[("mmserver_workers", ())] == 2.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 2.0
    assert (await server.client.delete("/models/gated-handler")).status == 200
    samples = await server.samples()
    assert samples[("mmserver_workers", ())] == 1.0
    assert samples[("mmserver_model_lane", (("lane", "light"),))] == 1.0
