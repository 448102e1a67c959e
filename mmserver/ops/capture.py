"""Data capture: a sample of each model's requests and answers, written as SageMaker's data
capture writes them, off the request path.

A model's ``option.capture_percent`` is the share of its answered requests captured, to the
server's ``capture_path`` (a folder or ``s3://bucket/prefix``). After the answer is sent, the
request path draws the sample and puts the record (the request's and the answer's bodies, as
they are) in a bounded buffer (``capture_buffer`` records): when it is full the record is
dropped and counted (``mmserver_capture_dropped_total``), never an answer slowed. The records'
JSON lines are made on the event loop, :data:`ENCODE_BATCH` records at a time, when that many
are waiting (a form per pair of content types and the C JSON encoder: a few microseconds a
line). Made one at a time after each answer, a line cost the event loop about 9 us in the hot
pattern against about 5.5 us made in a batch, measured in the server (and a 100 % capture
served 18 % fewer requests a second); made in the writer's thread, it cost more still (a thread
that computes holds the interpreter's lock, and the event loop then waits for it after each of
its system calls: 30 % fewer requests a second and a p99 of 355 ms).
One thread (:class:`Capture`, started and stopped with the application) takes the lines at
most :data:`FLUSH_S` seconds after the first of them came and writes them; it makes the lines of
the records short of a batch itself (fewer than :data:`ENCODE_BATCH`: well under a
millisecond). A record's line is made of its bodies only, so nothing of a request is kept past
its record's batch but those bodies. The writes:

- to a folder, appended to ``MODEL/VERSION/YYYY/MM/DD/HH/<instance>.jsonl`` (a file per model,
  version and hour of the record's time, UTC; a model without versions is version 1);
- to S3, one object per model, version and hour for each write:
  ``prefix/MODEL/VERSION/YYYY/MM/DD/HH/<MM-SS-mmm>-<instance>-<n>.jsonl``.

Each line is one of SageMaker's records: ``captureData.endpointInput`` and
``captureData.endpointOutput`` (``observedContentType``, ``mode``, ``data``, ``encoding``:
``JSON`` or ``CSV`` as text, anything else ``BASE64``), ``eventMetadata`` (``eventId``, a
UUID; ``inferenceId``, the request's id; ``inferenceTime``) and ``eventVersion`` ``"0"``. A
shadow run whose answer differs (:mod:`mmserver.lifecycle.shadow`) is captured with both answers:
the shadow's under ``captureData.shadowOutput``, with its ``version``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from itertools import groupby
from pathlib import Path
from typing import Any, NamedTuple

from mmserver.codecs.requests import media_type
from mmserver.ops.metrics import Metrics
from mmserver.store.names import split_version
from mmserver.store.urls import split_object_url

log = logging.getLogger(__name__)

#: Seconds between the first record the writer takes and the write of what it took.
FLUSH_S = 1.0
#: Records whose lines the event loop makes at once (see the module docstring).
ENCODE_BATCH = 64
_JSON_TYPES = ("application/json", "application/jsonlines", "application/x-ndjson")


class Record(NamedTuple):
    """A captured request's raw parts, as the request path hands them over (no encoding on
    the event loop)."""

    model: str
    at: float
    inference_id: str
    request: bytes
    request_type: str
    answer: bytes
    answer_type: str
    #: A shadow run's answer that differed, and its version's key (``None``: no shadow).
    shadow: bytes | None = None
    shadow_key: str | None = None


def encode_line(record: Record) -> str:
    """The JSON line of ``record`` (with its newline), in SageMaker's data capture format: the
    parts of each body's object that follow from its content type made once per type
    (:func:`_heads`), its text escaped by the C encoder ``json.dumps`` uses, the whole joined
    once (a dictionary given to ``json.dumps`` costs several times more; this is every captured
    request's cost on the event loop). A record without a shadow whose bodies go as text fills
    its pair of content types' form (:func:`_form`) in one step."""
    if record.shadow is None:
        types = (record.request_type, record.answer_type)
        form = _FORMS.get(types)
        if form is None:
            form = _form(*types)
        if form:
            try:
                return form % (
                    _string(record.request.decode()),
                    _string(record.answer.decode()),
                    _event_id(),
                    _string(record.inference_id),
                    _moment(record.at),
                )
            except UnicodeDecodeError:
                pass  # not UTF-8: sent as base64
    shadow = ""
    if record.shadow is not None and record.shadow_key is not None:
        version = _string(str(split_version(record.shadow_key)[1]))
        head, text, tail = _data("OUTPUT", record.shadow, record.answer_type)
        shadow = ',"shadowOutput":' + head + text + tail[:-1] + ',"version":' + version + "}"
    return "".join(
        (
            '{"captureData":{"endpointInput":',
            *_data("INPUT", record.request, record.request_type),
            ',"endpointOutput":',
            *_data("OUTPUT", record.answer, record.answer_type),
            shadow,
            '},"eventMetadata":{"eventId":"',
            _event_id(),
            '","inferenceId":',
            _string(record.inference_id),
            ',"inferenceTime":"',
            _moment(record.at),
            '"},"eventVersion":"0"}\n',
        )
    )


def _form(request_type: str, answer_type: str) -> str:
    """The line of a record without a shadow whose bodies of these content types go as text,
    with ``%s`` for the request's text, the answer's, the event id, the inference id and the
    time; ``""`` when either type goes as base64. Made once per pair of types seen (a few)."""
    in_head, in_tail = _heads(request_type, "INPUT")
    out_head, out_tail = _heads(answer_type, "OUTPUT")
    form = ""
    if in_tail is not None and out_tail is not None:
        form = "".join(
            (
                '{"captureData":{"endpointInput":',
                in_head.replace("%", "%%"),
                "%s",
                in_tail,
                ',"endpointOutput":',
                out_head.replace("%", "%%"),
                "%s",
                out_tail,
                '},"eventMetadata":{"eventId":"%s","inferenceId":%s,"inferenceTime":"%s"},',
                '"eventVersion":"0"}\n',
            )
        )
    if len(_FORMS) < 256:
        _FORMS[request_type, answer_type] = form
    return form


def _data(mode: str, body: bytes, content_type: str) -> tuple[str, str, str]:
    """The JSON object of one body, in three parts to be joined with the line's: text for JSON
    and CSV, base64 for anything else (or for text that is not UTF-8)."""
    head, tail = _heads(content_type, mode)
    if tail is not None:
        try:
            return head, _string(body.decode()), tail
        except UnicodeDecodeError:
            pass
    return head, _string(base64.b64encode(body).decode("ascii")), ',"encoding":"BASE64"}'


def _heads(content_type: str, mode: str) -> tuple[str, str | None]:
    """What comes before and after the text of a body of ``content_type`` in its object; the
    tail is ``None`` for a type sent as base64 (``JSON`` and ``CSV`` go as text). Made once per
    type seen (a few)."""
    key = (content_type, mode)
    found = _HEADS.get(key)
    if found is None:
        kind = media_type(content_type)
        encoding = "JSON" if kind in _JSON_TYPES else "CSV" if kind == "text/csv" else None
        head = '{"observedContentType":' + _string(content_type) + ',"mode":"' + mode + '","data":'
        found = (head, None if encoding is None else ',"encoding":"' + encoding + '"}')
        if len(_HEADS) < 256:
            _HEADS[key] = found
    return found


#: The parts of a body's object around its text, by content type and mode (see :func:`_heads`).
_HEADS: dict[tuple[str, str], tuple[str, str | None]] = {}
#: The forms of lines by their content types (see :func:`_form`).
_FORMS: dict[tuple[str, str], str] = {}
#: A JSON string of a Python one, by the C encoder ``json.dumps`` uses.
_string: Callable[[str], str] = json.encoder.encode_basestring_ascii


class _EventIds:
    """Version 4 UUIDs' text: 96 random bits of the process's own (with the version and variant
    set) and a count of its records in the last 32, so each id is new without 128 random bits
    a record (an event id names a record; it guards nothing). Drawn again in a forked child
    and when the count wraps."""

    __slots__ = ("count", "prefix")

    def __init__(self) -> None:
        self.prefix = ""
        self.count = _COUNT_LIMIT

    def draw(self) -> None:
        h = f"{(random.SystemRandom().getrandbits(128) & _UUID_CLEAR) | _UUID_SET:032x}"
        self.prefix = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:24]}%08x"
        self.count = 0

    def next(self) -> str:
        self.count += 1
        if self.count >= _COUNT_LIMIT:
            self.draw()
            self.count = 1
        return self.prefix % self.count


_COUNT_LIMIT = 1 << 32
_EVENT_IDS = _EventIds()
_event_id = _EVENT_IDS.next
os.register_at_fork(after_in_child=_EVENT_IDS.draw)
#: The version (4) and variant (RFC 4122) bits of a random UUID.
_UUID_CLEAR = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID_SET = (0x4 << 76) | (0x2 << 62)


def _moment(at: float) -> str:
    """``at`` as SageMaker writes an inference time: ``2026-11-26T09:30:00.123Z``."""
    second = int(at)
    if _SECOND.second != second:
        _SECOND.second = second
        _SECOND.text = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(second))
    return _SECOND.text + _MILLIS[int(at * 1000) % 1000]


class _Second:
    """The last second an inference time was written for, and its text."""

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second = -1
        self.text = ""


_SECOND = _Second()


#: ``000Z`` to ``999Z``: the end of an inference time.
_MILLIS = [f"{ms:03d}Z" for ms in range(1000)]


def hour_folder(model: str, at: float) -> str:
    """``MODEL/VERSION/YYYY/MM/DD/HH`` of a record of ``model`` (a model or version key) at
    ``at`` (UTC)."""
    name, version = split_version(model)
    moment = time.gmtime(at)
    return f"{name}/{version or 1}/" + time.strftime("%Y/%m/%d/%H", moment)


class _Lines:
    """The lines made for one hour folder and not written yet: a bytes object per batch of
    lines (a few objects a second, not one per request), and how many lines."""

    __slots__ = ("chunks", "count")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.count = 0


class Capture:
    """The capture of the server (see the module docstring). :meth:`offer` and :meth:`sampled`
    run on the event loop; the writing in a thread of its own."""

    def __init__(self, location: str, buffer: int, metrics: Metrics) -> None:
        self.location = location.strip()
        self.metrics = metrics
        #: The records offered and not written yet, at most ``buffer``: first those whose
        #: lines are not made (in the order offered), then the lines made, by hour folder.
        #: Guarded by ``_lock``, held by the writer only to make the last lines and take them.
        self._records: list[Record] = []
        self._lines: dict[str, _Lines] = {}
        self._count = 0
        self._buffer = buffer
        self._lock = threading.Lock()
        #: Set when a record comes into an empty buffer (once until the writer takes it), and
        #: when the writer is to stop: the writer wakes once per write, not once per record.
        self._ready = threading.Event()
        self._signalled = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._random = random.Random()
        self._instance = f"{socket.gethostname()}-{os.getpid()}"
        self._sequence = 0
        self._client: Any = None
        if self.location[:5].lower() == "s3://":
            self._bucket, self._prefix = split_object_url(self.location)
            self._folder: Path | None = None
        else:
            self._folder = Path(self.location.removeprefix("file://")).expanduser()
        #: The hour folders of the records offered lately, by model and hour.
        self._folders: dict[tuple[str, int], str] = {}
        #: Records written so far (read by tests and the bench).
        self.written = 0

    def sampled(self, percent: float) -> bool:
        """Whether a request of a model capturing ``percent`` % is captured."""
        return percent >= 100 or self._random.random() * 100 < percent

    def start(self) -> None:
        """Start the writer (records offered before wait in the buffer)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mmserver-capture", daemon=True)
            self._thread.start()

    def offer(self, record: Record) -> None:
        """Hand ``record`` to the writer; dropped and counted when the buffer is full. Makes
        the lines of the records waiting when they are a batch."""
        if self._count >= self._buffer:
            self.metrics.capture_dropped.inc()
            return
        with self._lock:
            records = self._records
            records.append(record)
            self._count += 1
            if len(records) >= ENCODE_BATCH:
                self._encode()
        if not self._signalled:
            self._signalled = True
            self._ready.set()

    def _encode(self) -> None:
        """Make the lines of the records waiting, appended to their hour folders' in the order
        offered (``_lock`` held)."""
        records, self._records = self._records, []
        lines = [encode_line(record) for record in records]
        keys = [(record.model, int(record.at // 3600)) for record in records]
        folders = self._folders
        at = 0
        for key, run in groupby(keys):
            count = sum(1 for _ in run)
            folder = folders.get(key)
            if folder is None:
                if len(folders) >= 4096:
                    folders.clear()
                folder = folders[key] = hour_folder(key[0], records[at].at)
            waiting = self._lines.get(folder)
            if waiting is None:
                waiting = self._lines[folder] = _Lines()
            waiting.chunks.append("".join(lines[at : at + count]).encode())
            waiting.count += count
            at += count

    def close(self) -> None:
        """Write what the buffer holds, then stop the writer (blocks: call it in a thread)."""
        thread = self._thread
        if thread is None:
            return
        self._stopping.set()
        self._ready.set()
        thread.join()
        self._thread = None

    # The writer's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._ready.wait()
            # What comes within FLUSH_S of the first record is written with it.
            self._stopping.wait(FLUSH_S)
            with self._lock:
                self._encode()
                taken, self._lines = self._lines, {}
                self._count = 0
                self._ready.clear()
                self._signalled = False
            self._write(taken)
            if self._stopping.is_set():
                return

    def _write(self, taken: dict[str, _Lines]) -> None:
        for folder, lines in taken.items():
            try:
                if self._folder is not None:
                    path = self._folder / folder / f"{self._instance}.jsonl"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path, "ab") as out:
                        out.writelines(lines.chunks)
                else:
                    self._put(folder, b"".join(lines.chunks))
                self.written += lines.count
            except Exception as exc:  # the store or disk failed: those records are lost
                self.metrics.capture_dropped.inc(lines.count)
                log.warning(
                    "data capture: %d record(s) not written to %s: %s", lines.count, folder, exc
                )

    def _put(self, folder: str, body: bytes) -> None:
        if self._client is None:
            from mmserver.store.client import make_client  # boto3 only where a capture goes to S3

            self._client = make_client()
        self._sequence += 1
        stamp = time.strftime("%M-%S", time.gmtime()) + f"-{int(time.time() * 1000) % 1000:03d}"
        key = f"{self._prefix}{folder}/{stamp}-{self._instance}-{self._sequence}.jsonl"
        self._client.put_object(
            Bucket=self._bucket, Key=key.lstrip("/"), Body=body, ContentType="application/jsonl"
        )
