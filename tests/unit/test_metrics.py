"""The metrics' own text exposition says exactly what prometheus-client says of the same values."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmserver.metrics import Metrics


def samples(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def filled() -> Metrics:
    m = Metrics()
    for i in range(50):
        model = f"sklearn-{i}"
        m.requests.labels(model, "200").inc(i + 1)
        m.requests.labels(model, "503").inc()
        m.request_seconds.labels(model).observe(0.003 * i)
        m.queue_wait_seconds.labels(model).observe(0.0001)
        m.batch_size.labels(model).observe(1 + i % 40)
        m.predict_seconds.labels(model).observe(0.002)
        m.queue_length.labels(model).set(i)
        m.workers.labels(model).set(2)
        m.worker_scale.labels(model, "up").inc(2)
        m.worker_scale.labels(model, "down").inc()
        m.model_loads.labels(model).inc()
        m.model_evictions.labels(model).inc()
    m.models_loaded.set(50)
    m.model_memory_bytes.set(123456789)
    m.model_load_seconds.observe(0.02)
    m.backend_restarts.inc()
    return m


def test_render_matches_prometheus_client() -> None:
    m = filled()
    ours = m.render().decode()
    assert samples(ours) == samples(generate_latest(m.registry).decode())
    assert "# TYPE mmserver_requests_total counter" in ours
    assert "mmserver_backend_restarts_total 1.0\n" in ours


def test_every_family_of_the_design_is_exposed() -> None:
    names = {f.name for f in text_string_to_metric_families(Metrics().render().decode())}
    assert names == {
        "mmserver_requests", "mmserver_request_seconds", "mmserver_queue_wait_seconds",
        "mmserver_batch_size", "mmserver_predict_seconds", "mmserver_queue_length",
        "mmserver_workers", "mmserver_worker_scale", "mmserver_models_loaded",
        "mmserver_model_memory_bytes", "mmserver_model_loads", "mmserver_model_evictions",
        "mmserver_model_load_seconds", "mmserver_backend_restarts",
        "mmserver_model_cpu_seconds", "mmserver_model_waited_batches", "mmserver_model_lane",
        "mmserver_model_path_batches",
    }


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    m = Metrics()
    child = m.batch_size.labels("a")
    for value in (1, 2, 3, 200):
        child.observe(value)
    got = {
        s.labels["le"]: s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
        if s.name == "mmserver_batch_size_bucket"
    }
    assert got["1.0"] == 1  # le is "less than or equal"
    assert got["2.0"] == 2
    assert got["4.0"] == 3
    assert got["128.0"] == 3
    assert got["+Inf"] == 4
    assert m.registry.get_sample_value("mmserver_batch_size_sum", {"model": "a"}) == 206


def test_label_values_are_escaped() -> None:
    m = Metrics()
    m.requests.labels('we"ird\\name\n', "200").inc()
    (sample,) = [s for f in text_string_to_metric_families(m.render().decode())
                 for s in f.samples if s.name == "mmserver_requests_total"]
    assert sample.labels["model"] == 'we"ird\\name\n'


def test_forget_model_drops_its_gauges_only() -> None:
    m = filled()
    m.forget_model("sklearn-3")
    text = m.render().decode()
    assert 'mmserver_workers{model="sklearn-3"}' not in text
    assert 'mmserver_model_loads_total{model="sklearn-3"} 1.0' in text
