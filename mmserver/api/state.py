"""What every door of the API shares, whatever its transport (aiohttp, the lean path, gRPC):
:class:`ApiState` (the server's parts the handlers use), the request id and its header, and the
error of a body over ``max_request_size``. Nothing here imports aiohttp."""

from __future__ import annotations

import functools
import itertools
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserver.config.server import ServerConfig
from mmserver.errors import RequestTooLarge
from mmserver.ops.logs import ModelErrorLog
from mmserver.ops.metrics import Metrics

if TYPE_CHECKING:
    from mmserver.api.accesslog import AccessLog
    from mmserver.asynchronous import AsyncInference
    from mmserver.manager.wlm import WorkLoadManager
    from mmserver.ops.capture import Capture
    from mmserver.ops.otel import Tracing
    from mmserver.tenancy.gate import TenantGate


#: The header naming a request: every answer has it (as DJL Serving's do), with the client's own
#: value when its request had one.
REQUEST_ID = "X-Request-Id"


class RequestIds:
    """Request ids for requests that came without one: a random per-process prefix and a counter
    (a step of the counter and a short string per request; a UUID would cost several times
    that)."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


@dataclass
class ApiState:
    """What the handlers use, stored on the application under :data:`STATE`."""

    config: ServerConfig
    wlm: WorkLoadManager
    metrics: Metrics
    request_ids: RequestIds = field(default_factory=RequestIds)
    #: The access log, when ``access_log`` is on.
    access_log: AccessLog | None = None
    #: Asynchronous inference, when the server has a ``state_dir``.
    asynchronous: AsyncInference | None = None
    #: The data capture, when the server has a ``capture_path``.
    capture: Capture | None = None
    #: The lines of models whose own code raises.
    model_errors: ModelErrorLog = field(default_factory=ModelErrorLog)
    #: The tenants, when the server has a ``tenants`` file.
    tenants: TenantGate | None = None
    #: Traces, when the environment asks for them (:mod:`mmserver.ops.otel`).
    tracing: Tracing | None = None
    #: What the status page remembers between calls (:class:`mmserver.api.pages.StatusBoard`),
    #: made by its first call.
    status_board: Any = None
    #: The other instances management calls are sent on to (option ``peers``): a
    #: :class:`mmserver.api.peers.Peers`, which speaks HTTP with aiohttp's client.
    peers: Any = None

    @functools.cached_property
    def _hidden_paths(self) -> tuple[str, ...]:
        config = self.config
        roots = {str(config.cache_path), *(str(r) for r in config.allowed_roots)}
        if config.store_url is None:
            roots |= {str(config.store_path), os.path.realpath(config.store_path)}
        return tuple(sorted((r.rstrip("/") for r in roots if r.strip("/")), key=len, reverse=True))

    def without_paths(self, text: str) -> str:
        """``text`` with the server's own folders (the store, the cache, the allowed model
        roots) cut from the paths in it: an answer names a model's files, not the machine's."""
        for root in self._hidden_paths:
            if root in text:
                text = text.replace(root + "/", "").replace(root, "the model store")
        # "in the model store (/srv/models)" loses its path, and says the store once.
        return text.replace("the model store (the model store)", "the model store")

    def observe_request(self, model: str, code: int, seconds: float, tenant: str = "-") -> None:
        """Count one answered inference request (of ``tenant``, when the server has tenants)
        and its time in the server."""
        metrics = self.metrics
        if metrics.tenant_label:
            metrics.requests.labels(model, str(code), tenant).inc()
        else:
            metrics.requests.labels(model, str(code)).inc()
        metrics.request_seconds.labels(model).observe(seconds)


def too_large(length: int | None, limit: int) -> RequestTooLarge:
    """The error of a request of ``length`` bytes (``None``: not known, more than ``limit``)."""
    size = f"{length} bytes" if length is not None else "more"
    return RequestTooLarge(
        f"the request body is {size}; the limit is {limit} bytes (max_request_size). "
        "Send fewer rows per request."
    )
