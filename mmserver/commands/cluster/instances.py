"""One mmserver instance: ``mmserver serve`` on a loopback port, a child process of the cluster.

Each instance runs in its own session, so a Ctrl-C in the terminal reaches only the cluster's
supervisor, which stops the instances in its own order (the balancer first, then the instances,
each draining its accepted requests).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.commands.cluster.procfs import HOST
from mmserver.commands.cluster.procs import (
    LoggedChild,
    ProcessId,
    descendants,
    http_get,
    kill_all,
    reap,
    wait_gone,
    wait_until,
)

READY_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 40.0


@dataclass(frozen=True)
class InstanceSpec:
    """What every instance of a cluster is started with."""

    model_store: Path
    backend_processes: int
    server_args: tuple[str, ...] = ()
    cache_dir: Path | None = None

    def argv(self, port: int) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "mmserver",
            "serve",
            "--model-store",
            str(self.model_store),
            "--host",
            HOST,
            "--port",
            str(port),
            "--backend-processes",
            str(self.backend_processes),
        ]
        if self.cache_dir is not None:
            argv += ["--cache-dir", str(self.cache_dir)]
        return [*argv, *self.server_args]


class Instance(LoggedChild):
    """``mmserver serve`` named ``name`` on ``127.0.0.1:port``, its output in ``log_path``."""

    def __init__(self, name: str, port: int, spec: InstanceSpec, log_path: Path) -> None:
        super().__init__(log_path)
        self.name = name
        self.port = port
        self.spec = spec

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start the process (appending to the log); does not wait for it to be ready."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Flags win over the environment anyway; dropping these keeps the log unambiguous.
        for key in ("MMSERVER_HOST", "MMSERVER_PORT", "MMSERVER_BACKEND_PROCESSES"):
            env.pop(key, None)
        self.spawn(self.spec.argv(self.port), env)

    def ready(self) -> bool:
        return http_get(self.port, "/ping")[0] == 200

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_until(self.ready, self.failure, timeout, f"instance {self.name} on port {self.port}")

    def begin_stop(self) -> list[ProcessId]:
        """SIGTERM (the server drains its accepted requests); returns its descendants, taken
        before the signal, for :meth:`finish_stop`."""
        if self.ident is None:
            return []
        family = descendants(self.ident.pid)
        self.ident.signal(signal.SIGTERM)
        return family

    def finish_stop(self) -> None:
        reap(self.proc, 0.1)
        self.close_log()

    def to_json(self) -> dict[str, Any]:
        ident = self.ident.to_json() if self.ident else {}
        return {"name": self.name, "port": self.port, "log": str(self.log_path), **ident}


def stop_instances(instances: list[Instance], timeout: float = DRAIN_TIMEOUT_S) -> None:
    """SIGTERM to every instance at once (each drains its accepted requests), up to
    ``timeout`` s; then SIGKILL what is left, and their descendants."""
    families = [p for instance in instances for p in instance.begin_stop()]
    roots = [i.ident for i in instances if i.ident is not None]
    left = wait_gone(roots, timeout)
    kill_all(left)
    wait_gone(left, 5.0)
    kill_all(wait_gone(families, 5.0))
    for instance in instances:
        instance.finish_stop()
