"""The server's log: one line a record on stderr, as text or as JSON (``log_format``).

JSON lines carry ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``,
and ``model`` and ``request_id`` where the record has them (``extra={"model": ...}`` at the
call), and ``exception`` with the traceback when there is one: what a log pipeline (Loki,
CloudWatch, Elasticsearch) indexes without a parser of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
from collections.abc import Iterable, Iterator

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


def setup(level: str, log_format: str = "text") -> None:
    """Log records of ``level`` and above to stderr, as ``log_format`` says."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
