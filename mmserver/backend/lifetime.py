"""The lifetime of a process slot's process (:class:`ProcessLifetime`): its start, its death, its
replacement by a process that loads the same models, and its recycling."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from mmserver import errors
from mmserver.backend import wire
from mmserver.backend.loads import SlotLoads
from mmserver.backend.process import BackendProcess
from mmserver.backend.slot import Pending
from mmserver.backend.wire import LoadSpec
from mmserver.ops.metrics import Metrics

log = logging.getLogger(__name__)

_START_TIMEOUT = 60.0


class Messages(Protocol):
    """What a process's lifetime needs of the messages its slot sends (a
    :class:`~mmserver.backend.process_slot.ProcessSlot`)."""

    @property
    def stopping(self) -> bool: ...
    @property
    def held(self) -> Sequence[Pending]: ...
    def take_held(self) -> list[Pending]: ...
    async def connect(self, sock: socket.socket) -> asyncio.Future[Any]: ...
    def resume(self, first: Iterable[Pending] = ()) -> None: ...


class ProcessLifetime:
    """Starts a slot's process and replaces it when it dies.

    While the process is starting (or a replacement is), the slot holds new messages; they are
    written once the models of the slot are loaded again, so they never reach a process that
    lacks their model. After a death, in order: the slot holds the messages the dead process
    had not answered, the one it was running aside (:meth:`died`); that one fails once the exit
    code is known; a replacement starts and answers a ping; it is sent the loads of the slot's
    models (but those whose load is among the held messages), then the held messages in their
    order (:meth:`Messages.resume`); the slot's memory settles once the reloads are answered.
    """

    def __init__(
        self, slot: Messages, process: BackendProcess, loads: SlotLoads, metrics: Metrics
    ) -> None:
        self._slot = slot
        self._process = process
        self._loads = loads
        self._metrics = metrics
        self._starting: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        #: The message the dead process was running, failed once its exit code is known.
        self._crashed: list[Pending] = []
        #: Why the process is being replaced though it did not die (:meth:`recycle`).
        self._recycling: str | None = None
        #: A replacement is starting or loading its models again: its memory is not settled.
        self.settling = False

    async def start(self) -> None:
        """Start the process; returns once it answered a ping. What was sent meanwhile (a slot
        started on first use) is written then, or fails if the process could not start."""
        try:
            await self._spawn()
        except BaseException as exc:
            error = (
                exc
                if isinstance(exc, errors.MMServerError)
                else errors.BackendDied(f"{self._process.describe()} could not start: {exc}")
            )
            for pending in [*self._slot.take_held(), *self._loads.take_turns()]:
                pending.fail(error)
            raise
        self._slot.resume()

    def start_soon(self) -> None:
        """Start the process on first use (the heavy lane's slots start when a model needs
        them); a start that failed is tried again on the next use."""
        if self._process.started or self._slot.stopping:
            return
        if self._starting is None or self._starting.done():
            self._starting = asyncio.get_running_loop().create_task(
                self._start_once(), name=f"mmserver-backend-{self._process.index}-start"
            )

    async def _start_once(self) -> None:
        try:
            await self.start()
        except Exception as exc:
            log.error("%s could not start: %s", self._process.describe(), exc)

    async def _spawn(self) -> None:
        process = self._process
        ping = await self._slot.connect(await process.start())
        try:
            await asyncio.wait_for(asyncio.shield(ping), _START_TIMEOUT)
        except TimeoutError:
            process.kill()
            raise errors.BackendDied(
                f"{process.describe()} did not answer within {_START_TIMEOUT:.0f} s of starting"
            ) from None
        self._loads.restarted(process.resident_bytes())

    def recycle(self, reason: str) -> bool:
        """Kill the process so that it is replaced though it did not die, unless a replacement
        is under way or has not settled, or the process does not run; whether it did."""
        if self._restarting is not None or self.settling or self._process.live_pid is None:
            return False
        self._recycling = reason
        self._process.kill()
        return True

    async def stop(self) -> list[Pending]:
        """Start no process any more (the slot is stopping): the start or the replacement under
        way is cancelled. The messages a dead process was running that were not failed yet."""
        for task in (self._restarting, self._starting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        crashed, self._crashed = self._crashed, []
        return crashed

    def died(self, running: Pending | None) -> None:
        """The process's pipe was lost while it was ``running`` a message (``None``: it was
        idle), and the slot holds the rest: replace it."""
        if running is not None:
            if running.op == wire.PING:  # a replacement that died while starting
                running.fail(errors.BackendDied(f"{self._process.describe()} died while starting"))
            else:
                self._crashed.append(running)
        if self._restarting is None:
            self._restarting = asyncio.get_running_loop().create_task(
                self._restart(), name=f"mmserver-backend-{self._process.index}-restart"
            )

    async def _restart(self) -> None:
        """Replace a dead process: fail what it was running, reload its models, resend the rest."""
        slot, process, loads = self._slot, self._process, self._loads
        loop = asyncio.get_running_loop()
        reloads: list[asyncio.Future[Any]] = []
        specs: list[LoadSpec] = []
        self.settling = True
        while not slot.stopping:
            exit_code = await process.join(5.0)
            described = (
                f"backend process {process.index} (pid {process.pid}, exit code {exit_code})"
            )
            crashed, self._crashed = self._crashed, []
            for pending in crashed:
                pending.fail(
                    errors.BackendDied(
                        f"{described} died while running this request; it has been replaced, "
                        "so the request can be retried"
                    )
                )
            recycling, self._recycling = self._recycling, None
            running = running_models(crashed)
            self._metrics.backend_restarted(*running[:1])
            log.log(
                logging.INFO if recycling else logging.WARNING,
                "%s %s%s; starting a replacement to reload %d model(s) and resend %d message(s)",
                described,
                f"replaced: {recycling}" if recycling else "died",
                f" while running model(s) {', '.join(running)}" if running else "",
                len(loads.loaded),
                len(slot.held),
                extra={"model": running[0]} if len(running) == 1 else None,
            )
            await process.throttle()  # a crash loop: do not spin
            try:
                await self._spawn()
            except errors.BackendDied:
                continue  # the replacement died too, before answering its ping
            except Exception:
                log.exception("could not start a replacement for %s", described)
                await asyncio.sleep(1.0)
                continue
            # A load the dead process had not begun is sent again with the held messages.
            specs = loads.reloads(slot.held)
            reloads = [loop.create_future() for _ in specs]
            slot.resume(
                [
                    Pending((wire.LOAD, spec), reload)
                    for spec, reload in zip(specs, reloads, strict=True)
                ]
            )
            log.info("backend process %d replaced by pid %s", process.index, process.pid)
            break
        self._restarting = None
        results = await asyncio.gather(*reloads, return_exceptions=True)
        self.settling = False
        for spec, result in zip(specs, results, strict=True):
            if isinstance(result, BaseException):
                log.error("reloading %s into %s failed: %s", spec.key, process.describe(), result)
            else:
                loads.charge(spec.key, result)


def running_models(pending: list[Pending]) -> list[str]:
    """The models whose batches or loads ``pending`` (a dead process's messages in flight)
    were, in order, each once."""
    names: dict[str, None] = {}
    for each in pending:
        message = each.message
        key: Any = message[1] if len(message) > 1 else None
        if isinstance(key, LoadSpec):
            key = key.key
        if isinstance(key, str):
            names[key.split("#")[0]] = None
    return list(names)
