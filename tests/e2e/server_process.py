"""The real ``mmserver serve`` as a child process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

import aiohttp
import psutil

from mmserver.commands.cluster import procfs
from mmserver.store.unpacking import PROCESS_NAME as UNPACK_PROCESS_NAME

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (backend processes hang under the fork server)."""
    return set(procfs.descendants(pid))


def unpacking(pid: int) -> bool:
    """Whether ``pid`` is one of the server's archive-unpacking processes."""
    try:
        return bool(psutil.Process(pid).name() == UNPACK_PROCESS_NAME)
    except psutil.Error:
        return False


def unpacking_pids(pid: int) -> list[int]:
    """The archive-unpacking processes below ``pid``."""
    return [child for child in descendants(pid) if unpacking(child)]


async def until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Wait for a condition of the server that has no event to wait on (checked every 20 ms)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not await condition():
        assert loop.time() < give_up, f"{what}: not reached in {timeout} s"
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        return procfs.live(psutil.Process(pid))
    except psutil.Error:
        return False


async def wait_gone(pids: set[int], timeout: float = 10.0) -> None:
    """Wait until none of ``pids`` is alive (the fork server and resource tracker exit as soon
    as they read the end of their pipes)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while [pid for pid in pids if alive(pid)]:
        assert loop.time() < give_up, "processes left behind"
        await asyncio.sleep(0.05)


class ServerProcess:
    """``python -m mmserver serve`` over ``store``; its log goes to ``log_path``."""

    #: Start the server as the leader of its own process group (as a shell or systemd does).
    new_session = False

    def __init__(self, store: Path, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store
        self.log_path = log_path
        self.args = args
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> ServerProcess:
        log = open(self.log_path, "wb")  # noqa: ASYNC230 - closed in __aexit__
        self._log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("MMSERVER_PORT", None)
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mmserver",
            "serve",
            "--model-store",
            str(self.store),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.args,
            stdout=log,
            stderr=log,
            cwd=ROOT,
            env=env,
            start_new_session=self.new_session,
        )
        await self.wait_ready()
        return self

    async def wait_ready(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        async with aiohttp.ClientSession() as session:
            while loop.time() < give_up:
                assert self.process is not None
                if self.process.returncode is not None:
                    raise AssertionError(f"server exited early:\n{self.log()}")
                try:
                    async with session.get(f"{self.url}/ping") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self, timeout: float) -> int:
        assert self.process is not None
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            family = descendants(process.pid)
            process.kill()
            await process.wait()
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()


def one_model_store(tmp_path: Path) -> Path:
    """A store holding the reference archive ``sklearn-0.tar.gz`` (y = 2x + 1)."""
    from tests.models import make_linear_archive

    store = tmp_path / "store"
    store.mkdir()
    make_linear_archive(store / "sklearn-0.tar.gz")
    return store


async def predict_ok(session: aiohttp.ClientSession, url: str, model: str = "sklearn-0") -> None:
    """One JSON prediction of ``model``, answered 200."""
    async with session.post(
        f"{url}/predictions/{model}",
        data="[[0.5]]",
        headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 200, await response.text()
