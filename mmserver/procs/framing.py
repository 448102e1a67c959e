"""Frames on a process's pipe: ``Connection.send_bytes`` framing (a 4-byte big-endian length, or
``-1`` and an 8-byte length) holding a pickle (protocol 5), so that a child reading with
``multiprocessing.connection.Connection.recv`` and a frontend reading on the event loop speak the
same. Used by the backend processes (:mod:`mmserver.backend.wire`) and the unpacking processes
(:mod:`mmserver.store.unpacking`)."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


def frame(message: tuple[Any, ...]) -> list[bytes]:
    """``message`` as the parts of one frame (header and pickle), for one vectored write."""
    payload = pickle.dumps(message, protocol=5)
    if len(payload) < 0x7FFFFFFF:
        return [_HEADER.pack(len(payload)), payload]
    return [_HEADER.pack(-1), _LONG_HEADER.pack(len(payload)), payload]


def span(buffer: bytes | bytearray, offset: int) -> tuple[int, int] | None:
    """``(start, end)`` of the payload of the frame at ``offset`` in ``buffer`` (``end`` may
    lie past what the buffer holds yet), or ``None`` while its header is incomplete."""
    have = len(buffer) - offset
    if have < 4:
        return None
    (size,) = _HEADER.unpack_from(buffer, offset)
    if size != -1:
        return offset + 4, offset + 4 + size
    if have < 12:
        return None
    (size,) = _LONG_HEADER.unpack_from(buffer, offset + 4)
    return offset + 12, offset + 12 + size


class FrameProtocol(asyncio.Protocol):
    """Reads frames on the event loop (a process's replies): each message, unpickled, goes to
    ``on_message`` in order; ``on_read`` runs once the messages of one read were handed over;
    ``on_lost`` gets the protocol when the connection is lost."""

    def __init__(
        self,
        on_message: Callable[[Any], None],
        on_lost: Callable[[FrameProtocol], None],
        on_read: Callable[[], None] | None = None,
        loads: Callable[[Any], Any] = pickle.loads,
    ) -> None:
        """``loads`` unpickles each message (:func:`mmserver.procs.replies.data_loads` for a
        process that runs a model's own code)."""
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self._loads = loads
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_read = on_read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        on_message, loads = self._on_message, self._loads
        # Every whole frame read is parsed in place; the buffer is trimmed once, at the end.
        offset = 0
        try:
            while (found := span(buf, offset)) is not None and found[1] <= len(buf):
                start, end = found
                with memoryview(buf) as view:
                    message = loads(view[start:end])
                offset = end
                on_message(message)
        finally:
            del buf[:offset]
            if offset and self._on_read is not None:
                self._on_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(self)


class FrameReader:
    """Reads frames from the frontend's socket: small ones from a 64 KiB read buffer (one
    ``recv`` brings every message queued meanwhile), large ones straight into a buffer of their
    exact size, with no intermediate copies."""

    _CHUNK = 65536

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._chunk = bytearray(self._CHUNK)
        self._view = memoryview(self._chunk)

    def _fill(self, want: int) -> bool:
        while len(self._buffer) < want:
            count = self._sock.recv_into(self._chunk)
            if count == 0:
                return False
            self._buffer += self._view[:count]
        return True

    def read(self) -> bytes | bytearray | None:
        """The next frame's payload, or ``None`` once the frontend closed the socket."""
        buffer = self._buffer
        if not self._fill(4):
            return None
        found = span(buffer, 0)
        if found is None:  # a long frame's header
            if not self._fill(12):
                return None
            found = span(buffer, 0)
            assert found is not None
        start, end = found
        size = end - start
        if size <= self._CHUNK:
            if not self._fill(end):
                return None
            frame = bytes(buffer[start:end])
            del buffer[:end]
            return frame
        large = bytearray(size)
        have = min(len(buffer) - start, size)
        large[:have] = buffer[start : start + have]
        del buffer[: start + have]
        view = memoryview(large)
        while have < size:
            count = self._sock.recv_into(view[have:])
            if count == 0:
                return None
            have += count
        return large


def send_frame(sock: socket.socket, frame: list[bytes]) -> None:
    sent = sock.sendmsg(frame)
    total = sum(len(part) for part in frame)
    if sent < total:  # a partial write: send the rest in order
        sock.sendall(b"".join(frame)[sent:])
