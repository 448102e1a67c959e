"""One mmserver instance: ``mmserver serve`` on a loopback port, a child process of the cluster.

Each instance runs in its own session, so a Ctrl-C in the terminal reaches only the cluster's
supervisor, which stops the instances in its own order (the balancer first, then the instances,
each draining its accepted requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.commands.launch import STOP_TIMEOUT_S, Child, Serve, stop_all


@dataclass(frozen=True)
class InstanceSpec:
    """What every instance of a cluster is started with."""

    model_store: Path
    backend_processes: int
    server_args: tuple[str, ...] = ()
    cache_dir: Path | None = None
    #: With a state directory of its own: the server's ``warm_ready_timeout`` (an argument of
    #: ``server_args`` wins).
    warm_ready_timeout: float = 0.0

    def serve(self, port: int, state_dir: Path | None = None, peers: str = "") -> Serve:
        """The command line of an instance on ``port``; with ``state_dir``, the server's own
        ``state_dir`` (its warm set: the models it had loaded come back at its next start);
        with ``peers``, the instances its management calls are sent on to."""
        own: tuple[str, ...] = (f"--peers={peers}",) if peers else ()
        if state_dir is not None:
            own += (f"--state-dir={state_dir}", f"--warm-ready-timeout={self.warm_ready_timeout:g}")
        return Serve(
            self.model_store,
            port,
            backend_processes=self.backend_processes,
            cache_dir=self.cache_dir,
            args=(*own, *self.server_args),
        )


class Instance(Child):
    """``mmserver serve`` named ``name`` on ``127.0.0.1:port``, its output appended to
    ``log_path``; :meth:`start` does not wait for it to be ready, :meth:`wait_ready` does."""

    def __init__(
        self,
        name: str,
        port: int,
        spec: InstanceSpec,
        log_path: Path,
        state_dir: Path | None = None,
        peers: str = "",
    ) -> None:
        super().__init__(
            spec.serve(port, state_dir, peers), log_path, label=f"instance {name}", new_session=True
        )
        self.name = name
        self.spec = spec
        self.state_dir = state_dir

    def to_json(self) -> dict[str, Any]:
        ident = self.ident.to_json() if self.ident else {}
        state = {"state_dir": str(self.state_dir)} if self.state_dir is not None else {}
        return {"name": self.name, "port": self.port, "log": str(self.log_path), **state, **ident}


def stop_instances(instances: list[Instance], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to every instance at once (each drains its accepted requests), up to
    ``timeout`` s; then SIGKILL what is left, and their descendants."""
    stop_all(instances, timeout)
