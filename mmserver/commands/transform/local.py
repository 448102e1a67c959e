"""The server a job starts for itself when it is given no ``--url``: ``mmserver serve`` over
``--model-store`` in a child process, on a free loopback port, stopped (SIGTERM, so it drains)
when the job ends. Its log goes to ``server.log`` in the job's journal folder. On Linux the
server also gets SIGTERM when the job's process dies any other way (SIGKILL included), so a
killed job leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from mmserver.commands.cluster.procfs import HOST, free_port
from mmserver.commands.transform.connections import Connections, Unreachable
from mmserver.commands.transform.failures import TransformError

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


_PR_SET_PDEATHSIG = 1


def _ending_with_parent() -> Callable[[], None] | None:
    """What the child runs before the server so that it gets SIGTERM when its parent dies
    (Linux; ``None`` elsewhere). The C library is found here, before the fork: the child may
    only make the call."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return hook


class LocalServer:
    """``mmserver serve`` for one job; ``url`` is where it answers once entered."""

    def __init__(
        self, store: str, backend_processes: int, max_request_bytes: int, log_path: Path
    ) -> None:
        self.store = store
        self.backend_processes = backend_processes
        self.max_request_bytes = max_request_bytes
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [
            "-m",
            "mmserver",
            "serve",
            "--model-store",
            self.store,
            "--host",
            HOST,
            "--port",
            str(self.port),
            # Larger than the largest payload: the framing of a payload may add a few bytes.
            "--max-request-size",
            str(max(self.max_request_bytes + 1024, 6 * 1024 * 1024)),
            # No asynchronous inference nor gRPC, whatever MMSERVER_STATE_DIR and
            # MMSERVER_GRPC_PORT say: that journal and that port are another server's.
            "--state-dir=",
            "--grpc-port=0",
        ]
        if self.backend_processes:
            args += ["--backend-processes", str(self.backend_processes)]
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230 - opening a log is quick
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                *args,
                stdout=log,
                stderr=log,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=_ending_with_parent(),
            )
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + START_TIMEOUT_S
        connections = Connections(self.url, 1, START_TIMEOUT_S)
        try:
            while loop.time() < give_up:
                assert self._process is not None
                if self._process.returncode is not None:
                    raise TransformError(
                        f"the server over {self.store} did not start:\n{self._log_tail()}"
                    )
                with contextlib.suppress(Unreachable):
                    if (await connections.request("GET", "/ping", b"", {})).status == 200:
                        return
                await asyncio.sleep(0.1)
        finally:
            await connections.close()
        raise TransformError(f"the server over {self.store} was not ready in {START_TIMEOUT_S} s")

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-15:])

    async def stop(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
