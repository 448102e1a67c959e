"""The model store: listing, names, safe unpacking of (hostile) archives, model URLs."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from mmserver.config.server import ModelConfig
from mmserver.errors import (
    Forbidden,
    InvalidInput,
    InvalidModelName,
    ModelLoadError,
    ModelNotFound,
    UnsafeArchive,
)
from mmserver.execution.predictor import load_predictor
from mmserver.store.archive import MAX_MEMBERS
from mmserver.store.local import ModelStore
from mmserver.store.names import normalize_name
from mmserver.store.source import StoreEntry
from mmserver.store.urls import resolve_model_url
from tests.models import EXAMPLE_NAMES, make_linear_archive, make_linear_model, make_store

MiB = 1024 * 1024

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def member(name: str, data: bytes = b"", **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    if info.type != tarfile.REGTYPE:
        info.size = 0
    return info, data


def build_tar(path: Path, members: Iterable[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A .tar.gz written member by member, so the test controls every header."""
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return path


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, ModelStore]:
    """``tmp/store`` (the root), ``tmp/store/.mmserver-cache``, a store with a 1 MiB cap."""
    root = tmp_path / "store"
    root.mkdir()
    cache = root / ".mmserver-cache"
    return root, cache, ModelStore(root, cache, max_unpacked_bytes=MiB)


# ------------------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sklearn-7", "sklearn-7"),
        ("sklearn-7.tar.gz", "sklearn-7"),
        ("sklearn-7.tgz", "sklearn-7"),
        ("a", "a"),
        ("Model_v1.2", "Model_v1.2"),
        ("x" * 128, "x" * 128),
        ("x" * 128 + ".tar.gz", "x" * 128),
    ],
)
def test_normalize_name(given: str, expected: str) -> None:
    assert normalize_name(given) == expected


@pytest.mark.parametrize(
    "bad",
    ["", "../x", "a/b", ".hidden", "x" * 129, "-x", "a b", "a\x00b", "..", ".tar.gz", "é", "a\\b"],
)
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(InvalidModelName) as info:
        normalize_name(bad)
    assert "letters, digits" in info.value.message


def test_invalid_names_are_refused_before_the_file_system(tmp_path: Path) -> None:
    # Every bad name below points at something that exists: only the name check stops it.
    root = tmp_path / "store"
    make_linear_model(root / ".hidden")
    make_linear_model(root / "a" / "b")
    make_linear_model(tmp_path / "x")
    store = ModelStore(root, root / ".mmserver-cache", MiB)
    for bad in ("../x", "a/b", ".hidden", "../x.tar.gz", str(tmp_path / "x")):
        with pytest.raises(InvalidModelName):
            store.find(bad)
    # And a store whose root does not exist refuses bad names the same way.
    missing = ModelStore(tmp_path / "nowhere", tmp_path / "nowhere-cache", MiB)
    with pytest.raises(InvalidModelName):
        missing.find("../x")
    assert missing.find("fine") is None
    assert not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------------------------------------------
# Listing and finding
# ------------------------------------------------------------------------------------------------


def test_lists_the_reference_store_without_loading(tmp_path: Path) -> None:
    root = make_store(tmp_path / "store", 1000)
    # A broken archive is still listed: listing never opens an archive or a model.
    (root / "broken.tar.gz").write_bytes(b"not a gzip file")
    store = ModelStore(root, root / ".mmserver-cache", MiB)

    entries = store.list()

    names = [e.name for e in entries]
    assert len(entries) == 1000 + len(EXAMPLE_NAMES) + 1
    assert names == sorted(names)
    assert {"sklearn-0", "sklearn-999", "broken", *EXAMPLE_NAMES} <= set(names)
    by_name = {e.name: e for e in entries}
    archive = root / "sklearn-7.tar.gz"
    assert by_name["sklearn-7"] == StoreEntry(
        "sklearn-7", archive, "archive", archive.stat().st_size
    )
    assert by_name["iris-classifier"].kind == "directory"
    assert by_name["iris-classifier"].size_bytes == sum(
        p.stat().st_size for p in (root / "iris-classifier").iterdir()
    )
    assert not (root / ".mmserver-cache").exists()  # nothing unpacked (its speed: scripts/bench)


def test_listing_rules(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    make_linear_model(root / "both")
    make_linear_archive(root / "both.tar.gz")  # the folder wins
    make_linear_archive(root / "short.tgz")
    make_linear_archive(root / "twice.tgz")
    make_linear_archive(root / "twice.tar.gz")  # .tar.gz wins over .tgz
    make_linear_model(root / "nested" / "inner")  # files in a subfolder count
    make_linear_model(root / ".hidden")
    make_linear_archive(root / ".hidden2.tar.gz")
    make_linear_archive(root / "bad name.tar.gz")
    make_linear_archive(root / "-dash.tar.gz")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a model")
    (root / ".mmserver-cache").mkdir()

    entries = {e.name: e for e in store.list()}
    assert sorted(entries) == ["both", "nested", "short", "twice"]
    assert entries["both"].kind == "directory"
    assert entries["both"].path == root / "both"
    assert entries["short"].path == root / "short.tgz"
    assert entries["twice"].path == root / "twice.tar.gz"
    assert entries["nested"].size_bytes == (root / "nested/inner/model.joblib").stat().st_size


def test_cache_dir_with_a_plain_name_is_not_a_model(tmp_path: Path) -> None:
    root = tmp_path / "store"
    make_linear_archive(root / "m.tar.gz")
    store = ModelStore(root, root / "cache", MiB)
    store.prepare(store.find("m"))  # type: ignore[arg-type]
    assert [e.name for e in store.list()] == ["m"]
    assert store.find("cache") is None


def test_missing_root_lists_nothing(tmp_path: Path) -> None:
    assert ModelStore(tmp_path / "none", tmp_path / "cache", MiB).list() == []


def test_find_sees_entries_added_later(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    assert store.find("late") is None
    assert store.list() == []
    archive = make_linear_archive(root / "late.tar.gz")
    entry = store.find("late.tar.gz")
    assert entry == StoreEntry("late", archive, "archive", archive.stat().st_size)
    assert store.find("late") == entry
    make_linear_model(root / "late")
    found = store.find("late")
    assert found is not None and found.kind == "directory"
    make_linear_archive(root / "other.tgz")
    assert store.find("other") == StoreEntry(
        "other", root / "other.tgz", "archive", (root / "other.tgz").stat().st_size
    )
    (root / "hollow").mkdir()
    assert store.find("hollow") is None


def test_entry_for_path(tmp_path: Path, layout: tuple[Path, Path, ModelStore]) -> None:
    _, _, store = layout
    folder = make_linear_model(tmp_path / "elsewhere")
    archive = make_linear_archive(tmp_path / "pack.tgz")
    entry = store.entry_for_path(folder, "mine")
    assert (entry.name, entry.kind, entry.path) == ("mine", "directory", folder)
    assert entry.size_bytes == (folder / "model.joblib").stat().st_size
    packed = store.entry_for_path(archive, "packed.tar.gz")
    assert (packed.name, packed.kind, packed.size_bytes) == (
        "packed",
        "archive",
        archive.stat().st_size,
    )
    assert (store.prepare(packed) / "model.joblib").is_file()
    with pytest.raises(ModelNotFound):
        store.entry_for_path(tmp_path / "gone", "gone")
    with pytest.raises(InvalidModelName):
        store.entry_for_path(folder, "../up")


# ------------------------------------------------------------------------------------------------
# Unpacking
# ------------------------------------------------------------------------------------------------


def test_prepare_directory_is_returned_as_is(layout: tuple[Path, Path, ModelStore]) -> None:
    root, cache, store = layout
    folder = make_linear_model(root / "plain")
    entry = store.find("plain")
    assert entry is not None
    assert store.prepare(entry) == folder
    assert not cache.exists()


def test_prepare_unpacks_once_and_the_model_loads(layout: tuple[Path, Path, ModelStore]) -> None:
    root, cache, store = layout
    make_linear_archive(root / "sklearn-7.tar.gz")
    entry = store.find("sklearn-7")
    assert entry is not None
    model_dir = store.prepare(entry)
    assert model_dir.parent == cache
    assert model_dir.name.startswith("sklearn-7-")
    assert files_under(model_dir) == {"model.joblib"}
    predictor = load_predictor(model_dir, ModelConfig(max_workers=1))
    out = np.asarray(predictor.predict(np.array([[0.5]])))
    assert float(out[0]) == pytest.approx(2.0, abs=0.02)

    marker = model_dir / "marker"
    marker.write_text("kept")
    assert store.prepare(entry) == model_dir  # reused, not unpacked again
    assert marker.read_text() == "kept"
    assert [p.name for p in cache.iterdir()] == [model_dir.name]  # no temporary folder left


def test_changed_archive_is_unpacked_again(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    archive = build_tar(root / "m.tar.gz", [member("version.txt", b"one")])
    first = store.prepare(store.entry_for_path(archive, "m"))
    assert (first / "version.txt").read_text() == "one"
    build_tar(archive, [member("version.txt", b"two!")])
    stamp = time.time_ns() + 1_000_000_000  # a distinct mtime even on coarse file systems
    os.utime(archive, ns=(stamp, stamp))
    second = store.prepare(store.entry_for_path(archive, "m"))
    assert second != first
    assert (second / "version.txt").read_text() == "two!"

    store.remove_unpacked("m")
    assert not first.exists() and not second.exists()


def test_remove_unpacked_only_touches_that_model(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    a = store.prepare(store.entry_for_path(make_linear_archive(root / "a.tar.gz"), "a"))
    a1 = store.prepare(store.entry_for_path(make_linear_archive(root / "a-1.tar.gz"), "a-1"))
    store.remove_unpacked("a")
    assert not a.exists()
    assert (a1 / "model.joblib").is_file()
    store.remove_unpacked("never-unpacked")  # nothing to do, no error


def test_single_top_level_folder_is_the_model_dir(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    folder = make_linear_model(root.parent / "src" / "model")
    with tarfile.open(root / "wrapped.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="model")
    entry = store.find("wrapped")
    assert entry is not None
    model_dir = store.prepare(entry)
    assert model_dir.name == "model"
    assert (model_dir / "model.joblib").is_file()

    # A folder next to a top-level file is not unwrapped.
    build_tar(root / "mixed.tar.gz", [member("sub/a.txt", b"a"), member("b.txt", b"b")])
    mixed = store.prepare(store.find("mixed"))  # type: ignore[arg-type]
    assert files_under(mixed) == {"sub", "sub/a.txt", "b.txt"}


def test_links_inside_the_archive_become_copies(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    archive = build_tar(
        root / "links.tar.gz",
        [
            member("data/real.txt", b"payload"),
            member("data/soft.txt", type=tarfile.SYMTYPE, linkname="real.txt"),
            member("hard.txt", type=tarfile.LNKTYPE, linkname="data/real.txt"),
        ],
    )
    model_dir = store.prepare(store.entry_for_path(archive, "links"))
    for name in ("data/soft.txt", "hard.txt"):
        path = model_dir / name
        assert not path.is_symlink()
        assert path.read_text() == "payload"


def test_parallel_prepares_agree(layout: tuple[Path, Path, ModelStore]) -> None:
    root, cache, store = layout
    entry = store.entry_for_path(make_linear_archive(root / "race.tar.gz"), "race")
    barrier = threading.Barrier(4)
    results: list[Path] = []

    def prepare() -> None:
        barrier.wait()
        results.append(ModelStore(root, cache, MiB).prepare(entry))

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(results) == 4 and len(set(results)) == 1
    assert [p.name for p in cache.iterdir()] == [results[0].name]


# ------------------------------------------------------------------------------------------------
# Hostile archives
# ------------------------------------------------------------------------------------------------

OUTSIDE = "escaped.txt"


def hostile_members(tmp_path: Path) -> dict[str, tuple[list[tuple[tarfile.TarInfo, bytes]], str]]:
    sentinel = str(tmp_path / OUTSIDE)
    ok = member("model.joblib", b"fine")
    return {
        "traversal": ([ok, member(f"../../{OUTSIDE}", b"x")], "leaves the archive ('..')"),
        "nested traversal": ([member(f"a/../../../{OUTSIDE}", b"x")], "leaves the archive"),
        "backslash traversal": ([member(f"..\\..\\{OUTSIDE}", b"x")], "leaves the archive"),
        "absolute path": ([ok, member(sentinel, b"x")], "has an absolute path"),
        "symlink to /etc/passwd": (
            [member("passwd", type=tarfile.SYMTYPE, linkname="/etc/passwd")],
            "is a symbolic link to '/etc/passwd' outside the archive",
        ),
        "relative symlink out": (
            [member("up", type=tarfile.SYMTYPE, linkname=f"../../{OUTSIDE}")],
            "is a symbolic link to",
        ),
        "symlink to the root": (
            [member("self", type=tarfile.SYMTYPE, linkname="."), member("self/x", b"x")],
            "member 'self' is a symbolic link to the archive's top folder",
        ),
        "hardlink outside": (
            [member("hard", type=tarfile.LNKTYPE, linkname=f"../{OUTSIDE}")],
            "is a hard link to",
        ),
        "hardlink absolute": (
            [member("hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")],
            "is a hard link to '/etc/passwd'",
        ),
        "link to a missing member": (
            [member("dangling", type=tarfile.SYMTYPE, linkname="nothing.txt")],
            "not a file earlier in the archive",
        ),
        "character device": (
            [member("null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)],
            "member 'null' is a device or fifo",
        ),
        "block device": ([member("sda", type=tarfile.BLKTYPE)], "is a device or fifo"),
        "fifo": ([member("pipe", type=tarfile.FIFOTYPE)], "member 'pipe' is a device or fifo"),
        "declared size over the cap": (
            [member("bomb.bin", bytes(MiB + 1))],
            "exceeds the limit of 1048576 bytes",
        ),
        "total over the cap": (
            [member("a.bin", bytes(600_000)), member("b.bin", bytes(600_000))],
            "at member 'b.bin'",
        ),
        "copies over the cap": (
            # Declared sizes pass; the copy made for the hard link crosses the cap while unpacking.
            [
                member("a.bin", bytes(700_000)),
                member("b.bin", type=tarfile.LNKTYPE, linkname="a.bin"),
            ],
            "while unpacking member 'b.bin'",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "traversal",
        "nested traversal",
        "backslash traversal",
        "absolute path",
        "symlink to /etc/passwd",
        "relative symlink out",
        "symlink to the root",
        "hardlink outside",
        "hardlink absolute",
        "link to a missing member",
        "character device",
        "block device",
        "fifo",
        "declared size over the cap",
        "total over the cap",
        "copies over the cap",
    ],
)
def test_hostile_archives_are_refused(
    tmp_path: Path, layout: tuple[Path, Path, ModelStore], case: str
) -> None:
    root, cache, store = layout
    members, expected = hostile_members(tmp_path)[case]
    archive = build_tar(root / "evil.tar.gz", members)
    before = files_under(tmp_path)

    with pytest.raises(UnsafeArchive) as info:
        store.prepare(store.entry_for_path(archive, "evil"))

    message = info.value.message
    assert message.startswith("model evil: archive evil.tar.gz: ")
    assert expected in message
    assert not (tmp_path / OUTSIDE).exists()
    assert not (root / OUTSIDE).exists()
    # Nothing new anywhere but the (now empty) cache directory.
    assert files_under(tmp_path) - before <= {"store/.mmserver-cache"}
    assert list(cache.iterdir()) == []


def test_too_many_members(layout: tuple[Path, Path, ModelStore]) -> None:
    root, cache, store = layout
    archive = build_tar(
        root / "many.tar.gz",
        (member(f"f{i}", type=tarfile.DIRTYPE) for i in range(MAX_MEMBERS + 1)),
    )
    with pytest.raises(UnsafeArchive, match=f"more than {MAX_MEMBERS} members"):
        store.prepare(store.entry_for_path(archive, "many"))
    assert list(cache.iterdir()) == []


def test_a_large_bomb_is_refused_before_it_is_inflated(
    layout: tuple[Path, Path, ModelStore],
) -> None:
    # 1 GiB declared in one header, followed by only 1 MiB of data: the archive is cut short,
    # so inflating it would end in a truncated-archive error; the size check must fire on the
    # header instead, before any of it is inflated or written.
    root, cache, store = layout

    path = root / "bomb.tar.gz"
    info = tarfile.TarInfo("bomb.bin")
    info.size = 1 << 30
    with gzip.open(path, "wb", compresslevel=1) as gz:
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
        gz.write(bytes(MiB))
    with pytest.raises(UnsafeArchive, match="exceeds the limit"):
        store.prepare(store.entry_for_path(path, "bomb"))
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"this is not gzip at all", "not a gzip file"),
        (b"", "cannot be unpacked"),
        (gzip.compress(b"plain text, not a tar archive" * 40, mtime=0), "cannot be unpacked"),
    ],
)
def test_corrupt_archives_fail_the_load(
    layout: tuple[Path, Path, ModelStore], content: bytes, reason: str
) -> None:
    root, cache, store = layout
    path = root / "corrupt.tar.gz"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as info:
        store.prepare(store.entry_for_path(path, "corrupt"))
    assert not isinstance(info.value, UnsafeArchive)
    assert info.value.message.startswith("model corrupt: archive corrupt.tar.gz cannot be unpacked")
    assert reason in info.value.message
    assert list(cache.iterdir()) == []


def test_truncated_archive_fails_the_load(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    big = build_tar(root / "full.tar.gz", [member("data.bin", os.urandom(200_000))])
    cut = root / "cut.tar.gz"
    cut.write_bytes(big.read_bytes()[:50_000])
    with pytest.raises(ModelLoadError, match=r"model cut: archive cut\.tar\.gz cannot be unpacked"):
        store.prepare(store.entry_for_path(cut, "cut"))


def test_archive_removed_before_prepare(layout: tuple[Path, Path, ModelStore]) -> None:
    root, _, store = layout
    entry = store.entry_for_path(make_linear_archive(root / "gone.tar.gz"), "gone")
    (root / "gone.tar.gz").unlink()
    with pytest.raises(ModelNotFound, match="no longer exists"):
        store.prepare(entry)


# ------------------------------------------------------------------------------------------------
# Model URLs (POST /models)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "roots" / "one", tmp_path / "roots" / "two"
    make_linear_model(first / "m1")
    make_linear_archive(first / "packed.tar.gz")
    make_linear_model(second / "m2")
    make_linear_model(tmp_path / "outside")
    return first, second


def test_resolve_local_paths(roots: tuple[Path, Path]) -> None:
    first, second = roots
    allowed = [first, second]
    assert resolve_model_url("m1", allowed) == (first / "m1").resolve()
    assert resolve_model_url(str(first / "m1"), allowed) == (first / "m1").resolve()
    assert resolve_model_url(f"file://{second / 'm2'}", allowed) == (second / "m2").resolve()
    assert (
        resolve_model_url(f"file://localhost{second / 'm2'}", allowed) == (second / "m2").resolve()
    )
    assert resolve_model_url("packed.tar.gz", allowed) == (first / "packed.tar.gz").resolve()
    os.symlink(second / "m2", first / "alias")  # a link that stays inside the roots is fine
    assert resolve_model_url("alias", allowed) == (second / "m2").resolve()


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/m.tar.gz",
        "https://h/m",
        "s3://bucket/model.tar.gz",
        "ftp://h/x",
        "HTTP://h",
    ],
)
def test_resolve_refuses_remote_schemes(roots: tuple[Path, Path], url: str) -> None:
    with pytest.raises(InvalidInput) as info:
        resolve_model_url(url, list(roots))
    assert "only local paths under the allowed model roots are accepted" in info.value.message


def test_resolve_refuses_paths_outside_the_roots(tmp_path: Path, roots: tuple[Path, Path]) -> None:
    first, second = roots
    allowed = [first, second]
    link = first / "sneaky"
    os.symlink(tmp_path / "outside", link)
    for url in (
        str(tmp_path / "outside"),
        "../../outside",
        f"file://{tmp_path / 'outside'}",
        "sneaky",
        str(link),
        "/etc",
    ):
        with pytest.raises(Forbidden) as info:
            resolve_model_url(url, allowed)
        assert "outside the allowed model roots" in info.value.message
        assert str(first.resolve()) in info.value.message
        assert str(second.resolve()) in info.value.message


def test_resolve_other_failures(roots: tuple[Path, Path]) -> None:
    first, _ = roots
    allowed = [first]
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model_url("missing", allowed)
    (first / "notes.txt").write_text("x")
    with pytest.raises(InvalidInput, match=r"must be a directory or a \.tar\.gz/\.tgz archive"):
        resolve_model_url("notes.txt", allowed)
    with pytest.raises(InvalidInput, match="empty"):
        resolve_model_url("  ", allowed)
    with pytest.raises(InvalidInput, match="names a model root itself"):
        resolve_model_url(str(first), allowed)
    with pytest.raises(InvalidInput, match="only local paths"):
        resolve_model_url("file://otherhost/m1", allowed)
    with pytest.raises(Forbidden, match="no model roots"):
        resolve_model_url("m1", [])
