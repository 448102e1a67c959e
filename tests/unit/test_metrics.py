"""The metrics' own text exposition says exactly what prometheus-client says of the same values."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmserver.ops.metrics import MODEL_LABEL_CHOICES, Metrics


def samples(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def filled(model_label: str = "all") -> Metrics:
    m = Metrics(model_label=model_label)
    for i in range(50):
        model = f"sklearn-{i}"
        m.open_model(model)
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
        m.model_path_batches.labels(model, "linear").inc()
        m.model_cpu_seconds.labels(model).inc(0.01)
        m.model_waited_batches.labels(model).inc()
        m.model_lane.labels(model, "light").set(1)
        m.model_lane_moves.labels(model).inc()
        m.model_loads.inc()
        m.backend_restarted(model)
    m.models_loaded.set(50)
    m.model_memory_bytes.set(123456789)
    m.model_load_seconds.observe(0.02)
    m.heavy_lane_cpus.set(1)
    return m


@pytest.mark.parametrize("model_label", MODEL_LABEL_CHOICES)
def test_render_matches_prometheus_client(model_label: str) -> None:
    m = filled(model_label)
    m.forget_model("sklearn-7")
    m.backend_restarted("not-loaded")
    ours = m.render().decode()
    theirs = generate_latest(m.registry).decode()
    # The process_* values are read live at each rendering (the CPU seconds move between two).
    assert [s for s in samples(ours) if not s[0].startswith("process_")] == [
        s for s in samples(theirs) if not s[0].startswith("process_")
    ]
    assert [s[:2] for s in samples(ours) if s[0].startswith("process_")] == [
        s[:2] for s in samples(theirs) if s[0].startswith("process_")
    ]
    assert "# TYPE mmserver_requests_total counter" in ours
    # A restart is counted under the model it was running, or under "-" for a model without
    # series of its own.
    if model_label == "all":
        assert 'mmserver_backend_restarts_total{model="sklearn-3"} 1.0\n' in ours
        assert 'mmserver_backend_restarts_total{model="-"} 1.0\n' in ours
    else:
        assert "mmserver_backend_restarts_total 51.0\n" in ours


def test_the_asynchronous_families_render_as_prometheus_client_says() -> None:
    m = Metrics()
    m.async_requests.labels("done").inc(3)
    m.async_backlog.labels("sklearn-1").set(4)
    m.async_oldest_seconds.set(2.5)
    ours = samples(m.render().decode())
    assert [s for s in ours if s[0].startswith("mmserver_async")] == [
        s
        for s in samples(generate_latest(m.registry).decode())
        if s[0].startswith("mmserver_async")
    ]
    assert ("mmserver_async_backlog", (("model", "sklearn-1"),), 4.0) in ours
    assert ("mmserver_async_requests_total", (("status", "done"),), 3.0) in ours


def test_every_family_of_the_design_is_exposed() -> None:
    names = {f.name for f in text_string_to_metric_families(Metrics().render().decode())}
    assert names == {
        "mmserver_requests",
        "mmserver_request_seconds",
        "mmserver_queue_wait_seconds",
        "mmserver_model_load_failures",
        "mmserver_batch_size",
        "mmserver_predict_seconds",
        "mmserver_queue_length",
        "mmserver_workers",
        "mmserver_worker_scale",
        "mmserver_models_loaded",
        "mmserver_model_memory_bytes",
        "mmserver_model_loads",
        "mmserver_model_version_skew_loads",
        "mmserver_backend_unaccounted_bytes",
        "mmserver_memory_budget_bytes",
        "mmserver_model_evictions",
        "mmserver_model_load_seconds",
        "mmserver_env_builds",
        "mmserver_env_build_failures",
        "mmserver_env_build_seconds",
        "mmserver_backend_restarts",
        "mmserver_model_cpu_seconds",
        "mmserver_model_waited_batches",
        "mmserver_model_lane",
        "mmserver_model_lane_moves",
        "mmserver_model_path_batches",
        "mmserver_heavy_lane_cpus",
        "mmserver_async_requests",
        "mmserver_async_backlog",
        "mmserver_async_yields",
        "mmserver_async_paced",
        "mmserver_async_oldest_queued_seconds",
        "mmserver_shadow_comparisons",
        "mmserver_capture_dropped",
        "process_resident_memory_bytes",
        "process_cpu_seconds",
        "process_open_fds",
    }


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    m = Metrics()
    m.open_model("a")
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
    m.open_model('we"ird\\name\n')
    m.requests.labels('we"ird\\name\n', "200").inc()
    (sample,) = [
        s
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
        if s.name == "mmserver_requests_total"
    ]
    assert sample.labels["model"] == 'we"ird\\name\n'


def test_forget_model_removes_every_series_of_the_model() -> None:
    m = filled()
    before = m.model_series()
    m.forget_model("sklearn-3")
    text = m.render().decode()
    assert 'model="sklearn-3"' not in text
    assert 'model="sklearn-4"' in text
    assert m.model_series() == before - before // 50
    # Its requests stay in the server's histogram: 50 observations, one per model.
    assert m.registry.get_sample_value("mmserver_request_seconds_count") == 50
    for i in range(50):
        m.forget_model(f"sklearn-{i}")
    assert m.model_series() == 0 and m.live_models == 0
    assert m.registry.get_sample_value("mmserver_request_seconds_count") == 50
    assert m.registry.get_sample_value("mmserver_batch_size_count") == 50


def test_a_model_that_is_not_open_has_no_series() -> None:
    m = Metrics()
    m.requests.labels("never-loaded", "500").inc()
    m.request_seconds.labels("never-loaded").observe(0.1)
    assert m.model_series() == 0
    assert "never-loaded" not in m.render().decode()
    m.requests.labels("-", "404").inc()  # what reached no model has its series always
    assert m.registry.get_sample_value("mmserver_requests_total", {"model": "-", "code": "404"})


@pytest.mark.parametrize(
    ("model_label", "labelled"),
    [
        (
            "all",
            {
                "mmserver_requests",
                "mmserver_request_seconds",
                "mmserver_queue_wait_seconds",
                "mmserver_batch_size",
                "mmserver_predict_seconds",
                "mmserver_queue_length",
                "mmserver_workers",
                "mmserver_worker_scale",
                "mmserver_model_cpu_seconds",
                "mmserver_model_waited_batches",
                "mmserver_model_path_batches",
                "mmserver_model_lane",
                "mmserver_model_lane_moves",
                "mmserver_backend_restarts",
            },
        ),
        ("requests", {"mmserver_requests"}),
        ("none", set()),
    ],
)
def test_the_option_chooses_the_families_with_a_model_label(
    model_label: str, labelled: set[str]
) -> None:
    m = filled(model_label)
    families = list(text_string_to_metric_families(m.render().decode()))
    with_model = {f.name for f in families if any("model" in s.labels for s in f.samples)}
    assert with_model == labelled
    assert {f.name for f in families} == {
        f.name for f in text_string_to_metric_families(Metrics().render().decode())
    }
    # Per model: 2 request counters (codes 200 and 503) and, with all, 3 latency histograms
    # of 15 samples, the batch size's 11, 2 scale counters and 8 single series.
    per_model = {"all": 2 + 3 * 15 + 11 + 2 + 8, "requests": 2, "none": 0}[model_label]
    samples = [s for f in families for s in f.samples if s.labels.get("model", "-") != "-"]
    assert len(samples) == 50 * per_model
    assert m.model_series() == 50 * {"all": 16, "requests": 2, "none": 0}[model_label]
    # Server-wide histograms are always there, unlabelled, counting every model.
    for name in (
        "mmserver_request_seconds",
        "mmserver_queue_wait_seconds",
        "mmserver_batch_size",
        "mmserver_predict_seconds",
    ):
        assert m.registry.get_sample_value(f"{name}_count") == 50, name
    assert m.registry.get_sample_value("mmserver_model_loads_total") == 50
    if model_label == "none":
        assert m.registry.get_sample_value("mmserver_requests_total", {"code": "503"}) == 50
        assert m.registry.get_sample_value("mmserver_workers") == 2


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="model_label='some' must be one of all, requests, none"):
        Metrics(model_label="some")
