"""The server a job starts for itself when it is given no ``--url``: ``mmserver serve`` over
``--model-store`` in a child process, on a free loopback port, stopped (SIGTERM, so it drains)
when the job ends. Its log goes to ``server.log`` in the job's journal folder. On Linux the
server also gets SIGTERM when the job's process dies any other way (SIGKILL included), so a
killed job leaves no server behind.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import TracebackType

from mmserver.commands.launch import Child, NotStarted, Serve
from mmserver.commands.procfs import free_port
from mmserver.commands.transform.failures import TransformError

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 15


class LocalServer:
    """``mmserver serve`` for one job; ``url`` is where it answers once entered."""

    def __init__(
        self, store: str, backend_processes: int, max_request_bytes: int, log_path: Path
    ) -> None:
        self.store = store
        self.log_path = log_path
        args = (
            # Larger than the largest payload: the framing of a payload may add a few bytes.
            "--max-request-size",
            str(max(max_request_bytes + 1024, 6 * 1024 * 1024)),
            # No asynchronous inference nor gRPC, whatever MMSERVER_STATE_DIR and
            # MMSERVER_GRPC_PORT say: that journal and that port are another server's.
            "--state-dir=",
            "--grpc-port=0",
        )
        serve = Serve(store, free_port(), backend_processes=backend_processes or None, args=args)
        self._server = Child(
            serve, log_path, label=f"the server over {store}", end_with_parent=True
        )
        self.port = serve.port
        self.url = serve.url

    async def __aenter__(self) -> LocalServer:
        # Started on the event loop's thread, which lives as long as the job: the parent-death
        # signal follows the thread that started the server.
        self._server.start()
        try:
            await asyncio.to_thread(self._server.wait_ready, START_TIMEOUT_S)
        except NotStarted:
            exited = self._server.exited() is not None
            await self.stop()
            if exited:
                tail = self._server.log_tail(LOG_TAIL_LINES)
                raise TransformError(
                    f"the server over {self.store} did not start:\n{tail}"
                ) from None
            raise TransformError(
                f"the server over {self.store} was not ready in {START_TIMEOUT_S} s"
            ) from None
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """SIGTERM (it drains), SIGKILL after :data:`STOP_TIMEOUT_S`, and its backends."""
        await asyncio.to_thread(self._server.stop, STOP_TIMEOUT_S)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
