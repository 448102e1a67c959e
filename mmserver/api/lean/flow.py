"""A lean connection's flow control (:class:`LeanFlow`, the shape of uvicorn's
``FlowControl``)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class LeanFlow:
    """A lean connection's flow control (uvicorn's ``FlowControl`` shape): reading is paused
    while the socket's send buffer is full, and once it has been full for ``send_timeout`` the
    connection is aborted, so the answers the client does not take free their memory. The
    connection pauses reading for its own reasons too (answers owed, a hand-over) through
    :meth:`pause_reading` and :meth:`resume_reading`; each calls the transport only on a change."""

    __slots__ = ("_send_timeout", "_stall", "_transport", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport, send_timeout: float) -> None:
        self._transport = transport
        self._send_timeout = send_timeout
        self._stall: asyncio.TimerHandle | None = None
        self.read_paused = False
        self.write_paused = False

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        """The send buffer is full: read no more, and start the ``send_timeout`` clock."""
        self.write_paused = True
        self.pause_reading()
        if self._send_timeout and self._stall is None:
            self._stall = asyncio.get_running_loop().call_later(self._send_timeout, self._stalled)

    def resume_writing(self) -> None:
        """The send buffer drained: stop the clock (reading resumes when the connection says)."""
        self.write_paused = False
        self.stop()

    def stop(self) -> None:
        """Stop the ``send_timeout`` clock (the connection is lost or handed over)."""
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        log.info(
            "dropped a connection whose client did not take its answers within %g s (send_timeout)",
            self._send_timeout,
        )
        self._transport.abort()
