"""The server a recommendation measures: one it starts over a model store, or one running at a
URL that it may manage. Either way each setting is applied to the loaded model with
``PUT /models/{model}`` (the management API changes a loaded model's batching and workers at
once, so the model loads once and no server restarts between trials), and a running server's
model gets its own settings back at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from mmserver.commands.launch import Child, NotStarted, Serve
from mmserver.commands.loadtest.client import JSON_HEADERS, Client
from mmserver.commands.procfs import HOST, free_port
from mmserver.commands.recommend.settings import Setting
from mmserver.config.model import cpu_count
from mmserver.errors import answer_message

READY_TIMEOUT_S = 120.0


class TargetError(Exception):
    """The server or the model cannot be measured; the message says why."""


@dataclass(frozen=True)
class ModelFacts:
    """What ``GET /models/{model}`` says of the loaded model."""

    setting: Setting
    min_workers: int
    memory_bytes: int | None  # of one copy
    lane: str | None

    @classmethod
    def of(cls, described: dict[str, Any]) -> ModelFacts:
        group = (described.get("workerGroups") or [{}])[0]
        # memoryBytes counts every loaded copy: one in each backend process a worker runs in
        # (numbered within its lane).
        workers = group.get("workers", [])
        copies = len({(w.get("lane"), w.get("backend")) for w in workers}) or 1
        memory = described.get("memoryBytes")
        return cls(
            Setting(
                int(described.get("batchSize", 1)),
                int(described.get("maxBatchDelayMillis", 0)),
                int(group.get("maxWorkers", 1)),
            ),
            int(group.get("minWorkers", 1)),
            None if memory is None else int(memory) // copies,
            described.get("lane"),
        )


class Target:
    """A server at ``host:port``; ``pid`` is its process when this command started it (its CPU
    is then read from its process tree, else from its ``GET /metrics``)."""

    def __init__(self, host: str, port: int, pid: int | None = None) -> None:
        self.host = host
        self.port = port
        self.pid = pid
        self.client = Client(port, timeout=60.0, host=host)
        self._server: Child | None = None
        self._scratch: Path | None = None
        self._restore: tuple[str, ModelFacts] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def start(cls, model_store: Path, server_args: tuple[str, ...] = ()) -> Target:
        """``mmserver serve`` over ``model_store`` on a free loopback port, its archive cache
        and log in a scratch folder removed by :meth:`close`."""
        scratch = Path(tempfile.mkdtemp(prefix="mmserver-recommend-"))
        serve = Serve(
            model_store.resolve(),
            free_port(),
            backend_processes=cpu_count(),
            cache_dir=scratch / "cache",
            args=server_args,
        )
        # In a session of its own: a Ctrl-C reaches this command only, and :meth:`close` stops
        # the server (it drains) when the command ends.
        server = Child(serve, scratch / "server.log", label="the server", new_session=True)
        server.start()
        target = cls(HOST, server.port, server.pid)
        target._server, target._scratch = server, scratch
        try:
            server.wait_ready(READY_TIMEOUT_S)
        except NotStarted as exc:
            log = (scratch / "server.log").read_text(errors="replace")[-2000:]
            target.close()
            raise TargetError(f"the server did not start: {exc.reason}\n{log}") from None
        return target

    @classmethod
    def at(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise TargetError(f"--url {url!r} is not an http://HOST:PORT address")
        target = cls(parts.hostname, parts.port or 80)
        try:
            status, _, _ = target.client.request("GET", "/ping")
        except OSError as exc:
            raise TargetError(f"no server answers at {url}: {exc}") from None
        if status != 200:
            raise TargetError(f"the server at {url} answers GET /ping with {status}")
        return target

    def load(self, model: str, body: bytes) -> ModelFacts:
        """Send ``body`` to ``model`` (loading it) and read its settings; they are put back by
        :meth:`close` on a server this command did not start."""
        status, answer, _ = self.request("POST", f"/predictions/{quote(model)}", body)
        if status != 200:
            raise TargetError(
                f"model {model} answers the sample request with {status}: "
                f"{answer_message(answer)} (give a request it takes with --payload FILE)"
            )
        facts = self.describe(model)
        if self._server is None and self._restore is None:
            self._restore = (model, facts)
        return facts

    def describe(self, model: str) -> ModelFacts:
        status, answer, _ = self.request("GET", f"/models/{quote(model)}")
        if status != 200:
            raise TargetError(f"GET /models/{model} answered {status}: {answer_message(answer)}")
        return ModelFacts.of(json.loads(answer)[0]["models"][0])

    def inputs(self, model: str) -> list[dict[str, Any]]:
        """The model's inputs as its V2 metadata lists them (loading the model if needed)."""
        status, answer, _ = self.request("GET", f"/v2/models/{quote(model)}")
        if status == 404:
            raise TargetError(f"the server has no model {model}: {answer_message(answer)}")
        if status != 200:
            raise TargetError(f"model {model} did not load ({status}): {answer_message(answer)}")
        inputs: list[dict[str, Any]] = json.loads(answer).get("inputs", [])
        return inputs

    def apply(self, model: str, setting: Setting, min_workers: int | None = None) -> None:
        query = setting.query()
        if min_workers is not None:
            query["min_worker"] = str(min_workers)
        status, answer, _ = self.request("PUT", f"/models/{quote(model)}?{urlencode(query)}")
        if status != 200:
            raise TargetError(
                f"PUT /models/{model} ({setting.label}) answered {status}: {answer_message(answer)}"
            )

    def keep(self, model: str, setting: Setting) -> None:
        """Apply ``setting`` to stay (with the model's own minWorkers): :meth:`close` then puts
        nothing back."""
        min_workers = self._restore[1].min_workers if self._restore else None
        self._restore = None
        self.apply(model, setting, min_workers and min(min_workers, setting.max_workers))

    def cpu_seconds(self) -> float:
        """CPU seconds the server's frontend and backend processes have used (``GET
        /metrics``' ``process_cpu_seconds_total``)."""
        status, answer, _ = self.request("GET", "/metrics")
        if status != 200:
            raise TargetError(f"GET /metrics answered {status}")
        total = 0.0
        for line in answer.decode(errors="replace").splitlines():
            if line.startswith("process_cpu_seconds_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def request(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, bytes, float]:
        try:
            return self.client.request(method, path, body, JSON_HEADERS if body else None)
        except OSError as exc:
            raise TargetError(f"{method} {path} on {self.url} failed: {exc}") from None

    def close(self) -> None:
        """Put a running server's model back as it was; stop a server this command started."""
        try:
            if self._restore is not None:
                model, facts = self._restore
                self._restore = None
                self.apply(model, facts.setting, facts.min_workers)
        finally:
            self.client.close()
            if self._server is not None:
                self._server.stop()
                self._server = None
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
