"""Prometheus metrics, on a registry passed in (never the process-global one).

Names and labels are fixed by the design (§10). Labels are ``model`` (plus ``code`` and
``direction`` where stated, and ``role`` and ``process`` on the ``process_*`` families of
:mod:`mmserver.ops.procmetrics`); never a request id. A model has series of its own only while it is
loaded (or its failed load is remembered), and only in the families that the
``metrics_model_label`` option gives the label (:class:`Metrics`), so the series are bounded by
the loaded models, not by the store; the other families count every model together, and each
histogram always has its server-wide series.

A server with 1,000 loaded models exposes ~60,000 series. prometheus-client spends ~8 µs per
series on a scrape (collecting sample objects, then formatting them), which is ~0.5 s of CPU on a
2-core machine every scrape, and a tail-latency spike for every request that meets it. So values
live in plain slotted objects updated by the event loop (no locks: one writer), and
:meth:`Metrics.render` writes the text format directly from them with label strings prepared
once per series, ~15 times faster. The same values are also exposed to the prometheus-client
registry through a collector, so any client tooling (``get_sample_value``, ``generate_latest``)
sees them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from mmserver.ops.procmetrics import ProcessMetrics
from mmserver.ops.recent import Recent
from mmserver.ops.series import (
    CounterChild,
    CounterFamily,
    FamiliesCollector,
    Family,
    GaugeFamily,
    HistogramFamily,
)

# Latency buckets from 0.5 ms to 60 s (an ad bidder's budget is 20 ms, SageMaker's limit 60 s),
# few enough that a scrape of 1,000 models stays small: every bucket is a series per model.
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0, 60.0)
_BATCH = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_LOAD = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ENV_BUILD = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


#: The ``reason`` label values of ``mmserver_model_load_failures_total``.
LOAD_FAILURE_REASONS = ("untrusted", "version_skew", "environment", "error")


#: The choices of the ``metrics_model_label`` option: which per-model families carry the
#: ``model`` label.
MODEL_LABEL_CHOICES = ("all", "requests", "none")
#: The model label of what did not reach a model (an unknown name, a refused request).
UNRESOLVED = "-"


class ModelRequests:
    """One model's series of answered requests, which the HTTP layer counts each answer in
    (looked up once, when the model loads, not per request)."""

    __slots__ = (
        "_answered",
        "_by_tenant",
        "_requests",
        "_seconds",
        "answered_total",
        "failed_total",
        "model",
        "recent",
    )

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.model = model
        #: Its requests answered (200) and failed since it loaded, and its answer times over
        #: the last minute (the status page's).
        self.answered_total = 0
        self.failed_total = 0
        self.recent = Recent()
        self._requests = metrics.requests
        self._answered = None if metrics.tenant_label else metrics.requests.labels(model, "200")
        #: Its 200 series of each tenant (with tenants).
        self._by_tenant: dict[str, CounterChild] = {}
        self._seconds = metrics.request_seconds.labels(model)

    def answered(self, seconds: float, tenant: str = UNRESOLVED) -> None:
        """Count one request of ``tenant`` (with tenants configured) answered 200 after
        ``seconds`` in the server."""
        answered = self._answered
        if answered is None:
            answered = self._by_tenant.get(tenant)
            if answered is None:
                answered = self._by_tenant[tenant] = self._requests.labels(
                    self.model, "200", tenant
                )
        answered.value += 1.0  # inc(), without its call: on every answer's way
        self._seconds.observe(seconds)
        self.answered_total += 1
        self.recent.add(seconds)

    def failed(self) -> None:
        """Count one request of the model that was answered with an error."""
        self.failed_total += 1


class Metrics:
    """Every metric family of the server; registered on ``registry`` through one collector.

    ``model_label`` chooses which per-model families carry the ``model`` label: ``all`` of
    them, only ``mmserver_requests_total`` (``requests``), or ``none``; the others count every
    model in one series. A model has labelled series only between :meth:`open_model` and
    :meth:`forget_model` (the WorkLoadManager opens them when a load begins and forgets them
    at unload), so the series are bounded by the models loaded, not by the store.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        model_label: str = "all",
        *,
        tenant_label: bool = False,
    ) -> None:
        if model_label not in MODEL_LABEL_CHOICES:
            raise ValueError(
                f"model_label={model_label!r} must be one of {', '.join(MODEL_LABEL_CHOICES)}"
            )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_label = model_label
        self._live: set[str] = {UNRESOLVED}
        every = model_label == "all"
        live = self._live
        #: ``mmserver_requests_total`` has a ``tenant`` label (the server has tenants).
        self.tenant_label = tenant_label
        self.requests = CounterFamily(
            "mmserver_requests",
            "Requests answered, by model and status code"
            + (" and tenant." if tenant_label else "."),
            ["model", "code", "tenant"] if tenant_label else ["model", "code"],
            models=live,
            labelled=model_label != "none",
        )
        self.request_seconds = HistogramFamily(
            "mmserver_request_seconds",
            "Time in the server, request read to response.",
            ["model"],
            _LATENCY,
            models=live,
            labelled=every,
        )
        self.queue_wait_seconds = HistogramFamily(
            "mmserver_queue_wait_seconds",
            "Time a job waited in its model's queue.",
            ["model"],
            _LATENCY,
            models=live,
            labelled=every,
        )
        self.batch_size = HistogramFamily(
            "mmserver_batch_size",
            "Jobs per predict call.",
            ["model"],
            _BATCH,
            models=live,
            labelled=every,
        )
        self.predict_seconds = HistogramFamily(
            "mmserver_predict_seconds",
            "Time of one batch in the backend, send to answer.",
            ["model"],
            _LATENCY,
            models=live,
            labelled=every,
        )
        self.queue_length = GaugeFamily(
            "mmserver_queue_length",
            "Jobs waiting in a model's queue.",
            ["model"],
            models=live,
            labelled=every,
        )
        self.workers = GaugeFamily(
            "mmserver_workers", "Workers of a model.", ["model"], models=live, labelled=every
        )
        self.worker_scale = CounterFamily(
            "mmserver_worker_scale",
            "Worker scale events.",
            ["model", "direction"],
            models=live,
            labelled=every,
        )
        self.models_loaded = GaugeFamily("mmserver_models_loaded", "Models loaded now.")
        self.model_memory_bytes = GaugeFamily(
            "mmserver_model_memory_bytes", "Memory accounted to loaded models."
        )
        self.backend_unaccounted_bytes = GaugeFamily(
            "mmserver_backend_unaccounted_bytes",
            "Memory the backend processes hold beyond their start and their models' measured "
            "loads (what predictions keep, a leak): counted against the budget with the models.",
        )
        self.memory_budget_bytes = GaugeFamily(
            "mmserver_memory_budget_bytes",
            "The memory budget the loaded models and the backends' unaccounted memory must fit "
            "in; past it, idle models are evicted.",
        )
        self.model_loads = CounterFamily("mmserver_model_loads", "Model loads.")
        self.model_version_skew_loads = CounterFamily(
            "mmserver_model_version_skew_loads",
            "Models loaded across a minor version gap of scikit-learn (on_version_skew=warn): "
            "served as this version reads them.",
        )
        self.model_load_failures = CounterFamily(
            "mmserver_model_load_failures",
            "Model loads that failed, by reason: untrusted (the model's files need more trust "
            "than the server's trusted_types and trusted_models give them), version_skew (a "
            "pickle made by another minor version of scikit-learn, on_version_skew=refuse), "
            "environment (its requirement set could not be installed) or error.",
            ["reason"],
        )
        for reason in LOAD_FAILURE_REASONS:
            self.model_load_failures.labels(reason)
        self.model_evictions = CounterFamily(
            "mmserver_model_evictions", "Models unloaded to make room."
        )
        self.model_load_seconds = HistogramFamily(
            "mmserver_model_load_seconds", "Time to load a model.", (), _LOAD
        )
        self.env_builds = CounterFamily(
            "mmserver_env_builds",
            "Model environments built (a requirement set the server's own environment does "
            "not meet), by the tool that built them: uv or pip.",
            ["tool"],
        )
        self.env_build_failures = CounterFamily(
            "mmserver_env_build_failures",
            "Model environment builds that failed (a requirement that cannot be installed, or "
            "past env_build_timeout_s).",
        )
        self.env_build_seconds = HistogramFamily(
            "mmserver_env_build_seconds", "Time to build a model environment.", (), _ENV_BUILD
        )
        self.backend_restarts = CounterFamily(
            "mmserver_backend_restarts",
            "Backend processes replaced after dying, or for holding more than their share of "
            "the memory budget beyond their models; by the model whose batch or load the "
            "process was running (- for none).",
            ["model"],
            models=live,
            labelled=every,
        )
        self.model_cpu_seconds = CounterFamily(
            "mmserver_model_cpu_seconds",
            "CPU seconds the model's batches took in the backends.",
            ["model"],
            models=live,
            labelled=every,
        )
        self.model_waited_batches = CounterFamily(
            "mmserver_model_waited_batches",
            "Batches of other models that ran on a backend while one of this model's waited.",
            ["model"],
            models=live,
            labelled=every,
        )
        self.model_path_batches = CounterFamily(
            "mmserver_model_path_batches",
            "Batches of the model by the predict path they took (own, linear, treelite, native).",
            ["model", "path"],
            models=live,
            labelled=every,
        )
        self.model_lane = GaugeFamily(
            "mmserver_model_lane",
            "1 on the lane (light or heavy) the loaded model's batches run in; without the "
            "model label, the loaded models in each lane.",
            ["model", "lane"],
            models=live,
            labelled=every,
        )
        self.model_lane_moves = CounterFamily(
            "mmserver_model_lane_moves",
            "Moves of the model between the light and the heavy lane, its measured cost calling "
            "for the other.",
            ["model"],
            models=live,
            labelled=every,
        )
        self.heavy_lane_cpus = GaugeFamily(
            "mmserver_heavy_lane_cpus",
            "CPUs the heavy lane's processes may run on now: all of the server's while the light "
            "lane is idle, fewer (heavy_reserved_cpus kept free) while it has work.",
        )
        self.async_requests = CounterFamily(
            "mmserver_async_requests",
            "Asynchronous requests accepted, and ended by status (done, failed, expired).",
            ["status"],
        )
        self.async_backlog = GaugeFamily(
            "mmserver_async_backlog",
            "Asynchronous requests queued and not started, by model (SageMaker's "
            "ApproximateBacklogSize).",
            ["model"],
        )
        self.async_yields = CounterFamily(
            "mmserver_async_yields",
            "Times queued asynchronous requests were held back for real-time requests "
            "(queued, or keeping the event loop busy).",
        )
        self.async_paced = CounterFamily(
            "mmserver_async_paced",
            "Asynchronous calls whose acceptance waited its turn because real-time requests "
            "kept the event loop busy.",
        )
        self.shadow_comparisons = CounterFamily(
            "mmserver_shadow_comparisons",
            "Requests also run on their model's shadow version, by how its answer compared: "
            "same, different, error (the shadow failed), skipped (too many shadow runs).",
            ["model", "result"],
        )
        self.capture_dropped = CounterFamily(
            "mmserver_capture_dropped",
            "Captured requests not written: the capture buffer was full, or the write failed.",
        )
        self.async_oldest_seconds = GaugeFamily(
            "mmserver_async_oldest_queued_seconds",
            "Age of the oldest queued asynchronous request (0: none queued).",
        )
        self._families: list[Family[Any]] = [
            value for value in vars(self).values() if isinstance(value, Family)
        ]
        self._per_model = [f for f in self._families if f.per_model and f.labelled]
        self.registry.register(FamiliesCollector(self._families))
        #: ``process_*`` of the frontend and the backends (:mod:`mmserver.ops.procmetrics`).
        self.processes = ProcessMetrics()
        self.registry.register(self.processes)

    def families(self) -> list[Family[Any]]:
        """Every family, in the order the exposition lists them."""
        return list(self._families)

    def backend_restarted(self, model: str = UNRESOLVED) -> None:
        """Count one backend process replaced while it was running ``model``'s batch or load
        (counted under ``-`` when none, or when the model has no series of its own)."""
        self.backend_restarts.labels(model if model in self._live else UNRESOLVED).inc()

    def open_model(self, model: str) -> None:
        """Let ``model`` have series of its own (a load of it begins)."""
        self._live.add(model)

    def forget_model(self, model: str) -> None:
        """Remove every series of ``model`` (it was unloaded, or its failed load is no longer
        remembered); what it counted stays in the server's histograms."""
        if model == UNRESOLVED:
            return
        self._live.discard(model)
        for family in self._per_model:
            family.forget(model)

    def model_series(self) -> int:
        """Children labelled with a model name, over every family (a histogram counts once;
        for tests and the bench)."""
        return sum(len(f) for f in self._per_model)

    @property
    def live_models(self) -> int:
        """Models that may have series now (the unresolved label not counted)."""
        return len(self._live) - 1

    def render(self) -> bytes:
        """The text exposition (version 0.0.4). CPU work proportional to the series: call it in
        a thread for large servers."""
        out: list[str] = []
        for family in self._families:
            family.render(out)
        self.processes.render(out)
        return "".join(out).encode()
