"""Bodies read and written whole at local locations: what a reader sees, the mode a new file
gets, and the errors that say a location is missing or unreadable (the object-store side runs
against the S3 test server in tests/integration/test_async.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmserver.store.objects import (
    LocationError,
    Objects,
    bucket_key,
    local_path,
    remove_staged,
    staging_beside,
    write_whole,
)


def test_a_body_is_written_whole_with_the_mode_the_umask_gives(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "answer.out"
    old = os.umask(0o027)
    try:
        Objects().write(target.as_uri(), b"[1, 2]", "application/json")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"[1, 2]"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in target.parent.iterdir()] == ["answer.out"]  # no temporary left


def test_a_failed_write_leaves_the_old_body_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "answer.out"
    write_whole(target, b"old")

    with pytest.raises(TypeError):  # the write fails midway
        write_whole(target, "new")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["answer.out"]


def test_missing_and_unreadable_locations_say_which(tmp_path: Path) -> None:
    objects = Objects()
    missing = str(tmp_path / "nothing.csv")
    assert not objects.exists(missing)
    with pytest.raises(LocationError) as info:
        objects.read(missing)
    assert info.value.missing and not info.value.remote
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(LocationError) as info:
        objects.read(str(folder))
    assert not info.value.missing and info.value.reason == "Is a directory"


def test_urls_and_paths() -> None:
    assert local_path("file:///data/in%20put.csv") == Path("/data/in put.csv")
    assert local_path("/data/x.csv") == Path("/data/x.csv")
    with pytest.raises(LocationError, match="only local file:// URLs"):
        local_path("file://elsewhere/data/x.csv")
    assert bucket_key("s3://bucket/a/b/") == ("bucket", "a/b/")
    with pytest.raises(LocationError):
        bucket_key("s3://")


def test_local_locations_fail_clearly_without_importing_botocore(tmp_path: Path) -> None:
    # A batch transform over local files reads through these calls: its start-up must not
    # pay for botocore, which only S3 locations need.
    code = (
        "import sys\n"
        "from mmserver.store.objects import LocationError, Objects\n"
        "objects = Objects()\n"
        f"print(objects.read({str(tmp_path / 'in.csv')!r}))\n"
        "try:\n"
        f"    objects.read({str(tmp_path / 'nothing.csv')!r})\n"
        "except LocationError as exc:\n"
        "    print(exc.missing, exc.remote)\n"
        "print(sorted(m for m in sys.modules if m.startswith('botocore')))\n"
    )
    (tmp_path / "in.csv").write_bytes(b"1,2\n")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["b'1,2\\n'", "True False", "[]"]


def test_what_killed_writes_left_is_removed_for_the_names_given(tmp_path: Path) -> None:
    out, nested = tmp_path / "out", tmp_path / "out" / "day 1"
    nested.mkdir(parents=True)
    long_name = "é" * 150 + ".csv.out"  # 308 bytes: its staging name is cut to fit
    targets = [out / "a.out", out / "a[1].out", nested / "b.out", out / long_name]
    left = [staging_beside(path) for path in targets] + [staging_beside(targets[0])]
    for path in left:
        path.write_bytes(b"half")
    assert all(len(path.name.encode()) <= 255 for path in left)
    others = [
        out / "a.out",  # a whole output
        staging_beside(out / "c.out"),  # another name's
        out / ".a.out.0123456789ab.part.keep",
        out / ".a.out.tmp.part",
    ]
    for path in others:
        path.write_bytes(b"keep")
    later = staging_beside(out / "a.out")  # written after the cut-off: a live writer's
    later.write_bytes(b"live")
    os.utime(later, (time.time() + 60, time.time() + 60))

    removed = remove_staged([*targets, tmp_path / "missing" / "x.out"], time.time() + 30)
    assert removed == len(left)
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in others) and later.exists()


def test_a_whole_write_under_a_long_name_stages_beside_it(tmp_path: Path) -> None:
    target = tmp_path / ("n" * 250 + ".out")
    write_whole(target, b"1")
    assert target.read_bytes() == b"1" and [p.name for p in tmp_path.iterdir()] == [target.name]
