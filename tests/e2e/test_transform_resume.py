"""A transform job killed mid-run (SIGKILL, nothing to clean up) and run again finishes with the
outputs of an uninterrupted run, no line twice, and leaves no server of its own behind; the
same job run twice at once is refused."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.e2e.server_process import descendants, until, wait_gone
from tests.e2e.transform_process import outputs, run_transform, start_transform, write_csv_files
from tests.models import make_pipeline_dir

pytestmark = pytest.mark.e2e

FILES = {f"part-{n:02d}.csv": 30 for n in range(20)}


def _done(journal: Path) -> int:
    try:
        return len((journal / "done").read_bytes().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(240)
async def test_a_killed_job_run_again_finishes_as_an_uninterrupted_run(tmp_path: Path) -> None:
    store = tmp_path / "store"
    make_pipeline_dir(store / "pipe")
    data = tmp_path / "in"
    write_csv_files(data, FILES, features=3)
    out = tmp_path / "out"
    journal = out / ".mmserver-transform"
    args = (
        "--model", "pipe", "--model-store", str(store), "--backend-processes", "1",
        "--input", str(data), "--batch-strategy", "SingleRecord",
        "--max-concurrent-transforms", "1",
    )  # fmt: skip

    job = await start_transform(*args, "--output", str(out))
    try:
        await until(_journal_has_files(journal, 3), 120, "three files done, a fourth begun")
        family = descendants(job.pid)
        assert family, "the job's own server"
        # The same command again while the job runs is refused, and starts nothing.
        code, text = await run_transform(*args, "--output", str(out), timeout=60)
        assert code == 2, text
        assert text.strip() == (
            f"mmserver transform: another run of this job (pid {job.pid}) is using its journal "
            f"{journal}: let it end (or stop it), then run the command again to continue"
        )
        # The kill lands mid-file: a file in progress again (the refused run took a while).
        await until(_journal_has_files(journal, 3), 120, "a file in progress")
        job.send_signal(signal.SIGKILL)
        await asyncio.wait_for(job.wait(), 30)
    finally:
        if job.returncode is None:
            job.kill()
            await job.wait()
    assert job.returncode == -signal.SIGKILL
    await wait_gone(family, timeout=60)  # the server saw its parent die and stopped
    killed_at = _done(journal)
    assert 3 <= killed_at < len(FILES), "killed mid-run"
    written = {name for name in outputs(out) if name.endswith(".out")}
    assert len(written) >= killed_at
    assert list((journal / "parts").iterdir()), "the file in progress has payloads recorded"
    # What a kill in the middle of writing an output leaves beside it: the rerun removes it.
    (out / ".part-19.csv.out.0123456789ab.part").write_bytes(b"0.5\n")

    code, text = await run_transform(*args, "--output", str(out), timeout=180)
    assert code == 0, text
    assert f"continued an earlier run: {killed_at} files" in text
    assert f"{len(FILES)} of {len(FILES)} files written, 0 failed" in text

    code, text = await run_transform(*args, "--output", str(tmp_path / "whole"), timeout=180)
    assert code == 0, text
    resumed, whole = outputs(out), outputs(tmp_path / "whole")
    assert sorted(whole) == sorted(name + ".out" for name in FILES)
    assert resumed == whole
    for name, count in FILES.items():
        assert len(resumed[name + ".out"].splitlines()) == count
    assert _done(journal) == len(FILES)
    assert not list((journal / "parts").iterdir())


def _journal_has_files(journal: Path, count: int) -> Callable[[], Awaitable[bool]]:
    """Whether ``count`` files are done and the next one has payloads recorded."""

    async def reached() -> bool:
        parts = journal / "parts"
        return _done(journal) >= count and parts.is_dir() and any(parts.iterdir())

    return reached


@pytest.mark.timeout(180)
async def test_ctrl_c_stops_the_job_and_its_server_and_a_rerun_finishes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    make_pipeline_dir(store / "pipe")
    data = tmp_path / "in"
    write_csv_files(data, FILES, features=3)
    out = tmp_path / "out"
    args = (
        "--model", "pipe", "--model-store", str(store), "--backend-processes", "1",
        "--input", str(data), "--output", str(out), "--batch-strategy", "SingleRecord",
        "--max-concurrent-transforms", "1",
    )  # fmt: skip
    job = await start_transform(*args)
    try:
        await until(_journal_has_files(out / ".mmserver-transform", 1), 120, "a file done")
        family = descendants(job.pid)
        job.send_signal(signal.SIGINT)
        printed, _ = await asyncio.wait_for(job.communicate(), 60)
    finally:
        if job.returncode is None:
            job.kill()
            await job.wait()
    text = printed.decode()
    assert job.returncode == 130, text
    assert text.rstrip().endswith("interrupted; run the same command again to continue")
    assert f"of {len(FILES)} files written, 0 failed" in text  # the summary, before stopping
    await wait_gone(family, timeout=60)

    code, text = await run_transform(*args, timeout=180)
    assert code == 0, text
    assert "continued an earlier run" in text
    assert sorted(outputs(out)) == sorted(name + ".out" for name in FILES)
