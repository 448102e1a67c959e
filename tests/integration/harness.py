"""The app in process over a real WorkLoadManager, served on a free loopback port.

Fixtures for the HTTP-level tests (test modules import the ones they use):

- ``store_root`` — one model store per session: the reference store of 1,000 ``sklearn-N.tar.gz``
  archives and its examples, plus models made to behave in known ways (``raising-handler``,
  ``broken-model``, ``gated-handler``, ``dying-handler``);
- ``serve`` — ``await serve(**options)`` starts a server (its own WorkLoadManager, metrics
  registry and unpack cache) with the backend in threads unless told otherwise;
- ``server`` — one server with the default options;
- ``gate`` — the gate that ``gated-handler`` waits at (:mod:`tests.integration.gate`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from mmserver.api.connections import HttpRunner
from mmserver.api.web import STATE
from mmserver.app import build_app
from mmserver.asynchronous import AsyncInference
from mmserver.config.server import ServerConfig
from mmserver.manager.wlm import WorkLoadManager
from mmserver.ops.metrics import Metrics
from mmserver.store.local import ModelStore
from tests.behaviour_models import trusting
from tests.integration import gate as gate_module
from tests.models import make_custom_handler_dir, make_store

STORE_COUNT = 1000

RAISING_HANDLER = """\
import joblib
from pathlib import Path


def load(model_dir, properties):
    return joblib.load(Path(model_dir) / "model.joblib")


def predict(model, batch):
    raise ValueError("feature 0 is out of range")
"""

GATED_HANDLER = """\
import joblib
from pathlib import Path

from tests.integration import gate


def load(model_dir, properties):
    return joblib.load(Path(model_dir) / "model.joblib")


def predict(model, batch):
    gate.current.pass_through()
    return model.predict(batch)
"""

GATED_PROPERTIES = """\
minWorkers=1
maxWorkers=1
batch_size=1
job_queue_size=1
"""

DYING_HANDLER = """\
import os


def load(model_dir, properties):
    return None


def predict(model, batch):
    os._exit(3)
"""


def _handler_dir(folder: Path, source: str, properties: str | None = None) -> None:
    make_custom_handler_dir(folder)
    (folder / "model.py").write_text(source)
    if properties is not None:
        (folder / "serving.properties").write_text(properties)


@pytest.fixture(scope="session")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_store(tmp_path_factory.mktemp("store"), STORE_COUNT)
    _handler_dir(root / "raising-handler", RAISING_HANDLER)
    _handler_dir(root / "gated-handler", GATED_HANDLER, GATED_PROPERTIES)
    _handler_dir(root / "dying-handler", DYING_HANDLER)
    broken = root / "broken-model"
    broken.mkdir()
    (broken / "model.joblib").write_bytes(b"this is not a joblib file")
    return root


@pytest.fixture(scope="session")
def store_names(store_root: Path) -> list[str]:
    """Every model name of the session store, sorted."""
    names = [p.name.removesuffix(".tar.gz") for p in store_root.iterdir()]
    return sorted(n for n in names if not n.startswith("."))


@pytest.fixture
def gate() -> Iterator[gate_module.Gate]:
    yield gate_module.reset()
    gate_module.current.open()


@dataclass
class Harness:
    """One running server: its HTTP client and the components behind it."""

    client: TestClient[web.Request, web.Application]
    wlm: WorkLoadManager
    metrics: Metrics
    config: ServerConfig

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    @property
    def asynchronous(self) -> AsyncInference:
        """The server's asynchronous inference (the server has a ``state_dir``)."""
        runner = self.client.app[STATE].asynchronous
        assert runner is not None, "no state_dir: no asynchronous inference"
        return runner

    async def post(
        self,
        path: str,
        body: bytes | str,
        content_type: str | None = "application/json",
        **headers: str,
    ) -> ClientResponse:
        """POST ``body``; ``content_type=None`` sends no Content-Type header at all."""
        sent = dict(headers)
        skip: tuple[str, ...] = ()
        if content_type is not None:
            sent["Content-Type"] = content_type
        else:
            skip = ("Content-Type",)
        data = body.encode() if isinstance(body, str) else body
        return await self.client.post(path, data=data, headers=sent, skip_auto_headers=skip)

    async def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` parsed: (sample name, sorted labels) -> value."""
        response = await self.client.get("/metrics")
        assert response.status == 200
        text = await response.text()
        result = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return result


Serve = Callable[..., Awaitable[Harness]]


class ServerLikeTestServer(TestServer):
    """A TestServer run as ``mmserver.server`` runs the app: its connection rules
    (:class:`~mmserver.api.connections.HttpRunner`), and a handler is not cancelled when its
    client leaves (the WorkLoadManager's client-gone check drops the job instead)."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        kwargs["handler_cancellation"] = False
        return HttpRunner(self.app, **kwargs)


@pytest.fixture
async def serve(store_root: Path, tmp_path: Path) -> AsyncIterator[Serve]:
    """``await serve(**options)``: start a server on the session store (backend in threads)."""
    started: list[Harness] = []

    async def start(
        *,
        room_wait_seconds: float = 5.0,
        routes: list[web.RouteDef] | None = None,
        **options: Any,
    ) -> Harness:
        settings: dict[str, Any] = {
            "model_store": str(store_root),
            "cache_dir": str(tmp_path / f"cache-{len(started)}"),
            "backend_processes": 0,
            "max_workers": 2,
        }
        settings.update(options)
        # The store's custom handlers (custom-handler, raising-handler...) run: the operator
        # trusts them by name, as a server must be told to.
        settings = trusting(Path(settings["model_store"]), settings)
        config = ServerConfig(**settings)
        metrics = Metrics(
            model_label=config.metrics_model_label, tenant_label=bool(config.tenants.strip())
        )
        store = ModelStore(
            config.store_path,
            config.cache_path,
            config.max_archive_mb * 2**20,
            config.allowed_roots,
        )
        wlm = WorkLoadManager(config, store, metrics, room_wait_seconds=room_wait_seconds)
        await wlm.start()
        app = build_app(config, wlm, metrics)
        runner = app[STATE].asynchronous
        if runner is not None:
            await runner.start()
        if routes:
            app.add_routes(routes)
        # On the port the options name, if they do (peers are told each other's ports first).
        port = config.port if "port" in options else None
        client = TestClient(ServerLikeTestServer(app, host="127.0.0.1", port=port))
        harness = Harness(client, wlm, metrics, config)
        started.append(harness)
        await client.start_server()
        return harness

    yield start
    gate_module.current.open()
    for harness in reversed(started):
        await harness.client.close()
        runner = harness.client.app[STATE].asynchronous
        if runner is not None:
            runner.close()
            await asyncio.gather(runner.stop(2.0), harness.wlm.stop(drain_timeout=2.0))
        else:
            await harness.wlm.stop(drain_timeout=2.0)


@pytest.fixture
async def server(serve: Serve) -> Harness:
    return await serve()


async def error_of(response: ClientResponse) -> dict[str, Any]:
    """The JSON error body, checked for its fixed shape and request id (a 424 also has the
    SageMaker ``ModelError`` members ``OriginalStatusCode`` and ``OriginalMessage``)."""
    assert response.content_type == "application/json"
    body: dict[str, Any] = json.loads(await response.read())
    request_id = response.headers["X-Request-Id"]
    assert body["message"].endswith(f" (request id {request_id})")
    if response.status == 424:
        assert body.pop("OriginalStatusCode") == 424
        assert body["message"] == f"{body.pop('OriginalMessage')} (request id {request_id})"
    assert set(body) == {"code", "type", "message"}
    assert body["code"] == response.status
    return body


async def describe(harness: Harness, name: str) -> dict[str, Any]:
    """The model of ``GET /models/{name}`` (DJL's describe: one workflow holding the model)."""
    response = await harness.client.get(f"/models/{name}")
    assert response.status == 200, await response.text()
    [workflow] = await response.json()
    [model] = workflow["models"]
    assert isinstance(model, dict)
    return model


async def wait_until(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait for a condition on server state that has no event of its own to wait on."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def watch_body_reads(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """An event set when an inference handler starts reading a request's body."""
    from mmserver.api import inference

    reading = asyncio.Event()
    read_whole = inference.read_body

    async def read_body(request: web.Request, limit: int, timeout: float = 0.0) -> bytes:
        reading.set()
        return await read_whole(request, limit, timeout)

    monkeypatch.setattr(inference, "read_body", read_body)
    return reading


async def hold_gate(
    harness: Harness, gate: gate_module.Gate, path: str, **headers: str
) -> asyncio.Task[Any]:
    """Send a request to a gated model and return once its prediction waits at the gate."""
    task = asyncio.ensure_future(harness.post(path, "[[0.5]]", **headers))
    entered = await asyncio.to_thread(gate.wait_entered)
    assert entered, "the gated model was not called"
    return task
