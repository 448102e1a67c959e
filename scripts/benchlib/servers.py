"""The servers under test: mmserver and the HTTP floor, started on free loopback ports.

Each is a child process of the benchmark, stopped by its pid with SIGTERM (then SIGKILL), and
any descendant still alive after that (mmserver's fork server and backend processes) by pid too.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from proctools import (
    HOST,
    descendants,
    free_port,
    kill_left,
)

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 40.0


def _ping(port: int, path: str = "/ping") -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class Server:
    """One server process on ``127.0.0.1:port``, its output appended to ``log``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
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
        #: Variables set for the process besides this one's environment.
        self.env = env
        self.argv = argv
        self.cwd = cwd
        self.health = health
        #: The inference path its load uses (None: the benchmark's --api).
        self.api = api
        self.port = port
        #: The port of its Open Inference Protocol over gRPC (0: none).
        self.grpc_port = grpc_port
        self.log_path = log
        self._log: IO[bytes] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env={**os.environ, **self.env} if self.env else None,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} at start; see {self.log_path}"
                )
            if _ping(self.port, self.health):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not answer {self.health} within {READY_TIMEOUT_S:.0f} s"
        )

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL the process and whatever it left behind, by pid."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        left = descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_left(left, 5.0)
        if self._log is not None:
            self._log.close()
            self._log = None

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
    port = free_port()
    grpc_port = free_port() if grpc else 0
    exe = exe or Path(sys.executable).with_name("mmserver")
    argv = [
        str(exe),
        "serve",
        "--model-store",
        str(store.resolve()),
        "--cache-dir",
        str(cache.resolve()),
        "--host",
        HOST,
        "--port",
        str(port),
        *(["--grpc-port", str(grpc_port)] if grpc_port else []),
        *extra,
    ]
    # Run outside any checkout: the backend processes import the package the executable was
    # installed with, not a source tree that happens to be the working directory.
    return Server(
        "mmserver", argv, port, log, cwd=cache.resolve().parent, grpc_port=grpc_port, env=env
    )


def floor(log: Path, kind: str = "aiohttp") -> Server:
    """The HTTP floor of ``kind`` (``aiohttp`` or ``raw``: see ``floor.py``)."""
    port = free_port()
    argv = [sys.executable, str(Path(__file__).with_name("floor.py")), "--port", str(port)]
    if kind == "raw":
        argv.append("--raw")
    return Server("floor", argv, port, log)
