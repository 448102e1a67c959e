"""A job's progress, kept beside its output so that a rerun continues where a run stopped.

Layout of the journal folder::

    job.json        the job's fingerprint (:meth:`TransformOptions.fingerprint`) and arguments,
                    and the ``traceparent`` of its first run when it was traced (every run of
                    the job continues that trace)
    done            one line per input file whose output is written (its name, as JSON)
    parts/<hash>    the answered payloads of a file not done yet: a header line (the file's
                    size, records and payloads), then entries ``<index> <length>\\n<output>``;
                    none for a file whose only payload goes straight to its output

Each entry is one ``write`` to a file opened for appending, so a run killed at any moment
leaves whole entries and at most one torn one at the end, which the next run cuts off. An
input's output is written whole first, then its name is added to ``done``, then its parts are
removed: a run killed between two of those steps redoes nothing but the last. A rerun asks
the server only for the payloads with no entry, and assembles the output from the entries in
payload order: the same output as an uninterrupted run, with no line twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from mmserver.commands.transform.failures import TransformError
from mmserver.store.objects import write_whole

#: The job's fingerprint and arguments, in the journal folder.
JOB_FILE = "job.json"


class Journal:
    """The progress of one job in ``folder``; methods block (the job calls them in threads)
    and may be called from several threads at once."""

    def __init__(self, folder: Path, fingerprint: str, description: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self._lock = threading.Lock()
        try:
            (self.folder / "parts").mkdir(parents=True, exist_ok=True)
            job = self.folder / JOB_FILE
            #: Whether an earlier run of the job left this journal (this run continues it).
            self.resumed = job.exists()
            recorded: dict[str, Any] = {"fingerprint": fingerprint, "job": description}
            if self.resumed:
                recorded = json.loads(job.read_text())
                if recorded.get("fingerprint") != fingerprint:
                    raise TransformError(
                        f"{self.folder} holds the progress of another job "
                        f"({_summary(recorded.get('job', {}))}): run that job's command again "
                        "to finish it, or give another --output (or --journal), or remove "
                        "that folder to start over"
                    )
            else:
                write_whole(job, json.dumps(recorded).encode())
            self._recorded = recorded
            #: The ``traceparent`` of the job's first run, when that run was traced.
            self.traceparent: str | None = recorded.get("traceparent")
            self._done = self._read_done()
            self._headers: dict[str, bytes] = {}
        except OSError as exc:
            raise TransformError(f"the journal {self.folder} cannot be used: {exc}") from None
        except ValueError:
            raise TransformError(
                f"the journal {self.folder} is damaged: remove it to start the job over"
            ) from None

    def keep_trace(self, traceparent: str) -> None:
        """Record the ``traceparent`` of the job's run (its first): the runs that continue the
        job continue its trace."""
        self._recorded["traceparent"] = self.traceparent = traceparent
        try:
            write_whole(self.folder / JOB_FILE, json.dumps(self._recorded).encode())
        except OSError as exc:
            raise TransformError(f"the journal {self.folder} cannot be used: {exc}") from None

    def _read_done(self) -> set[str]:
        path = self.folder / "done"
        if not path.exists():
            return set()
        done = set()
        for line in path.read_bytes().split(b"\n"):
            try:
                done.add(json.loads(line))
            except ValueError:
                continue  # a torn last line: that file is redone
        return done

    def done(self) -> set[str]:
        """The input files whose output is written."""
        with self._lock:
            return set(self._done)

    def _parts_path(self, name: str) -> Path:
        return self.folder / "parts" / hashlib.sha256(name.encode()).hexdigest()[:32]

    def parts(self, name: str, header: dict[str, Any]) -> dict[int, bytes]:
        """The answered payloads of the input ``name``, by index, when they were recorded for
        the same split (``header``: its records and payloads); else none (the file is redone).
        A torn entry at the end is cut off."""
        path = self._parts_path(name)
        expected = json.dumps(header, sort_keys=True).encode()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        with self._lock:
            self._headers[name] = expected
        head = data.partition(b"\n")[0]
        if head != expected:
            path.unlink(missing_ok=True)
            return {}
        parts: dict[int, bytes] = {}
        at = len(head) + 1
        while at < len(data):
            line_end = data.find(b"\n", at)
            fields = data[at:line_end].split() if line_end >= 0 else []
            if len(fields) != 2 or line_end + 1 + int(fields[1]) > len(data):
                with open(path, "r+b") as torn:
                    torn.truncate(at)
                break
            index, length = int(fields[0]), int(fields[1])
            parts[index] = data[line_end + 1 : line_end + 1 + length]
            at = line_end + 1 + length
        return parts

    def add_part(self, name: str, index: int, output: bytes) -> None:
        """Record the output of the input ``name``'s payload ``index``."""
        entry = b"%d %d\n" % (index, len(output)) + output
        with self._lock:
            path = self._parts_path(name)
            if not path.exists():  # the first entry comes with the header (from parts())
                entry = self._headers[name] + b"\n" + entry
            _append(path, entry)

    def finish(self, name: str) -> None:
        """Record that the output of the input ``name`` is written."""
        with self._lock:
            _append(self.folder / "done", json.dumps(name).encode() + b"\n")
            self._done.add(name)
            self._headers.pop(name, None)
            self._parts_path(name).unlink(missing_ok=True)


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _summary(job: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in job.items() if k in ("model", "input", "output"))
