"""The object store's pure parts: the cache eviction choice, ``s3://`` URLs and their options."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError
from mmserver.opening import open_store
from mmserver.store.cache import CachedCopy, choose_cache_victims
from mmserver.store.local import ModelStore
from mmserver.store.s3 import ObjectStore
from mmserver.store.urls import split_object_url


def copy(key: str, size: int, used: float, protected: bool = False) -> CachedCopy:
    return CachedCopy(key, size, used, protected)


@pytest.mark.parametrize(
    ("copies", "budget", "incoming", "victims"),
    [
        ([], 100, 0, []),
        ([copy("a", 40, 1), copy("b", 40, 2)], 100, 0, []),  # fits
        ([copy("a", 40, 1), copy("b", 40, 2)], 100, 40, ["a"]),  # room for the download
        ([copy("b", 40, 2), copy("a", 40, 1), copy("c", 40, 3)], 50, 0, ["a", "b"]),  # LRU first
        ([copy("a", 40, 1, True), copy("b", 40, 2), copy("c", 40, 3)], 50, 0, ["b", "c"]),
        ([copy("a", 40, 1, True), copy("b", 40, 2, True)], 10, 0, []),  # all in use: over budget
        ([copy("a", 10, 1), copy("b", 90, 2)], 95, 0, ["a"]),  # stops once it fits
        ([copy("x", 10, 5), copy("w", 10, 5)], 10, 0, ["w"]),  # ties: by name, stable
    ],
)
def test_cache_victims(
    copies: list[CachedCopy], budget: int, incoming: int, victims: list[str]
) -> None:
    assert choose_cache_victims(copies, budget, incoming) == victims


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket", ("bucket", "")),
        ("s3://bucket/", ("bucket", "")),
        ("s3://bucket/models", ("bucket", "models/")),
        ("S3://bucket/a/b/", ("bucket", "a/b/")),
        (" s3://my.bucket-1/p ", ("my.bucket-1", "p/")),
    ],
)
def test_object_urls(url: str, expected: tuple[str, str]) -> None:
    assert split_object_url(url) == expected


@pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "s3://../x", "s3://b c/p", "gs://b"])
def test_bad_object_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        split_object_url(url)


def test_s3_store_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = ServerConfig.build(
        env={"MMSERVER_MODEL_STORE": "s3://models/mme/", "MMSERVER_MAX_CACHE_MB": "512"}
    )
    assert config.store_url == "s3://models/mme/"
    assert config.max_cache_mb == 512
    key = hashlib.sha256(b"mme/").hexdigest()[:16]
    assert config.cache_path == tmp_path / "mmserver" / "models" / key
    assert config.allowed_roots == ()  # POST /models needs allowed_model_roots
    with pytest.raises(ConfigError, match="not a local directory"):
        _ = config.store_path
    explicit = ServerConfig(
        model_store="s3://models", cache_dir=str(tmp_path / "c"), allowed_model_roots=str(tmp_path)
    )
    assert explicit.cache_path == tmp_path / "c"
    assert explicit.allowed_roots == (tmp_path,)


def test_local_store_options_are_unchanged(tmp_path: Path) -> None:
    config = ServerConfig(model_store=str(tmp_path))
    assert config.store_url is None
    assert config.cache_path == tmp_path / ".mmserver-cache"
    assert config.allowed_roots == (tmp_path,)


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ("gs://bucket/models", "only a local directory or s3://bucket/prefix"),
        ("https://example.com/models", "only a local directory or s3://bucket/prefix"),
        ("s3://", "not a valid bucket name"),
        ("s3://bad bucket/p", "not a valid bucket name"),
    ],
)
def test_unsupported_stores_are_refused(store: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(model_store=store)


def test_open_store_picks_the_store_from_the_config(tmp_path: Path) -> None:
    local = open_store(ServerConfig(model_store=str(tmp_path)))
    assert isinstance(local, ModelStore) and local.root == tmp_path
    remote = open_store(
        ServerConfig(model_store="s3://models/mme", cache_dir=str(tmp_path), max_cache_mb=3)
    )
    assert isinstance(remote, ObjectStore)
    assert (remote.root, remote.bucket, remote.prefix) == ("s3://models/mme", "models", "mme/")
    assert remote.max_cache_bytes == 3 * 2**20
