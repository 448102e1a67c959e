"""The journal of asynchronous requests: one SQLite database in WAL mode in ``state_dir``.

A request is written here (and synced to disk, ``synchronous=FULL``) before its 202 is sent, so
whatever happens to the process afterwards, the next start finds it. Each request has one row
with a stored, checked state::

    QUEUED ──► RUNNING ──► DONE
      │  ▲        │  └───► FAILED
      │  └────────┘ (requeued: the server stopped, or lacked room, while it ran)
      └──► EXPIRED (not started within its TTL), FAILED

Ending a request is idempotent: :meth:`Journal.finish` changes a row only from ``RUNNING``, so a
request ends once however many times its end is reported. The three end states are final; an
ended request's row is kept for a while for the state call, then pruned (:meth:`Journal.prune`).

Every method blocks on the disk: the owner (:class:`~mmserver.asynchronous.runner.AsyncInference`)
calls them from one thread of its own, the connection's only user, several at a time in one
transaction (:meth:`Journal.together`): one sync to disk for all the requests accepted, started
or ended meanwhile. Alone, each write is a transaction of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The journal's file in ``state_dir``.
JOURNAL_FILE = "async-journal.sqlite3"


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


#: The states a request may move to from each state.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.RUNNING, State.EXPIRED, State.FAILED}),
    State.RUNNING: frozenset({State.DONE, State.FAILED, State.EXPIRED, State.QUEUED}),
    State.DONE: frozenset(),
    State.FAILED: frozenset(),
    State.EXPIRED: frozenset(),
}
ENDED = frozenset({State.DONE, State.FAILED, State.EXPIRED})


@dataclass(frozen=True, slots=True)
class Invocation:
    """One asynchronous request as the journal holds it. Times are wall-clock seconds."""

    id: str
    model: str
    #: Where its body is: ``s3://...`` or ``file://...`` (an inline body was saved as a file).
    input: str
    output: str
    failure: str
    content_type: str | None
    accept: str | None
    custom_attributes: str | None
    accepted_at: float
    ttl_s: float
    timeout_s: float
    state: State = State.QUEUED
    error: str | None = None
    ended_at: float | None = None
    #: Its place in the order of acceptance (given by the journal).
    seq: int = 0
    #: The ``traceparent`` of the call that asked for it (its span's, when it was traced):
    #: its run continues that trace.
    traceparent: str | None = None

    @property
    def expires_at(self) -> float:
        """When it expires if it has not started."""
        return self.accepted_at + self.ttl_s


_COLUMNS = (
    "id, model, input, output, failure, content_type, accept, custom_attributes, accepted_at, "
    "ttl_s, timeout_s, state, error, ended_at, seq, traceparent"
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS invocations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    input TEXT NOT NULL,
    output TEXT NOT NULL,
    failure TEXT NOT NULL,
    content_type TEXT,
    accept TEXT,
    custom_attributes TEXT,
    accepted_at REAL NOT NULL,
    ttl_s REAL NOT NULL,
    timeout_s REAL NOT NULL,
    state TEXT NOT NULL,
    error TEXT,
    ended_at REAL,
    traceparent TEXT
);
CREATE INDEX IF NOT EXISTS invocations_open ON invocations (state, seq);
"""
#: The columns added since the first journals, each with its definition: a journal written by
#: an earlier version gets them when it is opened.
_ADDED = {"traceparent": "TEXT"}


def _row(row: tuple[object, ...]) -> Invocation:
    (id_, model, input_, output, failure, ctype, accept, attrs, at, ttl, timeout) = row[:11]
    state, error, ended, seq, traceparent = row[11:]
    return Invocation(
        str(id_),
        str(model),
        str(input_),
        str(output),
        str(failure),
        None if ctype is None else str(ctype),
        None if accept is None else str(accept),
        None if attrs is None else str(attrs),
        float(at),  # type: ignore[arg-type]
        float(ttl),  # type: ignore[arg-type]
        float(timeout),  # type: ignore[arg-type]
        State(state),
        None if error is None else str(error),
        None if ended is None else float(ended),  # type: ignore[arg-type]
        int(seq),  # type: ignore[call-overload]
        None if traceparent is None else str(traceparent),
    )


class Journal:
    """The asynchronous requests of one ``state_dir``. Not thread-safe: one thread uses it."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / JOURNAL_FILE
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # Every commit reaches the disk before it returns: a 202 is never sent for a request a
        # power cut could lose.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        columns = {str(row[1]) for row in self._db.execute("PRAGMA table_info(invocations)")}
        for column, kind in _ADDED.items():
            if column not in columns:
                self._db.execute(f"ALTER TABLE invocations ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self._db.close()

    def together(self, calls: Sequence[Callable[[], object]]) -> list[object | BaseException]:
        """Run ``calls`` (each a use of this journal) in one transaction, synced to disk once
        for all of them; each one's result, or the exception it raised."""
        results: list[object | BaseException] = []
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for call in calls:
                try:
                    results.append(call())
                except Exception as exc:
                    results.append(exc)
        finally:
            self._db.execute("COMMIT")
        return results

    def add(self, invocation: Invocation) -> tuple[Invocation, bool]:
        """Write ``invocation`` (queued); ``(the row, True)``. When its id is taken already:
        ``(the row that has it, False)``, unchanged."""
        cursor = self._db.execute(
            "INSERT OR IGNORE INTO invocations (id, model, input, output, failure, "
            "content_type, accept, custom_attributes, accepted_at, ttl_s, timeout_s, state, "
            "traceparent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                invocation.id,
                invocation.model,
                invocation.input,
                invocation.output,
                invocation.failure,
                invocation.content_type,
                invocation.accept,
                invocation.custom_attributes,
                invocation.accepted_at,
                invocation.ttl_s,
                invocation.timeout_s,
                State.QUEUED.value,
                invocation.traceparent,
            ),
        )
        if cursor.rowcount == 1:
            seq = cursor.lastrowid
            assert seq is not None
            added = dataclasses.replace(
                invocation, state=State.QUEUED, error=None, ended_at=None, seq=seq
            )
            return added, True
        found = self.get(invocation.id)
        assert found is not None
        return found, False

    def get(self, invocation_id: str) -> Invocation | None:
        found = self._db.execute(
            f"SELECT {_COLUMNS} FROM invocations WHERE id = ?", (invocation_id,)
        ).fetchone()
        return None if found is None else _row(found)

    def move(
        self,
        invocation_id: str,
        to: State,
        *,
        error: str | None = None,
        at: float | None = None,
    ) -> bool:
        """Move a request to state ``to`` from any state :data:`TRANSITIONS` allows; whether
        it moved (``False``: it is not in such a state, e.g. it has ended already)."""
        sources = [s.value for s, targets in TRANSITIONS.items() if to in targets]
        marks = ", ".join("?" for _ in sources)
        cursor = self._db.execute(
            f"UPDATE invocations SET state = ?, error = ?, ended_at = ? "
            f"WHERE id = ? AND state IN ({marks})",
            (to.value, error, at if to in ENDED else None, invocation_id, *sources),
        )
        return cursor.rowcount == 1

    def finish(self, invocation_id: str, to: State, error: str | None, at: float) -> bool:
        """End a running request (``to`` one of :data:`ENDED`): ``True`` the first time,
        ``False`` afterwards (the end is recorded once)."""
        assert to in ENDED
        cursor = self._db.execute(
            "UPDATE invocations SET state = ?, error = ?, ended_at = ? WHERE id = ? AND state = ?",
            (to.value, error, at, invocation_id, State.RUNNING.value),
        )
        return cursor.rowcount == 1

    def open(self) -> list[Invocation]:
        """The requests not ended, queued or running, in the order they were accepted."""
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM invocations WHERE state IN (?, ?) ORDER BY seq",
            (State.QUEUED.value, State.RUNNING.value),
        ).fetchall()
        return [_row(r) for r in rows]

    def requeue_running(self) -> int:
        """Put every running request back in the queue (the server stops before they ended);
        how many."""
        cursor = self._db.execute(
            "UPDATE invocations SET state = ? WHERE state = ?",
            (State.QUEUED.value, State.RUNNING.value),
        )
        return cursor.rowcount

    def prune(self, ended_before: float) -> int:
        """Forget the requests that ended before ``ended_before``; how many."""
        cursor = self._db.execute(
            "DELETE FROM invocations WHERE state IN (?, ?, ?) AND ended_at < ?",
            (*(s.value for s in (State.DONE, State.FAILED, State.EXPIRED)), ended_before),
        )
        return cursor.rowcount

    def states(self) -> dict[str, State]:
        """Every request's state, by inference id."""
        rows = self._db.execute("SELECT id, state FROM invocations ORDER BY seq")
        return {str(i): State(s) for i, s in rows}

    def counts(self) -> dict[State, int]:
        """Requests per state."""
        rows = self._db.execute("SELECT state, COUNT(*) FROM invocations GROUP BY state")
        counts = dict.fromkeys(State, 0)
        for state, count in rows:
            counts[State(state)] = int(count)
        return counts
