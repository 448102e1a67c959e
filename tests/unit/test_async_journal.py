"""The journal of asynchronous requests: checked transitions, one end per request, and what a
new connection (a restarted server) finds."""

from __future__ import annotations

from pathlib import Path

from mmserver.asynchronous.journal import Invocation, Journal, State


def invocation(name: str, accepted_at: float = 100.0) -> Invocation:
    return Invocation(
        id=name,
        model="m",
        input=f"s3://b/in/{name}",
        output=f"s3://b/out/{name}.out",
        failure=f"s3://b/out/{name}-error.out",
        content_type="text/csv",
        accept=None,
        custom_attributes="trace=1",
        accepted_at=accepted_at,
        ttl_s=60.0,
        timeout_s=900.0,
    )


def test_a_request_is_added_once_and_read_back_whole(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    row, added = journal.add(invocation("a"))
    assert added
    assert (row.state, row.seq, row.custom_attributes, row.expires_at) == (
        State.QUEUED,
        1,
        "trace=1",
        160.0,
    )
    again, added = journal.add(invocation("a", accepted_at=200.0))
    assert not added
    assert again == row  # unchanged
    assert journal.get("missing") is None


def test_a_request_ends_once_and_an_end_is_final(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.add(invocation("a"))
    assert not journal.finish("a", State.DONE, None, 1.0)  # not running: nothing ends
    assert journal.move("a", State.RUNNING)
    assert journal.finish("a", State.DONE, None, 5.0)
    assert not journal.finish("a", State.FAILED, "late", 6.0)
    assert not journal.move("a", State.QUEUED)
    assert not journal.move("a", State.EXPIRED)
    row = journal.get("a")
    assert row is not None
    assert (row.state, row.error, row.ended_at) == (State.DONE, None, 5.0)


def test_a_queued_request_may_expire_but_not_end_done(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.add(invocation("a"))
    assert not journal.move("a", State.DONE)
    assert journal.move("a", State.EXPIRED, error="too late", at=9.0)
    row = journal.get("a")
    assert row is not None
    assert (row.state, row.error, row.ended_at) == (State.EXPIRED, "too late", 9.0)


def test_a_new_connection_finds_the_open_requests_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for name in ("a", "b", "c", "d"):
        journal.add(invocation(name))
    journal.move("b", State.RUNNING)
    journal.move("c", State.RUNNING)
    journal.finish("c", State.FAILED, "model error", 3.0)
    journal.move("d", State.RUNNING)
    journal.close()  # as a killed server leaves it: b and d running

    reopened = Journal(tmp_path)
    assert [(i.id, i.state) for i in reopened.open()] == [
        ("a", State.QUEUED),
        ("b", State.RUNNING),
        ("d", State.RUNNING),
    ]
    assert reopened.requeue_running() == 2
    assert [(i.id, i.state) for i in reopened.open()] == [
        ("a", State.QUEUED),
        ("b", State.QUEUED),
        ("d", State.QUEUED),
    ]
    counts = reopened.counts()
    assert (counts[State.QUEUED], counts[State.FAILED], counts[State.DONE]) == (3, 1, 0)
    assert reopened.path.with_name(reopened.path.name + "-wal").exists()  # WAL mode


def test_uses_together_are_one_transaction_and_each_gets_its_result(tmp_path: Path) -> None:
    journal = Journal(tmp_path)

    def refused() -> None:
        raise ValueError("not this one")

    results = journal.together(
        [
            lambda: journal.add(invocation("a"))[1],
            refused,
            lambda: journal.move("a", State.RUNNING),
            lambda: journal.move("missing", State.RUNNING),
        ]
    )
    assert results[0] is True
    assert isinstance(results[1], ValueError) and str(results[1]) == "not this one"
    assert results[2:] == [True, False]
    journal.close()
    assert Journal(tmp_path).states() == {"a": State.RUNNING}  # committed


def test_ended_requests_are_pruned_once_old_enough(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for name in ("old", "recent", "open"):
        journal.add(invocation(name))
    for name, at in (("old", 10.0), ("recent", 50.0)):
        journal.move(name, State.RUNNING)
        journal.finish(name, State.DONE, None, at)
    assert journal.prune(ended_before=20.0) == 1
    assert journal.states() == {"recent": State.DONE, "open": State.QUEUED}


def test_a_requests_traceparent_is_kept_and_an_older_journal_gets_its_column(
    tmp_path: Path,
) -> None:
    import dataclasses
    import sqlite3

    # A journal written before traces: its table has no traceparent column.
    old = sqlite3.connect(tmp_path / "async-journal.sqlite3")
    old.executescript(
        "CREATE TABLE invocations (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL "
        "UNIQUE, model TEXT NOT NULL, input TEXT NOT NULL, output TEXT NOT NULL, failure TEXT "
        "NOT NULL, content_type TEXT, accept TEXT, custom_attributes TEXT, accepted_at REAL NOT "
        "NULL, ttl_s REAL NOT NULL, timeout_s REAL NOT NULL, state TEXT NOT NULL, error TEXT, "
        "ended_at REAL);"
        "INSERT INTO invocations (id, model, input, output, failure, accepted_at, ttl_s, "
        "timeout_s, state) VALUES ('old', 'm', 'i', 'o', 'f', 1.0, 60.0, 900.0, 'queued');"
    )
    old.close()
    journal = Journal(tmp_path)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    row, _ = journal.add(dataclasses.replace(invocation("new"), traceparent=traceparent))
    assert row.traceparent == traceparent
    assert [(r.id, r.traceparent) for r in Journal(tmp_path).open()] == [
        ("old", None),
        ("new", traceparent),
    ]
