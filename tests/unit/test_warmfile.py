"""The warm set's file and rules as pure functions: its text, read back and refused, the order
it keeps, the workers a restored model gets and when the restore tells its progress."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mmserver.lifecycle.warmfile import (
    WarmFileError,
    WarmModel,
    decode,
    encode,
    ordered,
    progress_due,
    restored_workers,
    signature,
)
from mmserver.ops.statefile import write_atomically

MB = 2**20


def test_the_file_reads_back_what_was_written_in_its_order() -> None:
    models = [
        WarmModel("churn/2", 3, 6 * MB, 2 * MB),
        WarmModel("iris", 1, MB, MB),
        WarmModel("scaled-to-zero", 0),
    ]
    text = encode(models)
    assert decode(text) == models
    # One model a line, a version under its model's name.
    lines = text.splitlines()
    assert lines[0] == '{"format": 1, "models": ['
    assert json.loads(lines[1].rstrip(",")) == {
        "model": "churn",
        "version": 2,
        "workers": 3,
        "memory_bytes": 6 * MB,
        "copy_bytes": 2 * MB,
    }
    assert json.loads(text)["models"][1]["model"] == "iris"


def test_an_empty_set_is_a_file_too() -> None:
    assert decode(encode([])) == []


def test_sizes_may_be_left_out() -> None:
    text = '{"format": 1, "models": [{"model": "a", "workers": 2}]}'
    assert decode(text) == [WarmModel("a", 2, 0, 0)]


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("", "not JSON"),
        ("\x00\x01garbage", "not JSON"),
        ('{"format": 1, "models": [', "not JSON"),
        ("[]", "not a warm set"),
        ('{"models": []}', "not a warm set"),
        ('{"format": 2, "models": []}', "not a warm set"),
        ('{"format": 1, "models": {}}', '"models" is not a list'),
        ('{"format": 1, "models": [1]}', "entry 1 is not an object"),
        ('{"format": 1, "models": [{"workers": 1}]}', "entry 1: None is not a model name"),
        (
            '{"format": 1, "models": [{"model": "a", "workers": 1}, '
            '{"model": "../etc", "workers": 1}]}',
            "entry 2: '../etc' is not a model name",
        ),
        ('{"format": 1, "models": [{"model": "a.tar.gz", "workers": 1}]}', "not a model name"),
        ('{"format": 1, "models": [{"model": "a/1", "workers": 1}]}', "not a model name"),
        ('{"format": 1, "models": [{"model": "a"}]}', "workers is None"),
        ('{"format": 1, "models": [{"model": "a", "workers": -1}]}', "workers is -1"),
        ('{"format": 1, "models": [{"model": "a", "workers": true}]}', "workers is True"),
        ('{"format": 1, "models": [{"model": "a", "workers": 1.5}]}', "workers is 1.5"),
        ('{"format": 1, "models": [{"model": "a", "workers": 1, "version": 0}]}', "version is 0"),
        (
            '{"format": 1, "models": [{"model": "a", "workers": 1, "memory_bytes": "1"}]}',
            "memory_bytes is '1'",
        ),
        (
            '{"format": 1, "models": [{"model": "a", "workers": 1, "path": "/x"}]}',
            "entry 1 has unknown members: path",
        ),
        (
            '{"format": 1, "models": [{"model": "a", "workers": 1}, {"model": "a", "workers": 2}]}',
            "entry 2: model a is listed twice",
        ),
    ],
)
def test_a_file_this_server_did_not_write_is_refused_whole(text: str, fault: str) -> None:
    with pytest.raises(WarmFileError, match=re.escape(fault)):
        decode(text)


def test_the_loaded_models_come_most_recently_used_first_then_those_not_restored_yet() -> None:
    loaded_lru_first = [WarmModel("old", 1), WarmModel("mid", 2), WarmModel("new", 1)]
    pending = [WarmModel("mid", 4), WarmModel("later", 1), WarmModel("last", 3)]
    assert [m.key for m in ordered(loaded_lru_first, pending)] == [
        "new",
        "mid",
        "old",
        "later",
        "last",
    ]
    # A model loaded is written as it is now, not as the file had it.
    assert signature(ordered(loaded_lru_first, pending))["mid"] == 2


def test_a_change_is_a_model_loaded_or_unloaded_or_its_workers_not_the_order() -> None:
    a, b = WarmModel("a", 1), WarmModel("b", 1)
    assert signature([a, b]) == signature([b, a])
    assert signature([a, b]) != signature([a])
    assert signature([a, b]) != signature([a, WarmModel("b", 2)])
    # Sizes change with every measure: not a change of the set.
    assert signature([a]) == signature([WarmModel("a", 1, 5 * MB, MB)])


@pytest.mark.parametrize(
    ("saved", "min_workers", "max_workers", "restored"),
    [
        (3, 1, 4, 3),
        (3, 1, 2, 2),  # maxWorkers lowered since
        (1, 2, 4, 2),  # minWorkers raised since
        (0, 0, 4, 0),  # scaled to zero
        (5, 0, 0, 0),  # no workers at all now
    ],
)
def test_a_restored_model_gets_its_workers_within_its_bounds_of_now(
    saved: int, min_workers: int, max_workers: int, restored: int
) -> None:
    assert restored_workers(saved, min_workers, max_workers) == restored


def test_progress_is_told_at_each_tenth_never_at_the_end() -> None:
    assert [done for done in range(1, 6) if progress_due(done, 5)] == [1, 2, 3, 4]
    assert [done for done in range(1, 101) if progress_due(done, 100)] == list(range(10, 100, 10))
    told = [done for done in range(1, 1001) if progress_due(done, 1000)]
    assert told == list(range(100, 1000, 100))
    assert not progress_due(1, 1)


def test_the_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "state" / "warm.json"
    write_atomically(path, encode([WarmModel("a", 1)]))
    write_atomically(path, encode([WarmModel("b", 2)]))
    assert decode(path.read_text()) == [WarmModel("b", 2)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["warm.json"]  # no temporary left
