"""Model names: any text resolves to a valid name or to 400, before the file system is touched;
``ModelStore.find`` on any text finds an entry inside the store, nothing, or refuses with 400."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mmserver.errors import InvalidModelName
from mmserver.store.local import ModelStore
from mmserver.store.names import MODEL_NAME_RE, normalize_name
from tests.fuzz.strategies import FAST, assert_client_error
from tests.models import make_linear_archive

#: The models of the fuzzed store: folders, archives of both suffixes, a name held by both.
FOLDERS = ("alpha", "Beta.v2", "both", "a..b", "x" * 128)
ARCHIVES = ("sklearn-0.tar.gz", "both.tar.gz", "z_9.tgz", "y" * 128 + ".tar.gz")
NAMES = ("alpha", "Beta.v2", "both", "a..b", "x" * 128, "sklearn-0", "z_9", "y" * 128)

name_chars = st.sampled_from(
    [*"aZ09._-/\\ \t\n\x00:%~", "..", ".tar.gz", ".tgz", "\u00e9", "\u2028", "\U0001f600"]
)
names = st.one_of(
    st.text(max_size=140),
    st.lists(name_chars, max_size=12).map("".join),
    st.sampled_from(NAMES).flatmap(
        lambda n: st.sampled_from([n, n + ".tar.gz", n + ".tgz", n + "/", "../" + n, n + "\n"])
    ),
    st.from_regex(MODEL_NAME_RE, fullmatch=True),
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ModelStore:
    root = tmp_path_factory.mktemp("store")
    archive = make_linear_archive(root / ARCHIVES[0])
    for name in ARCHIVES[1:]:
        os.link(archive, root / name)
    for name in FOLDERS:
        (root / name).mkdir()
        (root / name / "model.joblib").write_bytes(b"x")
    (root / "empty").mkdir()  # no file: not a model
    (root / "dir.tar.gz").mkdir()  # a folder with an archive's name: not an archive
    (root / "secret").write_text("outside any model")
    # Entries whose name without the suffix still ends in one: not models, since a request for
    # "w.tar.gz" means model "w".
    os.link(archive, root / "w.tar.gz.tar.gz")
    (root / "v.tgz").mkdir()
    (root / "v.tgz" / "model.joblib").write_bytes(b"x")
    return ModelStore(root, root / ".mmserver-cache", 2**20)


def test_every_listed_model_is_found_by_each_of_its_names(store: ModelStore) -> None:
    listed = store.list()
    assert sorted(e.name for e in listed) == sorted(NAMES)
    for entry in listed:
        for name in (entry.name, entry.name + ".tar.gz", entry.name + ".tgz"):
            assert normalize_name(name) == entry.name
            assert store.find(name) == entry


@FAST
@given(names)
@example("sklearn-7.tar.gz.tar.gz")
@example(".tar.gz")
@example("a" * 128 + ".tgz")
@example("a" * 129)
@example("a\n")
def test_normalize_name(name: str) -> None:
    try:
        base = normalize_name(name)
    except Exception as exc:
        assert_client_error(exc, InvalidModelName)
        assert isinstance(exc, InvalidModelName) and exc.status_code == 400
        return
    assert MODEL_NAME_RE.fullmatch(base)
    assert name in (base, base + ".tar.gz", base + ".tgz")
    assert normalize_name(base) == base
    assert normalize_name(base + ".tar.gz") == base


@given(st.one_of(st.integers(), st.none(), st.binary(max_size=5), st.lists(st.text(), max_size=2)))
def test_normalize_name_of_a_non_string(value: object) -> None:
    with pytest.raises(InvalidModelName):
        normalize_name(value)  # type: ignore[arg-type]


@FAST
@given(name=names)
@example(name="both")
@example(name="both.tgz")
@example(name="empty")
@example(name="dir")
@example(name="secret")
@example(name=".mmserver-cache")
@example(name="..")
@example(name="w.tar.gz.tar.gz")
@example(name="v.tgz")
def test_find(store: ModelStore, name: str) -> None:
    try:
        entry = store.find(name)
    except Exception as exc:
        assert_client_error(exc, InvalidModelName)
        return
    base = normalize_name(name)  # find accepted it: so does the name check
    if entry is None:
        assert base not in NAMES
        return
    assert base in NAMES
    assert entry.name == base
    root = Path(store.root).resolve()
    assert entry.path.resolve().parent == root
    if base == "both":
        assert entry.kind == "directory"  # a folder wins over an archive of the same name
    assert entry.kind in ("directory", "archive")
    assert re.fullmatch(re.escape(base) + r"(\.tar\.gz|\.tgz)?", entry.path.name)
