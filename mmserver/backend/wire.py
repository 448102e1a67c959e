"""What crosses the pipe between the frontend and a backend process, and how it is framed.

Each process is connected by one ``AF_UNIX`` stream socket (``multiprocessing.Pipe``); a message
is one frame in ``Connection.send_bytes`` framing (a 4-byte big-endian length, or ``-1`` and an
8-byte length) holding a pickle (protocol 5): ``(op, ...)`` from the frontend, ``(OK, result)``
or ``(ERR, error class name, message, the model the message names or None)`` back. A batch
travels as its requests' bodies, undecoded, and comes back as one encoded answer per request.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.backend.batching import Answer
from mmserver.config import ModelConfig

LOAD, PREDICT, UNLOAD, PING = 0, 1, 2, 3
OK, ERR = 0, 1

_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")


@dataclass(frozen=True)
class LoadSpec:
    """What a slot needs to load (and, after a restart, reload) one model."""

    key: str
    model_dir: Path
    config: ModelConfig


@dataclass(frozen=True)
class LoadInfo:
    """What loading a model in a slot reported: the memory one copy of it takes there (0 when
    it was loaded already), the CPU seconds of one prediction of a probe row (``None`` when
    the model could not be probed: a custom handler, or a model that does not say its width),
    and the model's :func:`~mmserver.predictor.signature` (``None`` when loaded already)."""

    memory_bytes: int
    probe_seconds: float | None = None
    #: The default handler's family and predict paths (``EstimatorPredictor.describe``).
    paths: dict[str, Any] | None = None
    signature: dict[str, Any] | None = None


#: A batch's answers (one per request), the CPU and wall seconds they took, the rows
#: predicted, and the predict path they took (``own`` for a custom handler).
BatchResult = tuple[list[Answer], float, float, int, str]


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
