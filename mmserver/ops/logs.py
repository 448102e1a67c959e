"""The server's log: one line a record on stderr, as text or as JSON (``log_format``).

JSON lines carry ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``,
and ``model`` and ``request_id`` where the record has them (``extra={"model": ...}`` at the
call), and ``exception`` with the traceback when there is one: what a log pipeline (Loki,
CloudWatch, Elasticsearch) indexes without a parser of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

#: The record attributes a JSON line carries besides the fixed ones, when a record has them.
#: (The access log writes its own lines, with these and its own fields:
#: :mod:`mmserver.api.accesslog`.)
CONTEXT = ("model", "request_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, default=str)


#: The logger of what models do that the operator should see (their errors, their output).
MODEL_LOGGER = "mmserver.model"


class ModelErrorLog:
    """One warning line a minute for each model whose own code raises (answered 424), with
    the error and how many more it raised meanwhile: a model failing on every request says so
    without a line per request. One per server (:class:`~mmserver.api.state.ApiState`)."""

    #: Seconds between two lines of one model.
    every_s = 60.0
    #: Models remembered at most (the one whose line is oldest is forgotten first).
    MAX_MODELS = 10_000

    def __init__(self) -> None:
        #: By model, oldest line first: when its last line was written, and the errors since.
        self._seen: dict[str, tuple[float, int]] = {}

    def raised(self, model: str, message: str, rid: str) -> None:
        now = time.monotonic()
        last = self._seen.get(model)
        if last is not None and now - last[0] < self.every_s:
            self._seen[model] = (last[0], last[1] + 1)
            return
        more = last[1] if last is not None else 0
        self._seen.pop(model, None)
        if len(self._seen) >= self.MAX_MODELS:
            del self._seen[next(iter(self._seen))]
        self._seen[model] = (now, 0)
        logging.getLogger(MODEL_LOGGER).warning(
            "model %s raised: %s (%s)%s",
            model,
            message,
            rid,
            f"; {more} more in the last {self.every_s:.0f} s" if more else "",
            extra={"model": model, "request_id": rid},
        )


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def held() -> Iterator[list[logging.LogRecord]]:
    """Keep the records logged before the log is set up (while the configuration that says
    how is being read), to be written by :func:`replay` once it is, in its format."""
    handler = _Held()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)


def replay(records: Iterable[logging.LogRecord]) -> None:
    """Write records kept by :func:`held`, now that the log is set up."""
    for record in records:
        logging.getLogger(record.name).handle(record)


#: The variables that carry the log's level and format to the processes the server starts (the
#: backend processes read them: :func:`setup_backend`); the options' own environment names.
LEVEL_VARIABLE, FORMAT_VARIABLE = "MMSERVER_LOG_LEVEL", "MMSERVER_LOG_FORMAT"


def setup(level: str, log_format: str = "text") -> None:
    """Log records of ``level`` and above to stderr, as ``log_format`` says; the processes the
    server starts from now on log the same way."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    os.environ[LEVEL_VARIABLE], os.environ[FORMAT_VARIABLE] = level, log_format


class _Running(logging.Filter):
    """Names the model a backend process runs in the records that do not name one."""

    def __init__(self, model: Callable[[], str | None]) -> None:
        super().__init__()
        self._model = model

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "model", None) is None:
            record.model = self._model()
        return True


def setup_backend(model: Callable[[], str | None]) -> None:
    """A backend process's log, as the server's (:func:`setup`), each record naming the model
    the process runs (``model()``), Python's warnings included. With the JSON format, whatever
    the process writes to its standard output and error (a model's ``print``, a native
    library's messages) becomes a record too, a line each, so that every line of the log is
    JSON: output at ``INFO``, errors at ``WARNING``, logger ``mmserver.model.output``."""
    level = os.environ.get(LEVEL_VARIABLE, "INFO")
    json_lines = os.environ.get(FORMAT_VARIABLE, "text") == "json"
    stream = sys.stderr
    if json_lines:
        stream = os.fdopen(os.dup(2), "w", buffering=1)  # the log's own way out
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_Running(model))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    if not json_lines:
        return
    output = logging.getLogger(OUTPUT_LOGGER)
    for fd, at in ((1, logging.INFO), (2, logging.WARNING)):
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        threading.Thread(
            target=_lines, args=(read, output, at), name=f"mmserver-output-{fd}", daemon=True
        ).start()
    for text in (sys.stdout, sys.stderr):
        if isinstance(text, io.TextIOWrapper):
            text.reconfigure(line_buffering=True)  # a print is a line of the log when printed


#: The logger of what a backend process writes to its standard output and error.
OUTPUT_LOGGER = "mmserver.model.output"


def _lines(fd: int, logger: logging.Logger, level: int) -> None:
    """Log each line written to the pipe ``fd`` until it closes."""
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            if text:
                logger.log(level, "%s", text)
