"""Large asynchronous inputs in pieces: a line-based input (CSV, libsvm) larger than
``max_request_size`` is read in pieces that end at line ends (:func:`pieces`), each one a
request of its own, and their answers are joined on disk (:class:`AnswerJoiner`) into the body
the whole input's answer would have had. So the frontend holds one piece and its answer at a
time, never the whole input or the whole answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from mmserver.codecs.requests import CSV, LIBSVM, X_LIBSVM, has_header, media_type
from mmserver.errors import ModelError

#: The content types whose bodies are rows, one a line: they may be cut at line ends.
LINE_TYPES = (CSV, LIBSVM, X_LIBSVM)
#: Bytes read from an input at a time.
READ_BYTES = 1 << 20

_JSON_HEAD = b'{"predictions": ['
_JSON_TAIL = b"]}"


def splittable(content_type: str | None) -> bool:
    """Whether bodies of ``content_type`` may be cut into pieces at line ends."""
    return media_type(content_type) in LINE_TYPES


def pieces(stream: IO[bytes] | Any, limit: int, content_type: str | None) -> Iterator[bytes]:
    """The body read from ``stream`` in pieces of whole lines, each at most ``limit`` bytes
    unless one line alone is longer (it is then a piece of its own). A CSV body whose content
    type says ``header=present`` has its first line repeated at the head of every piece."""
    header = b""
    keep_header = has_header(content_type or "")
    buffered = b""
    while True:
        chunk = stream.read(READ_BYTES)
        if not chunk:
            break
        buffered += chunk
        if keep_header and not header:
            end = buffered.find(b"\n")
            if end < 0:
                continue
            header, buffered = buffered[: end + 1], buffered[end + 1 :]
        room = max(1, limit - len(header))
        while len(buffered) > room:
            cut = buffered.rfind(b"\n", 0, room)
            if cut < 0:  # one line longer than a piece: up to its end
                cut = buffered.find(b"\n", room)
                if cut < 0:
                    break  # its end has not been read yet
            yield header + buffered[: cut + 1]
            buffered = buffered[cut + 1 :]
    if buffered.strip():
        yield header + buffered


class AnswerJoiner:
    """Writes the answers of an input's pieces, in order, to ``path`` as one body: JSON
    ``{"predictions": [...]}`` answers as one such list, CSV (and any other text) answers one
    after the other. Raises :class:`ModelError` for answers that cannot be joined (of different
    content types, or JSON of another shape)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.content_type: str | None = None
        self._out = open(path, "wb")  # closed by close() or discard()
        self._json = False
        self._items = False
        self._ends_line = True
        self.pieces = 0

    def add(self, body: bytes, content_type: str) -> None:
        if self.content_type is None:
            self.content_type = content_type
            self._json = media_type(content_type) == "application/json"
            if self._json:
                self._out.write(_JSON_HEAD)
        elif content_type != self.content_type:
            raise ModelError(
                f"the answers of the input's pieces have different content types "
                f"({self.content_type}, {content_type}): they cannot be joined"
            )
        if self._json:
            if not (body.startswith(_JSON_HEAD) and body.endswith(_JSON_TAIL)):
                raise ModelError(
                    "the model's answer to a piece of the input is not "
                    '{"predictions": [...]}: the pieces\' answers cannot be joined'
                )
            items = body[len(_JSON_HEAD) : -len(_JSON_TAIL)]
            if items:
                if self._items:
                    self._out.write(b", ")
                self._out.write(items)
                self._items = True
        else:
            if body and not self._ends_line:
                self._out.write(b"\n")
            self._out.write(body)
            if body:
                self._ends_line = body.endswith(b"\n")
        self.pieces += 1

    def close(self) -> None:
        """End the body and sync it to disk."""
        if self._json:
            self._out.write(_JSON_TAIL)
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()

    def discard(self) -> None:
        self._out.close()
        self.path.unlink(missing_ok=True)
