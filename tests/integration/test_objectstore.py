"""The model store on S3-compatible storage, against a real S3 server on loopback (moto's, in a
child process), through the real WorkLoadManager and the HTTP API.

The shared bucket holds the reference store under ``mme/``: the reference archive uploaded 1,000
times as ``sklearn-N.tar.gz``, plus a few objects that must fail or be skipped. Tests that change
objects use prefixes of their own. Requests to the store are counted with botocore's event hooks
on the store's own client.
"""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import joblib
import pytest
from aiohttp.test_utils import TestClient
from sklearn.linear_model import LinearRegression

from mmserver import errors
from mmserver.config.server import ServerConfig
from mmserver.server import Server
from mmserver.store.s3 import ObjectStore
from tests.e2e.server_process import unpacking_pids
from tests.integration.harness import ServerLikeTestServer, error_of
from tests.integration.s3server import Requests, S3Server, s3_environment, s3_server
from tests.models import make_linear_archive, make_linear_model, rows, value

pytestmark = pytest.mark.timeout(60)

BUCKET = "models"
STORE = f"s3://{BUCKET}/mme"
COUNT = 1000
X = rows([[0.5]])
REFERENCE = 2.0  # y = 2x + 1 at 0.5
OTHER = 2.5  # y = -3x + 4 at 0.5
EXTRA_ARCHIVES = ("corrupt", "huge", "unsafe")


def tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def reference_archive() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return make_linear_archive(Path(tmp) / "model.tar.gz").read_bytes()


def other_model_archive() -> bytes:
    """A different model: y = -3x + 4."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.joblib"
        joblib.dump(LinearRegression().fit([[0.0], [1.0]], [4.0, 1.0]), path)
        return tar_gz({"model.joblib": path.read_bytes()})


def padded_archive(padding: int) -> bytes:
    """The reference model plus ``padding`` incompressible bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        model = make_linear_model(Path(tmp)) / "model.joblib"
        return tar_gz({"model.joblib": model.read_bytes(), "padding.bin": os.urandom(padding)})


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The shared S3 server, with the boto3 environment pointing at it for the module."""
    with s3_environment(tmp_path_factory.mktemp("aws"), BUCKET) as server:
        client = server.client()
        body = reference_archive()

        def put(key: str, data: bytes = body) -> None:
            client.put_object(Bucket=BUCKET, Key=f"mme/{key}", Body=data)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, (f"sklearn-{i}.tar.gz" for i in range(COUNT))))
        put("corrupt.tar.gz", b"\x1f\x8b this is not a gzip stream")
        put("unsafe.tar.gz", tar_gz({"../escaped.txt": b"x", "model.joblib": b"x"}))
        put("huge.tar.gz", os.urandom(3 * 2**20 // 2))  # 1.5 MiB
        put("sklearn-5.tgz", b"shadowed by sklearn-5.tar.gz")
        put("README.txt", b"not a model")
        put("nested/sklearn-0.tar.gz", body)  # below the prefix's level: not a model
        yield server


@pytest.fixture
def put(s3: S3Server) -> Any:
    client = s3.client()

    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=BUCKET, Key=key, Body=data)

    return put


@asynccontextmanager
async def serving(cache: Path, model_store: str = STORE, **options: Any) -> AsyncIterator[Server]:
    """The server's composition root (store, WorkLoadManager, app) over an S3 store, backend in
    threads; the HTTP app is served by the tests that need it."""
    settings: dict[str, Any] = {"backend_processes": 0, "max_workers": 1}
    settings.update(options)
    config = ServerConfig(model_store=model_store, cache_dir=str(cache), **settings)
    server = Server(config)
    await server.wlm.start()
    try:
        yield server
    finally:
        await server.wlm.stop(2.0)


def store_of(server: Server) -> ObjectStore:
    assert isinstance(server.store, ObjectStore)
    return server.store


def folder_of(store: ObjectStore, name: str) -> str:
    """The cache folder of the current version of ``name``."""
    entry = store.find(name)
    assert entry is not None
    return entry.path.name


def copies(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


# ------------------------------------------------------------------------------------------------
# Listing and serving
# ------------------------------------------------------------------------------------------------


def test_lists_every_model_page_by_page_without_downloading(s3: S3Server, tmp_path: Path) -> None:
    store = ObjectStore(STORE, tmp_path / "cache", 2**30)
    lists = Requests(store.client, "ListObjectsV2")
    gets = Requests(store.client, "GetObject")
    entries = store.list()
    expected = sorted([f"sklearn-{i}" for i in range(COUNT)] + list(EXTRA_ARCHIVES))
    assert [e.name for e in entries] == expected
    assert lists.count() == 2  # 1,004 objects: two pages of at most 1,000
    assert gets.count() == 0 and not (tmp_path / "cache").exists()
    by_name = {e.name: e for e in entries}
    sklearn_5 = by_name["sklearn-5"]
    assert sklearn_5.kind == "object" and sklearn_5.url == f"{STORE}/sklearn-5.tar.gz"
    assert sklearn_5 == store.find("sklearn-5.tar.gz")


async def test_every_model_is_served_through_the_workloadmanager(
    s3: S3Server, tmp_path: Path
) -> None:
    async with serving(tmp_path / "cache") as server:
        gets = Requests(store_of(server).client, "GetObject")
        room = asyncio.Semaphore(32)

        async def predict(name: str) -> float:
            async with room:
                return value(await server.wlm.submit(name, X).answer)

        names = [f"sklearn-{i}" for i in range(COUNT)]
        results = await asyncio.gather(*(predict(n) for n in names))
        assert results == pytest.approx([REFERENCE] * COUNT, abs=0.05)
        assert len(server.wlm.room.loaded) == COUNT
        assert gets.count() == COUNT
        # Loaded: answered without the store.
        assert value(await server.wlm.submit("sklearn-999", X).answer) == pytest.approx(
            REFERENCE, 0.05
        )
        assert gets.count() == COUNT


async def test_http_api_over_the_object_store(s3: S3Server, tmp_path: Path) -> None:
    async with serving(tmp_path / "cache") as server:
        async with TestClient(ServerLikeTestServer(server.app, host="127.0.0.1")) as client:
            response = await client.post("/predictions/sklearn-7", json=[[0.5]])
            assert response.status == 200
            body = await response.json()
            assert body["predictions"] == pytest.approx([REFERENCE], abs=0.05)

            response = await client.post(
                "/invocations",
                json=[[0.5]],
                headers={"X-Amzn-SageMaker-Target-Model": "sklearn-8.tar.gz"},
            )
            assert response.status == 200

            response = await client.post("/predictions/absent", json=[[0.5]])
            assert response.status == 404
            error = await error_of(response)
            assert error["type"] == "ModelNotFoundException" and STORE in error["message"]

            response = await client.post("/predictions/corrupt", json=[[0.5]])
            assert response.status == 500
            assert (await error_of(response))["type"] == "EngineException"

            response = await client.get("/models", params={"limit": "3"})
            assert response.status == 200
            listed = await response.json()
            assert [m["modelName"] for m in listed["models"]] == ["corrupt", "huge", "sklearn-0"]


async def test_listing_pages_come_from_one_listing_of_the_bucket(
    s3: S3Server, tmp_path: Path
) -> None:
    async with serving(tmp_path / "cache") as server:
        lists = Requests(store_of(server).client, "ListObjectsV2")
        async with TestClient(ServerLikeTestServer(server.app, host="127.0.0.1")) as client:
            names: list[str] = []
            params = {"limit": "100"}
            while True:
                response = await client.get("/models", params=params)
                assert response.status == 200
                body = await response.json()
                names += [m["modelName"] for m in body["models"]]
                if "nextPageToken" not in body:
                    break
                params = {"limit": "100", "next_page_token": body["nextPageToken"]}
        assert names == sorted([f"sklearn-{i}" for i in range(COUNT)] + list(EXTRA_ARCHIVES))
        assert lists.count() == 2  # one scan of 1,004 objects, for all eleven pages


async def test_objects_added_and_removed_are_listed_after_a_lookup(
    s3: S3Server, tmp_path: Path, put: Any
) -> None:
    client = s3.client()
    put("fresh/a.tar.gz", reference_archive())
    async with serving(
        tmp_path / "cache", f"s3://{BUCKET}/fresh", store_index_max_age=3600
    ) as server:
        lists = Requests(store_of(server).client, "ListObjectsV2")
        assert [m.name for m in await server.wlm.list_models()] == ["a"]
        put("fresh/b.tgz", reference_archive())
        assert value(await server.wlm.submit("b", X).answer) == pytest.approx(REFERENCE, abs=0.05)
        client.delete_object(Bucket=BUCKET, Key="fresh/a.tar.gz")
        with pytest.raises(errors.ModelNotFound):
            await server.wlm.submit("a", X).answer
        models = await server.wlm.list_models()
        assert [(m.name, m.url) for m in models] == [("b", f"s3://{BUCKET}/fresh/b.tgz")]
        # One listing of the store; one of fresh/a/, where the versions of a model a would be
        # once its archive is gone.
        assert lists.count() == 2


# ------------------------------------------------------------------------------------------------
# Downloading once
# ------------------------------------------------------------------------------------------------


async def test_concurrent_first_requests_download_once(s3: S3Server, tmp_path: Path) -> None:
    async with serving(tmp_path / "cache") as server:
        gets = Requests(store_of(server).client, "GetObject")
        results = await asyncio.gather(
            *(server.wlm.submit("sklearn-500", X).answer for _ in range(50))
        )
        assert [value(r) for r in results] == pytest.approx([REFERENCE] * 50, abs=0.05)
        assert gets.count() == 1
        # The archive is not kept once unpacked, and nothing half-done is left.
        assert copies(tmp_path / "cache") == {folder_of(store_of(server), "sklearn-500")}


def test_threads_of_one_store_download_once(s3: S3Server, tmp_path: Path) -> None:
    store = ObjectStore(STORE, tmp_path / "cache", 2**30)
    gets = Requests(store.client, "GetObject")
    entry = store.find("sklearn-3")
    assert entry is not None
    with ThreadPoolExecutor(8) as pool:
        folders = set(pool.map(lambda _: store.prepare(entry), range(8)))
    assert gets.count() == 1
    assert len(folders) == 1 and (folders.pop() / "model.joblib").is_file()


def test_stores_sharing_a_cache_never_see_partial_copies(s3: S3Server, tmp_path: Path) -> None:
    """Two stores (as two server processes would) prepare the same model at the same moment."""
    cache = tmp_path / "cache"
    stores = [ObjectStore(STORE, cache, 2**30) for _ in range(2)]
    entries = [s.find("sklearn-4") for s in stores]
    start = threading.Barrier(2)

    def prepare(i: int) -> Path:
        entry = entries[i]
        assert entry is not None
        start.wait(5)
        return stores[i].prepare(entry)

    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(prepare, range(2)))
    assert folders[0] == folders[1]
    assert [p.name for p in folders[0].iterdir()] == ["model.joblib"]
    assert copies(cache) == {folders[0].name}  # no temporary file or folder left


# ------------------------------------------------------------------------------------------------
# Cache budget and changed objects
# ------------------------------------------------------------------------------------------------

PADDING = 400 * 1024  # each copy ~401 KiB: two fit in max_cache_mb=1, three do not


async def test_cache_past_max_cache_mb_drops_least_recently_used_copies(
    s3: S3Server, put: Any, tmp_path: Path
) -> None:
    for i in range(4):
        put(f"lru/big-{i}.tar.gz", padded_archive(PADDING))
    cache = tmp_path / "cache"
    async with serving(cache, f"s3://{BUCKET}/lru", max_cache_mb=1, max_loaded_models=1) as server:
        store = store_of(server)
        gets = Requests(store.client, "GetObject")
        for i in range(4):
            assert value(await server.wlm.submit(f"big-{i}", X).answer) == pytest.approx(
                REFERENCE, 0.05
            )
        # big-0 and big-1 went (least recently used, no longer loaded) to keep 1 MiB.
        assert {c.rsplit("-", 1)[0] for c in copies(cache)} == {"big-2", "big-3"}
        assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) <= 2**20
        # Back on its next request: downloaded again.
        assert value(await server.wlm.submit("big-0", X).answer) == pytest.approx(REFERENCE, 0.05)
        assert gets.count("lru/big-0.tar.gz") == 2
        assert {c.rsplit("-", 1)[0] for c in copies(cache)} == {"big-3", "big-0"}


async def test_copies_of_loaded_models_stay_past_the_budget(
    s3: S3Server, put: Any, tmp_path: Path
) -> None:
    for i in range(4):
        put(f"kept/big-{i}.tar.gz", padded_archive(PADDING))
    cache = tmp_path / "cache"
    async with serving(cache, f"s3://{BUCKET}/kept", max_cache_mb=1) as server:
        for i in range(3):
            await server.wlm.submit(f"big-{i}", X).answer
        # Over budget, but every copy belongs to a loaded model (a new worker reads it again).
        assert len(copies(cache)) == 3
        await server.wlm.unload("big-1")
        await server.wlm.submit("big-3", X).answer
        assert {c.rsplit("-", 1)[0] for c in copies(cache)} == {"big-0", "big-2", "big-3"}
        pool = server.wlm.room.loaded.get("big-0")
        assert pool is not None and pool.model_dir.is_dir()


async def test_a_changed_object_is_served_after_the_next_load(
    s3: S3Server, put: Any, tmp_path: Path
) -> None:
    put("changing/model.tar.gz", reference_archive())
    async with serving(tmp_path / "cache", f"s3://{BUCKET}/changing") as server:
        store = store_of(server)
        first = store.find("model")
        assert value(await server.wlm.submit("model", X).answer) == pytest.approx(
            REFERENCE, abs=0.05
        )
        put("changing/model.tar.gz", other_model_archive())
        second = store.find("model")
        assert first is not None and second is not None and first.etag != second.etag
        # Loaded: still the version it loaded, until it is unloaded (DELETE /models/model).
        assert value(await server.wlm.submit("model", X).answer) == pytest.approx(
            REFERENCE, abs=0.05
        )
        await server.wlm.unload("model")
        assert value(await server.wlm.submit("model", X).answer) == pytest.approx(OTHER, abs=0.05)
        assert second.path.is_dir()


def test_an_object_replaced_after_its_lookup_is_not_unpacked_as_the_old_version(
    s3: S3Server, put: Any, tmp_path: Path
) -> None:
    put("racing/model.tar.gz", reference_archive())
    store = ObjectStore(f"s3://{BUCKET}/racing", tmp_path / "cache", 2**30)
    looked_up = store.find("model")
    assert looked_up is not None
    put("racing/model.tar.gz", other_model_archive())
    with pytest.raises(errors.ServiceUnavailable, match="changed while it was being fetched"):
        store.prepare(looked_up)
    assert copies(tmp_path / "cache") == set()
    current = store.find("model")
    assert current is not None and (store.prepare(current) / "model.joblib").is_file()


# ------------------------------------------------------------------------------------------------
# Failures stay with their model
# ------------------------------------------------------------------------------------------------


async def test_missing_corrupt_unsafe_and_oversized_objects_fail_alone(
    s3: S3Server, tmp_path: Path
) -> None:
    async with serving(tmp_path / "cache", max_archive_mb=1) as server:
        gets = Requests(store_of(server).client, "GetObject")
        with pytest.raises(errors.ModelNotFound, match=f"not in the model store \\({STORE}\\)"):
            await server.wlm.submit("absent", X).answer
        with pytest.raises(errors.ModelLoadError, match=r"corrupt\.tar\.gz cannot be unpacked"):
            await server.wlm.submit("corrupt", X).answer
        with pytest.raises(errors.UnsafeArchive, match=r"leaves the archive"):
            await server.wlm.submit("unsafe", X).answer
        with pytest.raises(errors.ModelLoadError, match=r"huge.tar.gz is 1572864 bytes.*max_ar"):
            await server.wlm.submit("huge", X).answer
        assert gets.count("mme/huge.tar.gz") == 0  # refused before downloading
        assert value(await server.wlm.submit("sklearn-1", X).answer) == pytest.approx(
            REFERENCE, 0.05
        )
        assert not (tmp_path / "cache" / "escaped.txt").exists()
        assert {p.name for p in (tmp_path / "cache").iterdir()} == {
            folder_of(store_of(server), "sklearn-1")
        }


async def test_with_backend_processes_downloads_hand_their_archives_to_unpacking_processes(
    s3: S3Server, tmp_path: Path
) -> None:
    """An object store's downloads stay in the frontend's threads; the archives they fetch are
    unpacked, and their errors raised, in the unpacking processes."""
    async with serving(tmp_path / "cache", backend_processes=1) as server:
        assert value(await server.wlm.submit("sklearn-1", X).answer) == pytest.approx(
            REFERENCE, 0.05
        )
        with pytest.raises(errors.UnsafeArchive, match=r"leaves the archive"):
            await server.wlm.submit("unsafe", X).answer
        # One archive at a time here: one process was needed.
        assert len(unpacking_pids(os.getpid())) == 1
        assert {p.name for p in (tmp_path / "cache").iterdir()} == {
            folder_of(store_of(server), "sklearn-1")
        }


async def test_denied_or_unreachable_store_is_503_with_the_reason(
    tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    with s3_server() as own:
        monkeypatch.setenv("AWS_ENDPOINT_URL", own.endpoint)
        client = own.client()
        client.create_bucket(Bucket=BUCKET)
        for i in range(3):
            client.put_object(
                Bucket=BUCKET, Key=f"mme/sklearn-{i}.tar.gz", Body=reference_archive()
            )
        async with serving(tmp_path / "cache") as server:
            app = ServerLikeTestServer(server.app, host="127.0.0.1")
            async with TestClient(app) as http:
                response = await http.post("/predictions/sklearn-0", json=[[0.5]])
                assert response.status == 200

                own.enforce_authentication(True)
                response = await http.post("/predictions/sklearn-1", json=[[0.5]])
                assert response.status == 503
                message = (await error_of(response))["message"]
                assert f"the model store {STORE}: access denied" in message

                own.stop()
                started = time.monotonic()
                response = await http.post("/predictions/sklearn-2", json=[[0.5]])
                assert response.status == 503
                message = (await error_of(response))["message"]
                assert f"the model store {STORE} is unreachable" in message
                assert time.monotonic() - started < 10
                response = await http.get("/models")
                assert response.status == 503
                # A loaded model does not need the store.
                response = await http.post("/predictions/sklearn-0", json=[[0.5]])
                assert response.status == 200
