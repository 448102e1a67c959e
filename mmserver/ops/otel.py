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

import collections
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import threading
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
from mmserver.ops.traces import TRACEPARENT, TRACESTATE, Door, Trace

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

    def __init__(
        self, provider: TracerProvider, ids: ChosenIds, sender: SpanSender | None = None
    ) -> None:
        self.provider = provider
        #: Where the spans are made and exported: a process of their own (``None``: here).
        self._sender = sender
        self._ids = ids
        self._tracer = provider.get_tracer("mmserver")
        self._sampler = provider.sampler
        self._root = _root_rule(provider.sampler)
        self._propagator = TraceContextTextMapPropagator()
        #: Added to a :func:`time.perf_counter` reading, the wall clock's nanoseconds.
        self._offset = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def from_environment(
        cls, environ: Mapping[str, str] = os.environ, *, here: bool = False
    ) -> Tracing:
        """The traces ``environ``'s ``OTEL_*`` variables ask for (module docstring). Their
        spans are made and exported by a process of their own (:class:`SpanSender`), so that
        neither the SDK's span objects nor the exporter's encoding take the event loop's
        process; ``here``: in this process (the exporting process itself)."""
        made = exporters(environ)  # an exporter that is not installed stops the start here
        resource = Resource.create(
            {} if environ.get("OTEL_SERVICE_NAME", "").strip() else {SERVICE_NAME: "mmserver"}
        )
        ids = ChosenIds()
        provider = TracerProvider(resource=resource, id_generator=ids)
        if not here:
            for exporter in made:
                exporter.shutdown()
            return cls(provider, ids, SpanSender(dict(environ)))
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
        status) at ``ended`` (by default now, on :func:`time.perf_counter`'s clock): here, or
        handed to the exporting process as a plain record."""
        ended = time.perf_counter() if ended is None else ended
        door = trace.door
        attributes = {**door.attributes, **trace.attributes, door.status_key: door.status(status)}
        carrier: dict[str, str] | None = None
        if trace.parent is not None:
            carrier = {}
            self._propagator.inject(carrier, trace.parent)
        record: SpanRecord = (
            door.name,
            door.kind,
            attributes,
            status >= door.errors_from,
            carrier,
            trace.trace_id,
            trace.span_id,
            trace.started,
            trace.load,
            [
                (p.queued, p.taken, p.answered, p.size, p.rows, p.path, p.backend)
                for p in trace.passages
            ],
            ended,
        )
        if self._sender is not None:
            self._sender.send(record)
        else:
            self.spans(record)

    def spans(self, record: SpanRecord) -> None:
        """Make one request's spans from its record (:meth:`export`)."""
        name, kind, attributes, error, carrier, trace_id, span_id, started, load, jobs, ended = (
            record
        )
        parent = self._propagator.extract(carrier) if carrier is not None else None
        if parent is None:
            self._ids.trace_id = trace_id
        self._ids.span_id = span_id
        span = self._tracer.start_span(
            name, parent, kind=_KINDS[kind], attributes=attributes, start_time=self._ns(started)
        )
        if error:
            span.set_status(api.Status(api.StatusCode.ERROR))
        inside = api.set_span_in_context(span)
        if load is not None:
            self._span("load", inside, *load)
        for job in jobs:
            self._passage(job, inside, ended)
        span.end(self._ns(ended))

    def _passage(self, job: JobRecord, inside: Any, ended: float) -> None:
        """The spans of one job: its wait in the queue, then its batch and what the backend
        did, as far as it went before ``ended``."""
        queued, taken, answered, size, rows, path, times = job
        if not taken:
            self._span("queue", inside, queued, ended)
            return
        self._span("queue", inside, queued, taken)
        batch = self._tracer.start_span(
            "batch",
            inside,
            attributes={"mmserver.batch.size": size},
            start_time=self._ns(taken),
        )
        if times is not None:
            pid, began, predicted, encoded = times
            within = api.set_span_in_context(batch)
            self._span(
                "predict",
                within,
                began,
                predicted,
                {"process.pid": pid, "mmserver.predict.path": path, "mmserver.batch.rows": rows},
            )
            self._span("encode", within, predicted, encoded)
        batch.end(self._ns(answered or ended))

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
        if self._sender is not None:
            self._sender.close()
        self.provider.shutdown()


#: One job of a request, for its spans: when it was queued, taken in a batch and answered, the
#: batch's size and rows, the predict path and the backend's times (:class:`Passage`).
JobRecord = tuple[float, float, float, int, int, str, Any]
#: One request, for its spans (:meth:`Tracing.export`): its span's name, kind and attributes,
#: whether it failed, the context it continues (its W3C headers; ``None``: a new trace), its
#: ids, when it began, its cold load, its jobs and when it ended.
SpanRecord = tuple[
    str,
    str,
    dict[str, Any],
    bool,
    "dict[str, str] | None",
    int,
    int,
    float,
    Any,
    list[JobRecord],
    float,
]
#: How often the writer thread takes the records held (s).
WRITE_EVERY_S = 0.1
#: The exporting process's niceness.
SPANS_NICE = 10
#: How many records the sender holds at most while the exporting process is behind (more are
#: dropped and counted, as the SDK's own queue does).
MAX_HELD = 20_000


class SpanSender:
    """The exporting process (:func:`serve_spans`), started with the server's ``OTEL_*``
    environment, and a thread that writes it the records :meth:`send` is given, in batches
    (pickled, each after its length), every :data:`WRITE_EVERY_S`. :meth:`send` only appends
    to a deque: the event loop never waits on the pipe, nor wakes the thread."""

    def __init__(self, environ: dict[str, str]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from mmserver.ops.otel import serve_spans; serve_spans()"],
            stdin=subprocess.PIPE,
            env=environ,
        )
        #: Appended by :meth:`send`, taken by the writer (a deque: both ends thread-safe).
        self._held: collections.deque[SpanRecord] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing = False
        self.dropped = 0
        self._writer = threading.Thread(target=self._write, name="mmserver-spans", daemon=True)
        self._writer.start()

    def send(self, record: SpanRecord) -> None:
        if len(self._held) >= MAX_HELD:
            self.dropped += 1
            return
        held = self._held
        held.append(record)
        if len(held) == 1:  # the first since the writer's last turn: it gathers a batch now
            self._wake.set()

    def _write(self) -> None:
        pipe = self._process.stdin
        assert pipe is not None
        held = self._held
        while True:
            # Woken by a first record, it gathers for WRITE_EVERY_S before it writes: the event
            # loop's thread hands the interpreter to this one a few times a second at most, not
            # once per request, and never while no request is sampled.
            self._wake.wait()
            self._wake.clear()
            self._stop.wait(WRITE_EVERY_S)  # cut short by close()
            closing = self._closing
            taken = []
            while held:
                taken.append(held.popleft())
            if taken:
                data = pickle.dumps(taken, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    pipe.write(struct.pack("!I", len(data)) + data)
                    pipe.flush()
                except OSError:
                    return  # the exporting process is gone: its spans with it
            if closing and not held:
                return

    def close(self, timeout: float = 30.0) -> None:
        """Write what is held, then let the exporting process send it and end (killed past
        ``timeout`` seconds)."""
        self._closing = True
        self._stop.set()
        self._wake.set()
        self._writer.join(timeout)
        if self._process.stdin is not None:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def serve_spans() -> None:
    """The exporting process: make the spans of the records read from stdin, export them as
    the ``OTEL_*`` variables say, and at the end of stdin send what is left and end."""
    import setproctitle

    setproctitle.setproctitle("mmserver: spans")
    # Telemetry yields to serving: on a machine the server keeps busy, the spans wait (and
    # past MAX_HELD are dropped), not the requests.
    os.nice(SPANS_NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this ends
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tracing = Tracing.from_environment(os.environ, here=True)
    stdin = sys.stdin.buffer
    try:
        while True:
            head = stdin.read(4)
            if len(head) < 4:
                break
            (size,) = struct.unpack("!I", head)
            for record in pickle.loads(stdin.read(size)):
                tracing.spans(record)
    finally:
        tracing.shutdown()
