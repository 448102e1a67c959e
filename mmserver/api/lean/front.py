"""The lean connections of one server (:class:`LeanFront`): the lean routes, the connections
counted and swept when idle, their drain and shutdown. Each connection is a
:class:`~mmserver.api.lean.connection.LeanConnection`, which the listener makes with its front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol as Structural

from mmserver.api.protocols import INVOKE_ASYNC, Route, match_lean
from mmserver.api.state import ApiState

#: The characters of a path the lean path takes (unreserved ones and ``/``).
_PATH_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~/-"
#: Seconds between looks at the lean connections' idle time.
_SWEEP_S = 1.0
#: While the server drains, a kept-alive connection idle this long is closed.
DRAIN_IDLE_S = 1.0
#: Paths whose route a lean front remembers (then it forgets them all and starts again).
_ROUTES_KEPT = 4096


class Kept(Structural):
    """What the front needs of one of its connections
    (:class:`~mmserver.api.lean.connection.LeanConnection`)."""

    #: When its last answer was written (:func:`time.monotonic`).
    idle_since: float
    #: Whether an answer was written on it.
    answered: bool

    @property
    def idle(self) -> bool: ...

    def close(self) -> None: ...

    def hand_off_stalled(self, since: float) -> None: ...

    async def shutdown(self, timeout: float | None) -> None: ...


class LeanFront:
    """The lean connections of one server: made by the listener, counted, swept when idle."""

    def __init__(
        self,
        state: ApiState,
        hand_off: Callable[[], asyncio.Protocol],
        refuse_past_limit: Callable[[asyncio.Transport], bool],
    ) -> None:
        config = state.config
        self.state = state
        self.hand_off = hand_off
        self.refuse_past_limit = refuse_past_limit
        self.max_request_size = config.max_request_size
        self.keepalive_timeout = config.keepalive_timeout
        #: Whether the server drains (:meth:`drain`): every answer closes its connection.
        self.draining = False
        self.send_timeout = config.send_timeout
        self.access_log = state.access_log
        #: Whether it takes ``InvokeEndpointAsync`` (:mod:`mmserver.api.lean.asynchronous`):
        #: with tenants, aiohttp's handler takes it (it checks the caller's rules).
        self.takes_async = (
            state.asynchronous is not None and state.access_log is None and state.tenants is None
        )
        #: Whether the server has tenants: each request is authenticated.
        self.tenants = state.tenants is not None
        self.connections: set[Kept] = set()
        #: Connections handed to aiohttp so far.
        self.handed_over = 0
        #: Requests the lean path took so far.
        self.taken = 0
        self._sweeper: asyncio.TimerHandle | None = None
        self._routes: dict[bytes, tuple[Route, dict[str, str]] | None] = {}

    def route(self, url: bytes) -> tuple[Route, dict[str, str]] | None:
        """The lean route of a request's target with the values of its placeholders, ``None``
        for a target the lean path does not take; remembered (matching costs more than the
        rest of a request's parse, and clients call few paths over and over)."""
        routes = self._routes
        try:
            return routes[url]
        except KeyError:
            pass
        matched = None
        if url[:1] == b"/" and not url.translate(None, _PATH_CHARS) and b"/." not in url:
            matched = match_lean(url.decode())
            if (
                matched is not None
                and matched[0].operation == INVOKE_ASYNC
                and not self.takes_async
            ):
                matched = None
        if len(routes) >= _ROUTES_KEPT:
            routes.clear()
        routes[url] = matched
        return matched

    def add(self, conn: Kept) -> None:
        """Count a connection made, and look at the connections' idle time while there are any."""
        self.connections.add(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for ``keepalive_timeout``."""
        self._sweeper = None
        now = time.monotonic()
        oldest = now - self.keepalive_timeout
        stalled = now - _SWEEP_S
        self._close_idle(oldest)
        for conn in list(self.connections):
            conn.hand_off_stalled(stalled)
        if self.connections:
            self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)

    def close_all(self) -> None:
        for conn in list(self.connections):
            conn.close()

    def drain(self) -> None:
        """The server drains: close the kept-alive connections idle for :data:`DRAIN_IDLE_S`
        now, and those that become so from now on (their clients go elsewhere, not to a 503).
        A connection that has not been answered yet is kept: its first request may be on its
        way, and is answered (503, ``Connection: close``)."""
        self.keepalive_timeout = min(self.keepalive_timeout, DRAIN_IDLE_S)
        self.draining = True
        self._close_idle(time.monotonic() - DRAIN_IDLE_S)

    def _close_idle(self, oldest: float) -> None:
        for conn in list(self.connections):
            if conn.idle_since < oldest and conn.idle and (conn.answered or not self.draining):
                conn.close()

    async def shutdown(self, timeout: float | None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await asyncio.gather(*(conn.shutdown(timeout) for conn in list(self.connections)))
