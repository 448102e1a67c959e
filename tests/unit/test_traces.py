"""Traces' decisions and spans (:mod:`mmserver.ops.traces`, :mod:`mmserver.ops.otel`): when the
environment turns them on, what a ``traceparent`` continues (read by the SDK's W3C propagator),
the sampler's root rule against the SDK's own sampler, and the spans made from a request's
recorded times, exported to the SDK's in-memory exporter."""

from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)

from mmserver.errors import ConfigError
from mmserver.ops.otel import ChosenIds, Tracing, _root_rule, exporters
from mmserver.ops.traces import Door, Trace, http_door, wanted
from mmserver.ops.tracing import tracing_from

DOOR = http_door("POST", "/predictions/{model}")
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def tracing(sampler: Sampler = DEFAULT_ON) -> tuple[Tracing, InMemorySpanExporter]:
    exported = InMemorySpanExporter()
    ids = ChosenIds()
    provider = TracerProvider(sampler=sampler, id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Tracing(provider, ids), exported


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"PATH": "/bin", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_SERVICE_NAME": "models"}, True),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_SERVICE_NAME": "models"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_SERVICE_NAME": "models"}, False),
        ({"OTEL_SERVICE_NAME": "  "}, False),
    ],
)
def test_traces_are_on_only_when_the_environment_asks(environ: dict[str, str], on: bool) -> None:
    assert wanted(environ) is on
    if not on:
        assert tracing_from(environ) is None


def test_a_sampled_traceparent_is_continued_and_handed_on_with_the_requests_span() -> None:
    traces, exported = tracing()
    trace = traces.sampled(DOOR, f"00-{TRACE_ID}-{PARENT}-01", "vendor=1")
    assert trace is not None and trace.trace_id == int(TRACE_ID, 16)
    traces.export(trace, 200)
    [span] = exported.get_finished_spans()
    assert span.context is not None and span.parent is not None
    assert (span.context.trace_id, span.context.span_id) == (trace.trace_id, trace.span_id)
    assert (span.parent.trace_id, span.parent.span_id) == (int(TRACE_ID, 16), int(PARENT, 16))
    assert span.context.trace_state.get("vendor") == "1"
    assert traces.traceparent(trace) == f"00-{TRACE_ID}-{trace.span_id:016x}-01"


@pytest.mark.parametrize(
    ("traceparent", "outcome"),
    [
        (f"00-{TRACE_ID}-{PARENT}-00", "none"),  # the client did not sample it
        (f"00-{TRACE_ID}-{PARENT}-01", "continued"),
        (f"00-{'0' * 32}-{PARENT}-01", "new"),  # invalid: a new trace, as without one
        ("garbage", "new"),
        (None, "new"),
    ],
)
def test_a_parent_based_sampler_follows_the_callers_decision(
    traceparent: str | None, outcome: str
) -> None:
    traces, _ = tracing()
    trace = traces.sampled(DOOR, traceparent)
    if outcome == "none":
        assert trace is None
    else:
        assert trace is not None
        assert (trace.parent is not None) is (outcome == "continued")
        assert (trace.trace_id == int(TRACE_ID, 16)) is (outcome == "continued")


@pytest.mark.parametrize(
    "sampler",
    [
        ParentBasedTraceIdRatio(0.01),
        ParentBasedTraceIdRatio(0.5),
        TraceIdRatioBased(0.25),
        TraceIdRatioBased(0.0),
        ALWAYS_ON,
        ALWAYS_OFF,
    ],
)
def test_the_root_rule_decides_as_the_sdks_sampler(sampler: Sampler) -> None:
    rule = _root_rule(sampler)
    draws = random.Random(7)
    for _ in range(3000):
        trace_id = draws.getrandbits(128) or 1
        decided = sampler.should_sample(None, trace_id, "request").decision.is_sampled()  # type: ignore[no-untyped-call]
        assert rule(trace_id) is decided


def test_a_one_percent_sampler_takes_about_one_percent_and_makes_nothing_else() -> None:
    traces, exported = tracing(ParentBasedTraceIdRatio(0.01))
    taken = [t for t in (traces.sampled(DOOR, None) for _ in range(20000)) if t is not None]
    assert 100 <= len(taken) <= 320  # 200 expected; far outside only by a broken rule
    for trace in taken:
        traces.export(trace, 200)
    # The SDK's sampler, deciding again at the span, agrees on every one.
    assert len(exported.get_finished_spans()) == len(taken)


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def test_a_requests_spans_are_made_from_its_recorded_times() -> None:
    traces, exported = tracing()
    trace = Trace(DOOR, None, 0x1234, 0x99, started=10.0)
    trace.load = (10.001, 10.002)
    passage = trace.queued()
    passage.queued, passage.taken, passage.answered = 10.003, 10.004, 10.009
    passage.size, passage.rows, passage.path = 3, 5, "treelite"
    passage.backend = (4242, 10.005, 10.006, 10.007)
    trace.attributes["mmserver.model"] = "m"
    traces.export(trace, 503, ended=10.010)
    spans = _by_name(exported.get_finished_spans())
    assert sorted(spans) == [
        "POST /predictions/{model}",
        "batch",
        "encode",
        "load",
        "predict",
        "queue",
    ]
    request = spans["POST /predictions/{model}"]
    assert request.context is not None and request.context.trace_id == 0x1234
    assert request.context.span_id == 0x99 and request.parent is None
    assert request.attributes == {
        "http.request.method": "POST",
        "http.route": "/predictions/{model}",
        "http.response.status_code": 503,
        "mmserver.model": "m",
    }
    assert not request.status.is_ok
    for child, parent in [
        ("load", request),
        ("queue", request),
        ("batch", request),
        ("predict", spans["batch"]),
        ("encode", spans["batch"]),
    ]:
        assert spans[child].parent is not None and parent.context is not None
        assert spans[child].parent.span_id == parent.context.span_id
    starts = {n: s.start_time for n, s in spans.items()}
    ends = {n: s.end_time for n, s in spans.items()}
    assert ends["POST /predictions/{model}"] - starts["POST /predictions/{model}"] == pytest.approx(
        10_000_000, abs=2
    )
    assert ends["queue"] == starts["batch"]
    assert ends["predict"] == starts["encode"]
    assert spans["batch"].attributes == {"mmserver.batch.size": 3}
    assert spans["predict"].attributes == {
        "process.pid": 4242,
        "mmserver.predict.path": "treelite",
        "mmserver.batch.rows": 5,
    }


def test_a_job_still_queued_when_its_request_ended_has_its_wait_only() -> None:
    traces, exported = tracing()
    trace = Trace(Door("call", {}), None, 0x1234, 0x99, started=1.0)
    trace.queued().queued = 1.5
    traces.export(trace, 504, ended=2.0)
    assert sorted(_by_name(exported.get_finished_spans())) == ["call", "queue"]


def test_an_exporter_that_is_not_installed_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no exporter 'zipkin_json'"):
        exporters({"OTEL_TRACES_EXPORTER": "zipkin_json"})
    [made] = exporters({"OTEL_TRACES_EXPORTER": "otlp"})
    assert type(made).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
