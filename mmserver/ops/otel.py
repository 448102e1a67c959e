"""Traces exported with the OpenTelemetry SDK, set up from the standard ``OTEL_*`` variables.

Imported only when the environment asks for traces (:func:`mmserver.ops.traces.wanted`): a
server without them never loads OpenTelemetry. The SDK reads its own variables: the sampler
(``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``; by default ``parentbased_always_on``),
the resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``; the service is ``mmserver``
unless named), the exporter's endpoint, headers, timeout and compression
(``OTEL_EXPORTER_OTLP_*``) and the batch processor's queue and delay (``OTEL_BSP_*``).
``OTEL_TRACES_EXPORTER`` names the exporters: ``otlp`` (OTLP over HTTP with protobuf, the
``otel`` extra's), ``console``, or any other the installed packages register.

A request is sampled once, when it arrives (:meth:`Tracing.sampled`): with a ``traceparent``,
the sampler decides with that parent (the SDK's W3C propagator reads it); without one, the
request's trace id is drawn and the sampler's root rule decides on it. An unsampled request
gets ``None`` and nothing else: no span, no context, no dictionary. A sampled one gets a
:class:`~mmserver.ops.traces.Trace`, and its spans are made when it is answered
(:meth:`Tracing.export`), with the times its steps recorded::

    POST /predictions/{model}     the request (SERVER): route, model, version, status, id
    ├── load                      the cold load it waited for, when there was one
    ├── queue                     in its model's queue
    └── batch                     the batch it went in (mmserver.batch.size)
        ├── predict               in the backend process: its pid, the predict path, rows
        └── encode                its answers encoded there

The SDK's sampler decides again when the request's span is made, with the same trace id (or
parent), so it has the last word; the root rule here only spares unsampled requests its call.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import trace as api
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mmserver.errors import ConfigError
from mmserver.ops.traces import TRACEPARENT, TRACESTATE, Door, Passage, Trace

#: The exporters' entry points (as the SDK's own auto-configuration finds them).
_EXPORTERS = "opentelemetry_traces_exporter"
_SAMPLED = Decision.RECORD_AND_SAMPLE
_KINDS = {
    "server": api.SpanKind.SERVER,
    "consumer": api.SpanKind.CONSUMER,
    "internal": api.SpanKind.INTERNAL,
}


class ChosenIds(IdGenerator):
    """Random ids, except the ids a request's span was given when the request was sampled
    (its trace id is the one the sampler decided on; its span id is in the ``traceparent``
    it handed on). Set just before the span is made, on the event loop, taken by it."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        chosen, self.trace_id = self.trace_id, 0
        return chosen or self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        chosen, self.span_id = self.span_id, 0
        return chosen or self._random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return True


def _root_rule(sampler: Sampler) -> Any:
    """What the sampler decides for a request with no parent, as a test of its trace id: the
    rule itself for the SDK's ratio and constant samplers (also as a parent-based sampler's
    root), the sampler's own call for any other."""
    root = sampler
    if isinstance(sampler, ParentBased):
        root = getattr(sampler, "_root", sampler)
    if isinstance(root, TraceIdRatioBased):
        bound, limit = root.bound, TraceIdRatioBased.TRACE_ID_LIMIT
        return lambda trace_id: trace_id & limit < bound
    if root is ALWAYS_ON:
        return lambda trace_id: True
    if root is ALWAYS_OFF:
        return lambda trace_id: False
    return lambda trace_id: sampler.should_sample(None, trace_id, "request").decision is _SAMPLED


def exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (by default ``otlp``), made by the classes
    their packages register; ``otlp`` is OTLP over HTTP with protobuf unless
    ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` says ``grpc``."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    registered = {e.name: e for e in entry_points(group=_EXPORTERS)}
    made: list[SpanExporter] = []
    for name in filter(None, names):
        if name == "otlp":
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        point = registered.get(name)
        if point is None:
            known = ", ".join(sorted({"otlp", "none", *registered})) or "none"
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={environ.get('OTEL_TRACES_EXPORTER', 'otlp')}: no "
                f"exporter {name!r} is installed (known here: {known}); OTLP over HTTP comes "
                "with pip install 'mmserver[otel]'"
            )
        made.append(point.load()())
    return made


class Tracing:
    """The server's traces: the decision per request and its spans (module docstring). Made
    by :meth:`from_environment`; :meth:`shutdown` sends what is left."""

    def __init__(self, provider: TracerProvider, ids: ChosenIds) -> None:
        self.provider = provider
        self._ids = ids
        self._tracer = provider.get_tracer("mmserver")
        self._sampler = provider.sampler
        self._root = _root_rule(provider.sampler)
        self._propagator = TraceContextTextMapPropagator()
        #: Added to a :func:`time.perf_counter` reading, the wall clock's nanoseconds.
        self._offset = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Tracing:
        """The traces ``environ``'s ``OTEL_*`` variables ask for (module docstring)."""
        made = exporters(environ)
        resource = Resource.create(
            {} if environ.get("OTEL_SERVICE_NAME", "").strip() else {SERVICE_NAME: "mmserver"}
        )
        ids = ChosenIds()
        provider = TracerProvider(resource=resource, id_generator=ids)
        for exporter in made:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, ids)

    def describe(self) -> str:
        """The sampler and where spans go, for the start's log line."""
        return self._sampler.get_description()

    # The decision --------------------------------------------------------------------------

    def sampled(
        self, door: Door, traceparent: str | None, tracestate: str | None = None
    ) -> Trace | None:
        """The trace of a request arriving at ``door`` with these headers, when it is sampled;
        ``None`` when it is not (nothing else is made for it)."""
        if traceparent is not None:
            carrier = {TRACEPARENT: traceparent}
            if tracestate is not None:
                carrier[TRACESTATE] = tracestate
            parent = self._propagator.extract(carrier)
            known = api.get_current_span(parent).get_span_context()
            if known.is_valid:
                decided = self._sampler.should_sample(parent, known.trace_id, door.name)
                if decided.decision is not _SAMPLED:
                    return None
                return Trace(door, parent, known.trace_id, self._new_span_id())
        trace_id = random.getrandbits(128)
        if not trace_id or not self._root(trace_id):
            return None
        return Trace(door, None, trace_id, self._new_span_id())

    def continued(self, door: Door, traceparent: str | None) -> Trace | None:
        """The trace of work that goes on from a request whose span had ``traceparent``
        (stored with it: an asynchronous request from the journal); ``None`` when there is
        none, or it was not sampled."""
        if traceparent is None:
            return None
        trace = self.sampled(door, traceparent)
        if trace is None or trace.parent is None:
            return None
        return trace

    @staticmethod
    def _new_span_id() -> int:
        return random.getrandbits(64) or 1

    def traceparent(self, trace: Trace) -> str:
        """The ``traceparent`` of ``trace``'s own span, for the work it hands on."""
        context = api.SpanContext(
            trace.trace_id,
            trace.span_id,
            is_remote=False,
            trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED),
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, api.set_span_in_context(api.NonRecordingSpan(context)))
        return carrier[TRACEPARENT]

    # The spans -----------------------------------------------------------------------------

    def export(self, trace: Trace, status: int, ended: float | None = None) -> None:
        """Make ``trace``'s spans (module docstring), its request answered ``status`` (an HTTP
        status) at ``ended`` (by default now, on :func:`time.perf_counter`'s clock)."""
        ended = time.perf_counter() if ended is None else ended
        door = trace.door
        attributes = {**door.attributes, **trace.attributes, door.status_key: door.status(status)}
        if trace.parent is None:
            self._ids.trace_id = trace.trace_id
        self._ids.span_id = trace.span_id
        span = self._tracer.start_span(
            door.name,
            trace.parent,
            kind=_KINDS[door.kind],
            attributes=attributes,
            start_time=self._ns(trace.started),
        )
        if status >= door.errors_from:
            span.set_status(api.Status(api.StatusCode.ERROR))
        inside = api.set_span_in_context(span)
        if trace.load is not None:
            self._span("load", inside, *trace.load)
        for passage in trace.passages:
            self._passage(passage, inside, ended)
        span.end(self._ns(ended))

    def _passage(self, passage: Passage, inside: Any, ended: float) -> None:
        """The spans of one job: its wait in the queue, then its batch and what the backend
        did, as far as it went before ``ended``."""
        if not passage.taken:
            self._span("queue", inside, passage.queued, ended)
            return
        self._span("queue", inside, passage.queued, passage.taken)
        batch = self._tracer.start_span(
            "batch",
            inside,
            attributes={"mmserver.batch.size": passage.size},
            start_time=self._ns(passage.taken),
        )
        times = passage.backend
        if times is not None:
            pid, began, predicted, encoded = times
            within = api.set_span_in_context(batch)
            self._span(
                "predict",
                within,
                began,
                predicted,
                {
                    "process.pid": pid,
                    "mmserver.predict.path": passage.path,
                    "mmserver.batch.rows": passage.rows,
                },
            )
            self._span("encode", within, predicted, encoded)
        batch.end(self._ns(passage.answered or ended))

    def _span(
        self,
        name: str,
        inside: Any,
        start: float,
        end: float,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        span = self._tracer.start_span(
            name, inside, attributes=attributes, start_time=self._ns(start)
        )
        span.end(self._ns(max(start, end)))

    def _ns(self, at: float) -> int:
        return int(at * 1e9) + self._offset

    def shutdown(self) -> None:
        """Send the spans not sent yet, and stop (blocks: the exporters' last calls)."""
        self.provider.shutdown()
