"""The servers under test: mmserver and the HTTP floor, started on free loopback ports.

Each is a child process of the benchmark (:class:`mmserver.commands.launch.Child`), stopped with
SIGTERM (then SIGKILL), and any descendant still alive after that (mmserver's fork server and
backend processes) by pid too.
"""

from __future__ import annotations

import sys
from pathlib import Path

from proctools import free_port

from mmserver.commands.launch import Child, Serve

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 40.0


class Server:
    """One server process on ``127.0.0.1:port``, its output written to ``log``."""

    def __init__(
        self,
        name: str,
        command: Serve | list[str],
        port: int,
        log: Path,
        cwd: Path | None = None,
        *,
        health: str = "/ping",
        api: str | None = None,
        grpc_port: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        #: The inference path its load uses (None: the benchmark's --api).
        self.api = api
        self.port = port
        #: The port of its Open Inference Protocol over gRPC (0: none).
        self.grpc_port = grpc_port
        self.log_path = log
        #: ``env``: variables set for the process besides this one's environment.
        self._child = Child(
            command,
            log,
            label=name,
            port=port,
            health=health,
            env=env,
            cwd=cwd,
            append=False,
        )

    @property
    def url(self) -> str:
        return self._child.url

    @property
    def pid(self) -> int:
        return self._child.pid

    def start(self) -> Server:
        """Start it and wait until its health path answers 200 (stopping it if it does not)."""
        self._child.start()
        try:
            self._child.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self._child.stop(STOP_TIMEOUT_S)
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL the process and whatever it left behind, by pid."""
        self._child.stop(STOP_TIMEOUT_S)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mmserver(
    store: Path,
    cache: Path,
    log: Path,
    extra: list[str],
    exe: Path | None = None,
    grpc: bool = False,
    env: dict[str, str] | None = None,
) -> Server:
    """mmserver on the store (started by the caller); with ``grpc``, serving gRPC too; ``env``:
    variables set for it besides the bench's own."""
    grpc_port = free_port() if grpc else 0
    serve = Serve(
        store.resolve(),
        free_port(),
        cache_dir=cache.resolve(),
        args=(*(["--grpc-port", str(grpc_port)] if grpc_port else []), *extra),
        exe=exe or Path(sys.executable).with_name("mmserver"),
    )
    # Run outside any checkout: the backend processes import the package the executable was
    # installed with, not a source tree that happens to be the working directory.
    return Server(
        "mmserver",
        serve,
        serve.port,
        log,
        cwd=cache.resolve().parent,
        grpc_port=grpc_port,
        env=env,
    )


def floor(log: Path, kind: str = "aiohttp") -> Server:
    """The HTTP floor of ``kind`` (``aiohttp`` or ``raw``: see ``floor.py``)."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("floor.py")), "--port", str(port)]
    if kind == "raw":
        argv.append("--raw")
    return Server("floor", argv, port, log)
