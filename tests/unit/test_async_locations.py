"""A small local input read with its request's start: a plain file within the bound, whole;
anything else is left to the reading in a thread of its own, which says what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

from mmserver.asynchronous.locations import Locations


def test_only_a_plain_local_file_within_the_bound_is_read_with_the_start(tmp_path: Path) -> None:
    small = tmp_path / "small.json"
    small.write_bytes(b"[[0.5]]")
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # never opened for writing: reading it would wait forever
    assert Locations.read_small(small.as_uri(), 7) == b"[[0.5]]"
    assert Locations.read_small(str(small), 100) == b"[[0.5]]"
    assert Locations.read_small(empty.as_uri(), 100) == b""
    assert Locations.read_small(small.as_uri(), 6) is None  # larger than the bound
    assert Locations.read_small(pipe.as_uri(), 100) is None
    assert Locations.read_small(tmp_path.as_uri(), 100) is None  # a folder
    assert Locations.read_small((tmp_path / "missing").as_uri(), 100) is None
    assert Locations.read_small("s3://bucket/small.json", 100) is None
