"""The journal's thread: what is asked for while it is busy runs as one batch (every step's
file work, then every row change in one transaction, then what follows a commit), and a step
whose file work fails changes nothing while the others of its batch go on."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from mmserver import errors
from mmserver.asynchronous.journal import Invocation, Journal, State
from mmserver.asynchronous.locations import Locations
from mmserver.asynchronous.writer import Folders, JournalThread

STEPS = 10


def invocation(name: str, folder: Path) -> Invocation:
    return Invocation(
        id=name,
        model="m",
        input=f"s3://b/in/{name}",
        output=(folder / f"{name}.out").as_uri(),
        failure=(folder / f"{name}-error.out").as_uri(),
        content_type="application/json",
        accept=None,
        custom_attributes=None,
        accepted_at=100.0,
        ttl_s=60.0,
        timeout_s=900.0,
    )


async def test_steps_asked_while_the_thread_is_busy_run_as_one_batch(tmp_path: Path) -> None:
    writer = JournalThread()
    await writer.open(lambda: Journal(tmp_path / "state"))
    journal = writer.current()
    locations = Locations([])
    answers = tmp_path / "answers"
    events: list[str] = []
    batches: list[int] = []  # the folders set each step's file work was given
    entered, hold = threading.Event(), threading.Event()

    def held(folders: Folders) -> None:
        entered.set()
        hold.wait(30)

    async def step(n: int) -> tuple[Invocation, bool]:
        row = invocation(f"r{n}", answers)

        def files(folders: Folders) -> None:
            events.append(f"files {n}")
            batches.append(id(folders))
            locations.write_local(row.output, b'{"predictions": [%d]}' % n, folders)

        def record(_: None) -> tuple[Invocation, bool]:
            events.append(f"record {n}")
            return journal.add(row)

        return await writer.run(files, record, lambda _: events.append(f"after {n}"))

    try:
        first = asyncio.ensure_future(writer.run(held, lambda _: events.append("record held")))
        await asyncio.to_thread(entered.wait, 30)
        together = asyncio.gather(*(step(n) for n in range(STEPS)))
        await asyncio.sleep(0)  # every step asked for (the thread is held meanwhile)
        hold.set()
        await first
        results = await together
    finally:
        await writer.close()
    assert [added for _, added in results] == [True] * STEPS
    # The first step ran alone; the others as one batch: every file work first (given the
    # same folders to sync), then every row change, then what follows the commit.
    assert events == [
        "record held",
        *(f"files {n}" for n in range(STEPS)),
        *(f"record {n}" for n in range(STEPS)),
        *(f"after {n}" for n in range(STEPS)),
    ]
    assert len(set(batches)) == 1
    assert sorted(p.name for p in answers.iterdir()) == sorted(f"r{n}.out" for n in range(STEPS))
    assert (answers / "r3.out").read_bytes() == b'{"predictions": [3]}'
    reopened = Journal(tmp_path / "state")
    try:
        assert reopened.states() == {f"r{n}": State.QUEUED for n in range(STEPS)}
    finally:
        reopened.close()


async def test_a_step_whose_file_work_fails_changes_nothing_and_spares_its_batch(
    tmp_path: Path,
) -> None:
    writer = JournalThread()
    await writer.open(lambda: Journal(tmp_path / "state"))
    journal = writer.current()
    locations = Locations([])
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder should be")
    events: list[str] = []

    def step(name: str, folder: Path) -> asyncio.Future[tuple[Invocation, bool]]:
        row = invocation(name, folder)
        return asyncio.ensure_future(
            writer.run(
                lambda folders: locations.write_local(row.output, b"answer", folders),
                lambda _: journal.add(row),
                lambda _: events.append(f"after {name}"),
            )
        )

    try:
        failing, fine = step("failing", blocked), step("fine", tmp_path / "answers")
        with pytest.raises(errors.MMServerError, match=r"failing\.out cannot be written"):
            await failing
        row, added = await fine
        assert added and row.id == "fine"
        assert await writer.call(journal.get, "failing") is None
    finally:
        await writer.close()
    assert events == ["after fine"]
    assert (tmp_path / "answers" / "fine.out").read_bytes() == b"answer"
