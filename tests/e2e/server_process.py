"""The real ``mmserver serve`` as a child process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType

import aiohttp
import psutil

from mmserver.commands import procfs
from mmserver.commands.launch import Child, Serve
from mmserver.commands.procfs import free_port
from mmserver.store.unpacking import PROCESS_NAME as UNPACK_PROCESS_NAME
from tests.behaviour_models import handler_models

ROOT = Path(__file__).resolve().parents[2]


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
    """``python -m mmserver serve`` over ``store``, started by the launcher
    (:class:`mmserver.commands.launch.Child`); its log goes to ``log_path``. Leaving the block
    kills it and its descendants at once: a test that wants the drain sends SIGTERM itself.
    ``env``: changes to its environment (this process's otherwise)."""

    #: Start the server as the leader of its own process group (as a shell or systemd does).
    new_session = False

    def __init__(
        self, store: Path, log_path: Path, *args: str, env: Mapping[str, str | None] | None = None
    ) -> None:
        self.store = store
        self.log_path = log_path
        if "--trusted-models" not in args:
            # The tests' model doubles are custom handlers: trusted by name, in the shared
            # backend processes, as the models they stand for would be.
            handlers = handler_models(store)
            if handlers:
                args = (*args, "--trusted-models", handlers, "--no-isolate-trusted")
        self.args = args
        self.child = Child(
            Serve(store, free_port(), args=args),
            log_path,
            label="the server",
            cwd=ROOT,
            new_session=self.new_session,
            append=False,
            env=env,
        )
        self.port = self.child.port
        self.url = self.child.url

    async def __aenter__(self) -> ServerProcess:
        self.child.start()
        try:
            await self.wait_ready()
        except BaseException:
            await asyncio.to_thread(self.child.kill)
            raise
        return self

    async def wait_ready(self, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.child.wait_ready, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.child.pid

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.child.send_signal(signum)

    async def wait(self, timeout: float) -> int:
        """The exit code once the server has exited on its own; ``TimeoutError`` after
        ``timeout`` s."""
        return await asyncio.to_thread(self.child.wait_exit, timeout)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.child.kill)


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


async def metric_total(session: aiohttp.ClientSession, url: str, *starts: str) -> float:
    """The sum of the samples of ``url``'s ``/metrics`` whose lines start with one of
    ``starts``."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(starts)
    )
