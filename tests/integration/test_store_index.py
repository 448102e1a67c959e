"""The store index over real HTTP: every page of a large generated store from one scan, and
models added, replaced and removed while the server serves."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

import joblib
import pytest
from sklearn.linear_model import LinearRegression

from tests.integration.harness import Harness, Serve, error_of
from tests.models import make_linked_store

LARGE = 2000
REFERENCE = 2.0  # y = 2x + 1 at 0.5
OTHER = 2.5  # y = -3x + 4 at 0.5


def other_archive(path: Path) -> Path:
    """A different model, y = -3x + 4, as an archive at ``path``."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model.joblib"
        joblib.dump(LinearRegression().fit([[0.0], [1.0]], [4.0, 1.0]), model)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            tar.add(model, arcname="model.joblib")
    path.write_bytes(buffer.getvalue())
    return path


@pytest.fixture(scope="module")
def large_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 reference archives (hard links of one) and two folders among them."""
    root = make_linked_store(tmp_path_factory.mktemp("large") / "store", LARGE)
    for name in ("sklearn-1000x", "aaa-first"):
        folder = root / name
        folder.mkdir()
        os.link(root / "sklearn-0.tar.gz", folder / "model.tar.gz")
    (root / "empty-folder").mkdir()  # holds no file: not a model
    (root / "notes.txt").write_text("not a model")
    an_hour_ago = os.stat(root).st_mtime - 3600
    os.utime(root, (an_hour_ago, an_hour_ago))  # settled: nothing changes in it from now on
    return root


def large_names(root: Path) -> list[str]:
    return sorted([f"sklearn-{i}" for i in range(LARGE)] + ["sklearn-1000x", "aaa-first"])


async def page(harness: Harness, **params: str) -> dict[str, Any]:
    response = await harness.client.get("/models", params=params)
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def listed(harness: Harness) -> list[str]:
    names: list[str] = []
    params = {"limit": "100"}
    while True:
        body = await page(harness, **params)
        names += [m["modelName"] for m in body["models"]]
        if "nextPageToken" not in body:
            return names
        params = {"limit": "100", "next_page_token": body["nextPageToken"]}


async def predict(harness: Harness, name: str) -> tuple[int, Any]:
    response = await harness.post(f"/predictions/{name}", "[[0.5]]")
    if response.status == 200:
        return 200, (await response.json())["predictions"][0]
    return response.status, await error_of(response)


@pytest.mark.timeout(120)
async def test_every_offset_of_a_large_store_pages_from_one_scan(
    serve: Serve, large_store: Path
) -> None:
    server = await serve(model_store=str(large_store))
    names = large_names(large_store)
    limit = 7
    for offset in range(len(names) + 1):
        params = {"limit": str(limit)}
        if offset:
            params["next_page_token"] = names[offset - 1]
        body = await page(server, **params)
        want = names[offset : offset + limit]
        assert [m["modelName"] for m in body["models"]] == want, offset
        if offset + limit < len(names):
            assert body["nextPageToken"] == want[-1]
        else:
            assert "nextPageToken" not in body
    first = (await page(server, limit="1"))["models"][0]
    assert first == {
        "modelName": "aaa-first",
        "modelUrl": str(large_store / "aaa-first"),
        "status": "UNLOADED",
    }
    # A token that is not a listed name pages from the next name after it.
    body = await page(server, limit="2", next_page_token="sklearn-1999a")
    assert [m["modelName"] for m in body["models"]] == ["sklearn-2", "sklearn-20"]
    # The store was scanned once for all those pages: nothing changed in it.
    assert server.wlm.catalog.index.scans == 1


async def test_added_replaced_and_removed_while_serving(serve: Serve, tmp_path: Path) -> None:
    root = make_linked_store(tmp_path / "store", 5)
    server = await serve(model_store=str(root))
    assert await listed(server) == [f"sklearn-{i}" for i in range(5)]
    assert await predict(server, "sklearn-1") == (200, pytest.approx(REFERENCE, abs=0.05))

    # Added: found on its first request, and listed without one.
    os.link(root / "sklearn-0.tar.gz", root / "late.tar.gz")
    assert await predict(server, "late") == (200, pytest.approx(REFERENCE, abs=0.05))
    other_archive(root / "later.tgz")
    assert await listed(server) == ["late", "later"] + [f"sklearn-{i}" for i in range(5)]
    assert (await page(server, limit="1", next_page_token="late"))["models"][0] == {
        "modelName": "later",
        "modelUrl": str(root / "later.tgz"),
        "status": "UNLOADED",
    }

    # Replaced: the loaded model serves on; its next load takes the new archive.
    replacement = other_archive(tmp_path / "replacement.tar.gz")
    os.replace(replacement, root / "sklearn-1.tar.gz")
    assert await predict(server, "sklearn-1") == (200, pytest.approx(REFERENCE, abs=0.05))
    assert (await server.client.delete("/models/sklearn-1")).status == 200
    assert await predict(server, "sklearn-1") == (200, pytest.approx(OTHER, abs=0.05))

    # Removed: unlisted, and 404 on its next request.
    os.unlink(root / "sklearn-3.tar.gz")
    status, error = await predict(server, "sklearn-3")
    assert status == 404 and error["type"] == "ModelNotFoundException"
    assert "sklearn-3" not in await listed(server)
    os.unlink(root / "sklearn-4.tar.gz")
    assert "sklearn-4" not in await listed(server)


async def test_a_lookup_updates_the_index_without_a_scan(serve: Serve, tmp_path: Path) -> None:
    """A request's lookup answers from the store now and puts its answer into the index, so an
    entry made and found between two listings is listed even before the next scan."""
    root = make_linked_store(tmp_path / "store", 3)
    server = await serve(model_store=str(root))
    assert await listed(server) == ["sklearn-0", "sklearn-1", "sklearn-2"]
    scans = server.wlm.catalog.index.scans
    os.link(root / "sklearn-0.tar.gz", root / "found.tar.gz")
    assert await predict(server, "found") == (200, pytest.approx(REFERENCE, abs=0.05))
    assert server.wlm.catalog.index.names_after(None, 10) == [
        "found",
        "sklearn-0",
        "sklearn-1",
        "sklearn-2",
    ]
    os.unlink(root / "sklearn-2.tar.gz")
    assert (await predict(server, "sklearn-2"))[0] == 404
    assert server.wlm.catalog.index.names_after(None, 10) == ["found", "sklearn-0", "sklearn-1"]
    assert server.wlm.catalog.index.scans == scans


async def test_a_listed_model_is_looked_up_where_it_unpacks(serve: Serve, tmp_path: Path) -> None:
    """The server fills the index when it starts; a model the index lists is looked up by the
    unpacking thread that then prepares its files (one hand-off), and a name it does not list
    (new to the store, or no model at all) apart, so that a 404 never waits for an unpacking
    thread."""
    root = make_linked_store(tmp_path / "store", 3)
    server = await serve(model_store=str(root))
    assert server.wlm.first_scan is not None
    await server.wlm.first_scan  # the scan begun at start: no other scan runs after it
    assert server.wlm.catalog.index.scans == 1 and "sklearn-1" in server.wlm.catalog.index
    store = server.wlm.store
    looked_up_in: dict[str, str] = {}
    find = store.find

    def recording_find(name: str) -> Any:
        looked_up_in[name] = threading.current_thread().name
        return find(name)

    store.find = recording_find  # type: ignore[method-assign]
    os.link(root / "sklearn-0.tar.gz", root / "late.tar.gz")
    assert await predict(server, "sklearn-1") == (200, pytest.approx(REFERENCE, abs=0.05))
    assert await predict(server, "late") == (200, pytest.approx(REFERENCE, abs=0.05))
    status, error = await predict(server, "missing")
    assert status == 404 and "model missing is not in the model store" in error["message"]
    assert looked_up_in["sklearn-1"].startswith("mmserver-unpack")
    assert not looked_up_in["late"].startswith("mmserver-unpack")
    assert not looked_up_in["missing"].startswith("mmserver-unpack")
    # Removed after the scan: its lookup, where it unpacks, finds nothing and unlists it.
    os.unlink(root / "sklearn-2.tar.gz")
    status, error = await predict(server, "sklearn-2")
    assert status == 404 and error["type"] == "ModelNotFoundException"
    assert looked_up_in["sklearn-2"].startswith("mmserver-unpack")
    assert "sklearn-2" not in server.wlm.catalog.index
    assert server.wlm.catalog.index.scans == 1
