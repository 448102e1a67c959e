"""The model lifecycle's transitions, and which records outlive their model's unload."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from mmserver import errors
from mmserver.lifecycle.record import Failure, ModelRecord, ModelStatus, TransitionError
from mmserver.store.source import StoreEntry

S = ModelStatus

ALLOWED = {
    (S.UNLOADED, S.LOADING),
    (S.LOADING, S.READY),
    (S.LOADING, S.FAILED),
    (S.LOADING, S.UNLOADED),
    (S.READY, S.UNLOADING),
    (S.UNLOADING, S.UNLOADED),
    (S.FAILED, S.LOADING),
    (S.FAILED, S.UNLOADED),
}


@pytest.mark.parametrize(("before", "after"), list(itertools.product(S, S)))
def test_transitions(before: ModelStatus, after: ModelStatus) -> None:
    record = ModelRecord("m", status=before)
    if (before, after) in ALLOWED:
        record.become(after)
        assert record.status is after
    else:
        with pytest.raises(TransitionError, match=f"from {before.value} to {after.value}"):
            record.become(after)
        assert record.status is before


def test_a_whole_life() -> None:
    record = ModelRecord("m")
    for status in (S.LOADING, S.FAILED, S.LOADING, S.READY, S.UNLOADING, S.UNLOADED):
        record.become(status)
    assert record.status is S.UNLOADED


ENTRY = StoreEntry("m", Path("/store/m.tar.gz"), "archive", 10)


@pytest.mark.parametrize(
    ("record", "kept"),
    [
        (ModelRecord("m"), False),
        (ModelRecord("m", status=S.LOADING), True),
        (ModelRecord("m", status=S.READY), True),
        (ModelRecord("m", status=S.UNLOADING), True),
        (ModelRecord("m", failure=Failure(errors.ModelLoadError("bad"), 0.0)), True),
        (ModelRecord("m", registered=ENTRY), True),
        (ModelRecord("m", overrides={"max_workers": 2}), True),
        (ModelRecord("m", startup=True), True),
        (ModelRecord("m", source="/store/m.tar.gz", signature={"platform": "x"}), False),
    ],
)
def test_kept_after_unload(record: ModelRecord, kept: bool) -> None:
    assert record.kept is kept
