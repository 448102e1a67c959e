"""What a sampled request records on its way, for its trace: plain records, no OpenTelemetry.

Traces are on when the environment asks for them with the standard ``OTEL_*`` variables
(:func:`wanted`); the OpenTelemetry SDK is then imported and set up by
:mod:`mmserver.ops.otel`, which decides once per request, when it arrives, whether the request
is sampled. An unsampled request carries nothing: its exchange's and its jobs' ``trace`` stay
``None``, and every step of its path pays one look at that attribute. A sampled one carries a
:class:`Trace`: each step writes its times there (the clock of :func:`time.perf_counter`, the
system's monotonic clock, the same in the backend processes as in the frontend), and its spans
are made from them once the request is answered.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The variables that turn traces on (any of them set, unless ``OTEL_TRACES_EXPORTER=none`` or
#: ``OTEL_SDK_DISABLED=true``): the exporter, where it sends, the service's name, the sampler.
SWITCHES = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_SAMPLER",
)

#: The W3C Trace Context headers (and gRPC metadata keys), lower case.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: A backend's times of one batch (:data:`mmserver.backend.wire.BatchResult`): its process id,
#: when the batch began there, when the model's last call ended (the bodies decoded and
#: predicted) and when the answers were encoded, on :func:`time.perf_counter`'s clock.
BackendTimes = tuple[int, float, float, float]


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for traces (see :data:`SWITCHES`)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in SWITCHES)


@dataclass(frozen=True, slots=True, eq=False)
class Door:
    """How a door's requests are shown as spans, made once per route: the span's name, its
    attributes common to every request there, and the attribute its status goes in, with
    that status from the HTTP status the server answered (gRPC shows its own code)."""

    name: str
    attributes: Mapping[str, Any]
    status_key: str = "http.response.status_code"
    status: Callable[[int], int] = int
    #: The statuses from which the span's status is an error (a server's failure, not the
    #: client's).
    errors_from: int = 500
    #: The span's kind: ``server`` (a request from a client), ``consumer`` (an asynchronous
    #: request taken from the journal) or ``internal`` (a run of ``mmserver transform``).
    kind: str = "server"


@functools.cache
def http_door(method: str, route: str) -> Door:
    """The door of HTTP requests on ``route`` (its template: ``/predictions/{model}``), made
    once."""
    return Door(f"{method} {route}", {"http.request.method": method, "http.route": route})


class Passage:
    """One job of a sampled request through its model's queue and a batch: when it was
    queued, taken in a batch (of ``size`` jobs) and answered back in the frontend, and what
    the backend said of the batch (``None`` when no answer came)."""

    __slots__ = ("answered", "backend", "path", "queued", "rows", "size", "taken")

    def __init__(self, queued: float) -> None:
        self.queued = queued
        self.taken = 0.0
        self.answered = 0.0
        self.size = 0
        self.rows = 0
        self.path = ""
        self.backend: BackendTimes | None = None


@dataclass(slots=True, eq=False)
class Trace:
    """One sampled request: the context it continues (an OpenTelemetry ``Context``, ``None``
    for a new trace), the ids of its own span (drawn when it was sampled, so that its
    ``traceparent`` is known before the span is made), when it arrived, and what its steps
    recorded."""

    door: Door
    parent: Any
    trace_id: int
    span_id: int
    started: float = field(default_factory=time.perf_counter)
    #: The cold load it waited for: when the wait began and ended.
    load: tuple[float, float] | None = None
    passages: list[Passage] = field(default_factory=list)
    #: Attributes its door or its model adds (the model's name and version, say).
    attributes: dict[str, Any] = field(default_factory=dict)

    def queued(self) -> Passage:
        """A job of the request queued now."""
        passage = Passage(time.perf_counter())
        self.passages.append(passage)
        return passage
