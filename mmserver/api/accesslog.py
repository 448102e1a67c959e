"""The access log (``access_log``, off by default): one line per answered request, whichever
door answered it, among the server's log lines on stderr.

A line says the method, the path, the status, the time in the server, the model the request
named (``-`` for none), the request id and the bytes of the answer. As text, after the log's
usual time, level and ``mmserver.access:``:
``POST /predictions/m 200 1.84 ms model=m bytes=31 4f2a9c1e-1b``; with ``--log-format json``
each is a field of its own (``method``, ``path``, ``status``, ``latency_ms``, ``model``,
``request_id``, ``bytes``) beside ``time``, ``level``, ``logger`` and ``message``, as
:class:`mmserver.ops.logs.JsonFormatter` writes every other record.

The log is buffered, as nginx's ``access_log ... buffer= flush=`` is: a request's line costs a
tuple when it is answered, and the lines kept are formatted together and written in one call
once :data:`FLUSH_LINES` are kept or :data:`FLUSH_S` after the first of them, whichever comes
first, and when the server stops (:class:`AccessLog`). A record through :mod:`logging` a request,
with its record object, lock, formatter and write, cost about 27 µs a request (40 as JSON) on a
path that answers one in about 100: the lean path's throughput fell by 39 % with it on. The lean
path writes its lines itself; aiohttp's access logger (:class:`~mmserver.api.web.AccessLogger`)
writes the others' to the same log.
"""

from __future__ import annotations

import asyncio
import json.encoder
import sys
import time

#: Where an inference handler leaves the model a request named, for :class:`AccessLogger`.
MODEL_KEY = "mmserver_model"
#: The logger name the lines carry, as a record of :mod:`logging` would.
LOGGER = "mmserver.access"

#: Lines kept before they are written at once.
FLUSH_LINES = 256
#: Seconds a line may be kept before it is written.
FLUSH_S = 0.2

_Line = tuple[float, str, str, int, float, str, str, int]


class AccessLog:
    """The access log of one server: :meth:`write` keeps a line, :meth:`flush` writes the lines
    kept to stderr in ``log_format`` (``text`` or ``json``): when :data:`FLUSH_LINES` are
    kept, :data:`FLUSH_S` after the first, and when the server stops."""

    def __init__(self, log_format: str = "text") -> None:
        json_lines = log_format == "json"
        self._format = self._json_line if json_lines else self._text_line
        self._second_format = _utc_second if json_lines else _local_second
        self._lines: list[_Line] = []
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._second_text = ""

    def write(
        self, method: str, path: str, status: int, seconds: float, model: str, rid: str, size: int
    ) -> None:
        """Keep one request's line, written with others (see the class)."""
        lines = self._lines
        if not lines:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
        lines.append((time.time(), method, path, status, seconds, model, rid, size))
        if len(lines) >= FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        """Write the lines kept so far, in one call."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._lines = self._lines, []
        if lines:
            text = "".join([self._format(line) for line in lines])
            stream = sys.stderr
            stream.write(text)
            stream.flush()

    def _second_of(self, created: float) -> tuple[str, int]:
        """The formatted second of ``created`` (remembered: a turn's lines share it) and its
        milliseconds."""
        second = int(created)
        if second != self._second:
            self._second_text = self._second_format(second)
            self._second = second
        return self._second_text, int((created - second) * 1000)

    def _text_line(self, line: _Line) -> str:
        created, method, path, status, seconds, model, rid, size = line
        second, millis = self._second_of(created)
        message = _message(method, path, status, seconds * 1000, model, size, rid)
        return f"{second},{millis:03d} INFO {LOGGER}: {message}\n"

    def _json_line(self, line: _Line) -> str:
        created, method, path, status, seconds, model, rid, size = line
        second, millis = self._second_of(created)
        latency_ms = round(seconds * 1000, 3)
        message = _message(method, path, status, latency_ms, model, size, rid)
        # What json.dumps writes for these fields, in JsonFormatter's order, at a third of its
        # cost: the strings through json's own escaping, the numbers as json writes them.
        return (
            f'{{"time": "{second}.{millis:03d}+00:00", "level": "INFO", "logger": "{LOGGER}", '
            f'"message": {_quote(message)}, "model": {_quote(model)}, '
            f'"request_id": {_quote(rid)}, "method": {_quote(method)}, '
            f'"path": {_quote(path)}, "status": {status:d}, "latency_ms": {latency_ms!r}, '
            f'"bytes": {size:d}}}\n'
        )


def _message(
    method: str, path: str, status: int, latency_ms: float, model: str, size: int, rid: str
) -> str:
    """A line's message, the same in both formats."""
    return (
        f"{method} {shown_path(path)} {status} {latency_ms:.2f} ms model={model} bytes={size} {rid}"
    )


def _local_second(second: int) -> str:
    # logging.Formatter's asctime, before its milliseconds.
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))


def _utc_second(second: int) -> str:
    # JsonFormatter's time (ISO 8601, UTC), before its milliseconds.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


_quote = json.encoder.encode_basestring_ascii


def shown_path(path: str, limit: int = 200) -> str:
    """``path`` as a log line or an error message shows it (cut past ``limit`` characters)."""
    return path if len(path) <= limit else path[: limit - 3] + "..."
