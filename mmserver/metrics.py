"""Prometheus metrics, on a registry passed in (never the process-global one).

Names and labels are fixed by the design (§10). Labels are ``model`` (plus ``code`` and
``direction`` where stated); never a request id, so the series count stays bounded by the number
of models.
"""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# Latency buckets from 0.5 ms to 60 s (an ad bidder's budget is 20 ms, SageMaker's limit 60 s),
# few enough that a scrape of 1,000 models stays cheap: every bucket is a series per model.
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0, 60.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
_SCRAPE_SWITCH_INTERVAL = 0.0005
_LOAD = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Every metric family of the server, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmserver_requests", "Requests answered, by model and status code.",
            ["model", "code"], registry=r,
        )
        self.request_seconds = Histogram(
            "mmserver_request_seconds", "Time in the server, request read to response.",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "mmserver_queue_wait_seconds", "Time a job waited in its model's queue.",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.batch_size = Histogram(
            "mmserver_batch_size", "Jobs per predict call.", ["model"], buckets=_BATCH, registry=r,
        )
        self.predict_seconds = Histogram(
            "mmserver_predict_seconds", "Time of one batch in the backend, send to answer.",
            ["model"], buckets=_LATENCY, registry=r,
        )
        self.queue_length = Gauge(
            "mmserver_queue_length", "Jobs waiting in a model's queue.", ["model"], registry=r,
        )
        self.workers = Gauge(
            "mmserver_workers", "Workers of a model.", ["model"], registry=r,
        )
        self.worker_scale = Counter(
            "mmserver_worker_scale", "Worker scale events.", ["model", "direction"], registry=r,
        )
        self.models_loaded = Gauge(
            "mmserver_models_loaded", "Models loaded now.", registry=r,
        )
        self.model_memory_bytes = Gauge(
            "mmserver_model_memory_bytes", "Memory accounted to loaded models.", registry=r,
        )
        self.model_loads = Counter(
            "mmserver_model_loads", "Model loads.", ["model"], registry=r,
        )
        self.model_evictions = Counter(
            "mmserver_model_evictions", "Models unloaded to make room.", ["model"], registry=r,
        )
        self.model_load_seconds = Histogram(
            "mmserver_model_load_seconds", "Time to load a model.", buckets=_LOAD, registry=r,
        )
        self.backend_restarts = Counter(
            "mmserver_backend_restarts", "Backend processes replaced after dying.", registry=r,
        )

    def forget_model(self, model: str) -> None:
        """Drop a model's gauges when it unloads (counters and histograms keep their history)."""
        for gauge in (self.queue_length, self.workers):
            try:
                gauge.remove(model)
            except KeyError:
                pass

    def render(self) -> bytes:
        """The text exposition. CPU work: call it in a thread, not on the event loop.

        While it runs, the interpreter hands the GIL back to the event loop's thread every
        0.5 ms instead of every 5 ms, so a scrape of many models delays requests by fractions of
        a millisecond rather than by milliseconds.
        """
        previous = sys.getswitchinterval()
        sys.setswitchinterval(min(previous, _SCRAPE_SWITCH_INTERVAL))
        try:
            return generate_latest(self.registry)
        finally:
            sys.setswitchinterval(previous)
