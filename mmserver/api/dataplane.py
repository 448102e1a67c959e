"""One inference request, whichever door it came through: the data plane.

A door (aiohttp's handler, :mod:`mmserver.api.inference`; the lean path,
:mod:`mmserver.api.lean.connection`; V2 over gRPC, :mod:`mmserver.api.grpc.service`) reads a request
in its own way, then makes an :class:`Exchange` and calls it in this order:

1. :meth:`Exchange.submit` — the job made by the route's protocol, queued on the model (loaded
   first if needed); the future of the answer's body comes back;
2. :meth:`Exchange.answered` with that body — the protocol's answer (body, ``Content-Type``,
   headers), counted; or :meth:`Exchange.failed` with the error — the error shown to the
   client (a 500 logged), counted.

On a server with traces (:mod:`mmserver.ops.otel`), the door first asks whether the request is
sampled (:meth:`Exchange.sample`, with its ``traceparent``); a sampled request's spans are made
when it is answered or has failed, from the times its way recorded.

The door writes what comes back in its own framing (HTTP through aiohttp or by hand, a gRPC
message). So an answer is the same whichever door it came through, and so are the metrics:
``mmserver_requests_total{model,code}`` and ``mmserver_request_seconds{model}`` carry the
model's name only once the request reached a model; one that never did (an unsupported content
type, a bad or unknown name, refused during shutdown) is counted under ``model="-"``, so
clients cannot create series at will.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserver.api.accesslog import shown_path
from mmserver.api.protocols import Protocol
from mmserver.codecs.explanations import content_type_of
from mmserver.codecs.requests import Request
from mmserver.errors import (
    BackendDied,
    InvalidModelName,
    MMServerError,
    ModelError,
    ModelNotFound,
    PredictTimeout,
    ShuttingDown,
)
from mmserver.ops.capture import Capture, Record
from mmserver.serving.jobs import NORMAL
from mmserver.store.names import normalize_name, split_version
from mmserver.tenancy.gate import NOBODY
from mmserver.tenancy.sigv4 import Header

if TYPE_CHECKING:
    from mmserver.api.state import ApiState
    from mmserver.manager.wlm import Submission
    from mmserver.ops.otel import Tracing
    from mmserver.ops.traces import Door, Trace
    from mmserver.tenancy.tenants import Tenant

log = logging.getLogger(__name__)

UNRESOLVED = "-"

# Errors from WorkLoadManager.submit that say the name did not lead to a model.
_UNRESOLVED_ERRORS = (InvalidModelName, ModelNotFound, ShuttingDown)


class Exchange:
    """One inference request from its arrival until it is answered and counted."""

    __slots__ = (
        "caller",
        "job",
        "name",
        "protocol",
        "rid",
        "start",
        "state",
        "submission",
        "trace",
    )

    def __init__(self, state: ApiState, protocol: Protocol, rid: str) -> None:
        self.state = state
        self.protocol = protocol
        self.rid = rid
        self.start = time.perf_counter()
        self.name = UNRESOLVED
        self.job: Request | None = None
        self.submission: Submission | None = None
        #: Who calls, when the server has tenants (:meth:`authenticate`).
        self.caller: Tenant | None = None
        #: The request's trace, when it is sampled (:meth:`sample`).
        self.trace: Trace | None = None

    def sample(
        self, tracing: Tracing, door: Door, traceparent: str | None, tracestate: str | None
    ) -> None:
        """Decide, once, whether the request is traced (a server with traces): it continues
        the trace of its ``traceparent`` when it has one, else the sampler decides."""
        trace = self.trace = tracing.sampled(door, traceparent, tracestate)
        if trace is not None:
            trace.started = self.start

    def authenticate(self, method: str, target: str | bytes, header: Header, body: bytes) -> None:
        """Find who calls (the server has tenants: :mod:`mmserver.tenancy.gate`), or raise the
        refusal of the route's protocol. ``target``: the path and query as sent; ``header``: a
        request header's value by its lower-case name."""
        gate = self.state.tenants
        assert gate is not None
        self.caller = gate.authenticate(self.protocol.amzn_errors, method, target, header, body)

    def submit(
        self,
        name: str,
        body: bytes,
        content_type: str | None,
        accept: str | None,
        header_length: str | None,
        client_gone: Callable[[], bool] | None,
        routing: str | None = None,
    ) -> asyncio.Future[bytes]:
        """Make the job and queue it on model ``name``: the future of the answer's body. Raises
        what the job's headers or the server's state refuse at once. ``routing`` is the
        request's routing key (a canary rollout sends the same key to the same version)."""
        self.name = name
        self.job = job = self.protocol.make_job(body, content_type, accept, header_length)
        state = self.state
        release = None
        caller = self.caller
        if state.tenants is not None:
            if caller is None:
                raise AssertionError("a door of a server with tenants submitted unauthenticated")
            release = state.tenants.admit(caller, name)
        wlm = state.wlm
        try:
            if self.trace is not None:
                rank = NORMAL if caller is None else caller.rank
                self.submission = submission = wlm.submit(
                    name, job, client_gone, routing=routing, priority=rank, trace=self.trace
                )
            elif caller is not None and caller.rank != NORMAL:
                self.submission = submission = wlm.submit(
                    name, job, client_gone, routing=routing, priority=caller.rank
                )
            elif routing is None:
                self.submission = submission = wlm.submit(name, job, client_gone)
            else:
                self.submission = submission = wlm.submit(name, job, client_gone, routing=routing)
        except BaseException:
            if release is not None:
                release(None)
            raise
        if release is not None:
            submission.answer.add_done_callback(release)
        return submission.answer

    def answered(self, answer: bytes) -> tuple[bytes | memoryview, str, dict[str, str] | None]:
        """The answer's body, ``Content-Type`` and other headers, counted as answered."""
        job = self.job
        assert job is not None and self.submission is not None
        rendered = self.protocol.render(answer, job)
        requests = self.submission.requests
        if requests is not None:
            caller = self.caller
            if caller is None:
                requests.answered(time.perf_counter() - self.start)
            else:
                requests.answered(time.perf_counter() - self.start, caller.name)
        capture = self.state.capture
        if capture is not None:
            self._capture(capture, rendered)
        if self.trace is not None:
            self._export(200)
        return rendered

    def _export(self, status: int) -> None:
        """Make the spans of the sampled request, answered ``status``."""
        trace, self.trace = self.trace, None
        tracing = self.state.tracing
        if trace is None or tracing is None:
            return
        submission = self.submission
        pool = submission.pool if submission is not None else None
        model, version = split_version(pool.name) if pool is not None else (self.name, None)
        attributes = trace.attributes
        attributes["mmserver.request_id"] = self.rid
        if model != UNRESOLVED:
            attributes["mmserver.model"] = model
        if version is not None:
            attributes["mmserver.model.version"] = str(version)
        tracing.export(trace, status)

    def _capture(
        self, capture: Capture, rendered: tuple[bytes | memoryview, str, dict[str, str] | None]
    ) -> None:
        """Hand the request and its answer to the data capture when the model's share draws
        it (:mod:`mmserver.ops.capture`)."""
        pool = self.submission.pool if self.submission is not None else None
        if pool is None or not pool.config.capture_percent or self.job is None:
            return
        if capture.sampled(pool.config.capture_percent):
            job = self.job
            record = Record(
                pool.name,
                time.time(),
                self.rid,
                job[0],
                content_type_of(job[1]) or "application/json",
                bytes(rendered[0]),
                rendered[1],
            )
            capture.offer(record)

    def failed(self, error: BaseException, method: str, path: str) -> MMServerError:
        """The error the client is shown for ``error`` (:func:`shown_error`), counted as
        failed."""
        shown = shown_error(error, method, path, self.rid)
        submission = self.submission
        if submission is not None and submission.requests is not None:
            submission.requests.failed()
        label = failure_label(self.name, submission, error)
        if self.trace is not None:
            self._export(shown.status_code)
        if isinstance(shown, ModelError):
            self.state.model_errors.raised(label, shown.message, self.rid)
        elif isinstance(error, BackendDied | PredictTimeout):
            # Rare, and each such request is one the operator may be asked about: its own line.
            log.warning(
                "request %s of model %s: %s",
                self.rid,
                label,
                error.message,
                extra={"model": label, "request_id": self.rid},
            )
        caller = self.caller
        self.state.observe_request(
            label,
            shown.status_code,
            time.perf_counter() - self.start,
            NOBODY if caller is None else caller.name,
        )
        return shown


def failure_label(name: str, submission: Submission | None, error: BaseException | None) -> str:
    """The model a request that failed with ``error`` is counted under: its model once the
    request reached one, the name it asked for when that name led to a model that failed (to
    load, say), otherwise :data:`UNRESOLVED`."""
    if submission is None:
        return UNRESOLVED
    if submission.requests is not None:
        return submission.requests.model
    if isinstance(error, MMServerError) and not isinstance(error, _UNRESOLVED_ERRORS):
        return _label(name)
    return UNRESOLVED


def _label(name: str) -> str:
    try:
        return normalize_name(name)
    except InvalidModelName:
        return UNRESOLVED


def shown_error(error: BaseException, method: str, path: str, rid: str) -> MMServerError:
    """The error request ``rid`` is shown for ``error``: itself, or a generic 500 for one
    outside the error tree, logged with its traceback; any 500 logged."""
    if isinstance(error, MMServerError):
        if error.status_code == 500:
            log_server_error(method, path, error, rid)
        return error
    return unexpected(method, path, rid, error)


def log_server_error(method: str, path: str, error: MMServerError, rid: str) -> None:
    """The warning line of an error answered 500."""
    log.warning(
        "%s %s answered 500 %s: %s (%s)",
        method,
        shown_path(path),
        error.error_type,
        error.message,
        rid,
        extra={"request_id": rid},
    )


def unexpected(
    method: str, path: str, rid: str, exc_info: BaseException | bool = True
) -> MMServerError:
    """Log an exception outside the error tree with its traceback (by default the one being
    handled) and return the generic error it is answered with."""
    log.error(
        "unexpected error answering %s %s (request id %s)",
        method,
        shown_path(path),
        rid,
        exc_info=exc_info,
        extra={"request_id": rid},
    )
    return MMServerError("the server failed to answer this request; it has logged the cause")


def shown_message(state: ApiState, error: MMServerError, rid: str) -> str:
    """The message a client is shown for ``error`` to request ``rid``, whatever the door: the
    server's folders cut from it, the request id at its end."""
    return f"{state.without_paths(error.message)} (request id {rid})"
