"""A real OTLP/HTTP receiver on a free loopback port: ``POST /v1/traces`` bodies decoded with
opentelemetry-proto's ``ExportTraceServiceRequest``, their spans kept for the tests to wait on
(an ``asyncio.Condition``, notified at each export)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from mmserver.commands.procfs import free_port

#: OTLP's span kinds by number (``Span.SpanKind``).
KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class Span:
    """One exported span, its ids in hex as ``traceparent`` writes them."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    error: bool


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class Receiver:
    """The receiver, an async context manager; ``endpoint`` is its ``/v1/traces`` URL."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self.spans: list[Span] = []
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        Span(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            kind=KINDS.get(span.kind, "unspecified"),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            error=span.status.code == 2,
                        )
                    )
        async with self._changed:
            self._changed.notify_all()
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def wait(self, found: Callable[[list[Span]], bool], timeout: float = 30.0) -> None:
        """Wait until ``found`` holds of the spans received."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: found(self.spans)), timeout)

    async def trace(self, trace_id: str, count: int, timeout: float = 30.0) -> list[Span]:
        """The spans of trace ``trace_id`` once ``count`` of them are in."""
        await self.wait(lambda spans: sum(s.trace_id == trace_id for s in spans) >= count, timeout)
        return [s for s in self.spans if s.trace_id == trace_id]
