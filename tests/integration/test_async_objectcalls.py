"""The object store's calls of asynchronous requests, made in processes of their own at a lower
CPU priority (:mod:`mmserver.asynchronous.objectcalls`): their answers and errors as the
frontend's own calls give them, and a process killed meanwhile replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from mmserver.asynchronous.objectcalls import NICE, PROCESSES, ObjectCalls
from mmserver.errors import InputMissing


@pytest.fixture
async def calls(tmp_path: Path) -> AsyncIterator[ObjectCalls]:
    made = ObjectCalls((tmp_path,))
    try:
        yield made
    finally:
        await made.close()


def _callers() -> list[psutil.Process]:
    """This process's children that run at the calls' niceness."""
    mine = psutil.Process().nice()
    return [p for p in psutil.Process().children() if p.nice() == mine + NICE]


async def test_inputs_are_read_whole_or_sized_and_answers_written_whole(
    calls: ObjectCalls, tmp_path: Path
) -> None:
    source = tmp_path / "input.csv"
    source.write_bytes(b"1,2\n3,4\n")
    assert await calls.read_input(source.as_uri(), 0) == b"1,2\n3,4\n"
    assert await calls.read_input(source.as_uri(), 8) == b"1,2\n3,4\n"
    assert await calls.read_input(source.as_uri(), 7) == 8  # larger: its size
    answer = tmp_path / "out" / "id.out"
    await calls.write(answer.as_uri(), b"[1.0, 2.0]", "application/json")
    assert answer.read_bytes() == b"[1.0, 2.0]"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["id.out"]  # no staging left
    # Made by processes of their own, at the lower priority.
    assert 1 <= len(_callers()) <= PROCESSES


async def test_calls_are_asked_and_answered_on_the_event_loop_without_a_thread(
    calls: ObjectCalls, tmp_path: Path
) -> None:
    before = {thread.ident for thread in threading.enumerate()}
    source = tmp_path / "input.json"
    source.write_bytes(b"[[0.5]]")
    answers = await asyncio.gather(*(calls.read_input(source.as_uri(), 0) for _ in range(20)))
    await asyncio.gather(
        *(calls.write((tmp_path / f"{i}.out").as_uri(), b"[1]", "text/csv") for i in range(20))
    )
    assert answers == [b"[[0.5]]"] * 20
    written = sorted(os.listdir(tmp_path))
    assert written == sorted(["input.json", *(f"{i}.out" for i in range(20))])
    assert sorted(calls.pids()) == sorted(p.pid for p in _callers())
    # The only threads the calls started are the event loop's default executor's, which
    # started the processes: none hands calls over.
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert [name for name in started if not name.startswith(("asyncio_", "uvloop_"))] == []


async def test_an_error_is_raised_as_the_frontend_would_raise_it(
    calls: ObjectCalls, tmp_path: Path
) -> None:
    missing = (tmp_path / "nowhere.json").as_uri()
    with pytest.raises(InputMissing) as caught:
        await calls.read_input(missing, 0)
    assert caught.value.message == f"the input {missing} does not exist"


async def test_a_killed_process_is_replaced_and_the_call_made_again(
    calls: ObjectCalls, tmp_path: Path
) -> None:
    source = tmp_path / "input.json"
    source.write_bytes(b"[[0.5]]")
    assert await calls.read_input(source.as_uri(), 0) == b"[[0.5]]"
    killed = _callers()
    assert killed  # the call was made in one of them
    for process in killed:
        os.kill(process.pid, signal.SIGKILL)
    await asyncio.to_thread(psutil.wait_procs, killed, timeout=10)  # off the event loop
    assert await calls.read_input(source.as_uri(), 0) == b"[[0.5]]"
    assert {p.pid for p in _callers()}.isdisjoint(p.pid for p in killed)
