"""Hostile archives, models and management calls: header bombs, huge error texts, worker counts
in the billions, slow archives beside look-ups and scrapes, symbolic links out of the store, and
the paths an error may show. Each is answered clearly and the other models keep serving."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from mmserver.config.server import ServerConfig
from mmserver.errors import MAX_MESSAGE, ConfigError
from mmserver.store.archive import MAX_HEADER_BYTES
from tests.integration.harness import Harness, Serve, error_of
from tests.models import make_custom_handler_dir, make_linear_archive, make_linear_model

SAFETY_S = 30.0


def _bomb(path: Path, kind: str) -> Path:
    """A small .tar.gz whose first member declares an extended header of 50 MB."""
    raw = io.BytesIO()
    fmt = tarfile.GNU_FORMAT if kind == "longname" else tarfile.PAX_FORMAT
    with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
        info = tarfile.TarInfo("x" * 50_000_000 if kind == "longname" else "model.joblib")
        if kind == "pax":
            info.pax_headers = {"comment": "y" * 50_000_000}
        tar.addfile(info, io.BytesIO(b""))
    import gzip

    path.write_bytes(gzip.compress(raw.getvalue(), 9))
    return path


async def _ok(harness: Harness, name: str = "sklearn-1") -> None:
    response = await harness.post(f"/predictions/{name}", "[[0.5]]")
    assert response.status == 200, await response.text()


@pytest.mark.parametrize("kind", ["longname", "pax"])
async def test_an_archive_declaring_a_huge_header_is_refused_before_it_is_read(
    serve: Serve, tmp_path: Path, kind: str
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    bomb = _bomb(store / "bomb.tar.gz", kind)
    assert bomb.stat().st_size < 200_000
    make_linear_archive(store / "sklearn-1.tar.gz")
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/bomb", "[[0.5]]")
    assert response.status == 500
    body = await error_of(response)
    assert body["type"] == "MalformedModelException"
    assert "model bomb: archive bomb.tar.gz" in body["message"]
    assert f"over the limit of {MAX_HEADER_BYTES}" in body["message"]
    assert len(await response.read()) < 1024
    await _ok(harness)


async def test_error_texts_are_bounded_and_member_names_shortened(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("../" + "z" * 60_000), io.BytesIO(b""))
    (store / "escape.tar.gz").write_bytes(raw.getvalue())
    noisy = make_custom_handler_dir(store / "noisy")
    (noisy / "model.py").write_text(
        "def load(model_dir, properties):\n    return None\n\n"
        "def predict(model, batch):\n    raise ValueError('v' * 1_000_000)\n"
    )
    make_linear_archive(store / "sklearn-1.tar.gz")
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/escape", "[[0.5]]")
    body = await error_of(response)
    assert response.status == 500 and "leaves the archive" in body["message"]
    assert "60003 characters" in body["message"] and len(body["message"]) < 600
    response = await harness.post("/predictions/noisy", "[[0.5]]")
    assert response.status == 424
    assert len(await response.read()) < 3 * MAX_MESSAGE  # message and OriginalMessage
    body = await error_of(response)
    assert "shortened" in body["message"]
    await _ok(harness)


async def test_worker_counts_are_capped_with_a_clear_refusal(serve: Serve, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    make_linear_archive(store / "sklearn-1.tar.gz")
    greedy = make_linear_model(store / "greedy")
    (greedy / "serving.properties").write_text("minWorkers=1\nmaxWorkers=1000000\n")
    harness = await serve(model_store=str(store))
    limit = harness.config.worker_limit
    for query in ("min_worker=1000000000&max_worker=1000000000", f"max_worker={limit + 1}"):
        response = await harness.client.put(f"/models/sklearn-1?{query}")
        assert response.status == 400
        body = await error_of(response)
        assert f"over the limit of {limit} workers per model" in body["message"]
    response = await harness.client.put(f"/models/sklearn-1?max_worker={limit}")
    assert response.status == 200, await response.text()
    response = await harness.post("/predictions/greedy", "[[0.5]]")
    assert response.status == 500
    assert "maxWorkers=1000000 is over the limit" in (await error_of(response))["message"]
    await _ok(harness)
    with pytest.raises(ConfigError, match="over the limit"):
        ServerConfig(max_workers=10**9)


async def test_slow_archives_do_not_hold_up_look_ups_or_scrapes(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for i in range(12):
        make_linear_archive(store / f"sklearn-{i}.tar.gz")
    harness = await serve(model_store=str(store))
    release = threading.Event()
    entered = threading.Semaphore(0)
    prepare = harness.wlm.store.prepare

    def slow_prepare(entry: Any) -> Path:
        if entry.name != "sklearn-0":
            entered.release()
            assert release.wait(SAFETY_S)
        return prepare(entry)

    harness.wlm.store.prepare = slow_prepare  # type: ignore[method-assign]
    await _ok(harness, "sklearn-0")
    loads = [
        asyncio.ensure_future(harness.post(f"/predictions/sklearn-{i}", "[[0.5]]"))
        for i in range(1, 12)
    ]
    for _ in range(4):  # every unpacking thread holds a slow archive; the rest wait
        assert await asyncio.to_thread(entered.acquire, True, SAFETY_S)
    try:
        assert (await harness.client.get("/metrics")).status == 200
        assert (await harness.post("/predictions/no-such-model", "[[0.5]]")).status == 404
        assert (await harness.client.get("/models")).status == 200
        await _ok(harness, "sklearn-0")
    finally:
        release.set()
    for response in await asyncio.gather(*loads):
        assert response.status == 200


async def test_a_store_entry_linking_out_of_the_store_follows_the_model_roots_rule(
    serve: Serve, tmp_path: Path
) -> None:
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    make_linear_archive(store / "sklearn-1.tar.gz")
    make_linear_model(elsewhere / "outside")
    (store / "linked").symlink_to(elsewhere / "outside")
    make_linear_model(store / "inside-target")
    (store / "linked-inside").symlink_to(store / "inside-target")

    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/linked", "[[0.5]]")
    assert response.status == 403
    assert "allowed_model_roots" in (await error_of(response))["message"]
    listed = await (await harness.client.get("/models?limit=100")).json()
    names = {m["modelName"] for m in listed["models"]}
    assert "linked" not in names and "linked-inside" in names
    await _ok(harness, "linked-inside")
    # POST /models of the same path is refused the same way.
    response = await harness.client.post(f"/models?url={elsewhere / 'outside'}&model_name=o")
    assert response.status == 403

    allowed = await serve(model_store=str(store), allowed_model_roots=f"{store},{elsewhere}")
    await _ok(allowed, "linked")


async def test_error_bodies_name_the_model_and_its_files_not_the_servers_folders(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    reads = make_custom_handler_dir(store / "reads-a-file")  # its load() quotes a full path
    (reads / "model.py").write_text(
        "from pathlib import Path\n\n"
        "def load(model_dir, properties):\n    return open(Path(model_dir) / 'missing.csv')\n\n"
        "def predict(model, batch):\n    return batch\n"
    )
    (store / "cut.tar.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 20)
    harness = await serve(model_store=str(store))
    texts = {}
    for name in ("reads-a-file", "cut"):
        response = await harness.post(f"/predictions/{name}", "[[0.5]]")
        assert response.status == 500
        texts[name] = json.dumps(await error_of(response))
        assert str(tmp_path) not in texts[name] and f"model {name}" in texts[name]
    assert "'reads-a-file/missing.csv'" in texts["reads-a-file"]  # the file, from the store


async def test_a_bad_serving_properties_fails_the_load_alike_on_every_path(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for name in ("bad-a", "bad-b"):
        folder = make_linear_model(store / name)
        (folder / "serving.properties").write_text("batch_size=many\n")
    harness = await serve(model_store=str(store))
    answers = [
        await harness.client.post(f"/models?url={store / 'bad-a'}"),
        await harness.post("/predictions/bad-b", "[[0.5]]"),
    ]
    for response in answers:
        assert response.status == 500
        body = await error_of(response)
        assert body["type"] == "IllegalConfigurationException"
        assert "batch_size='many' is not a valid integer" in body["message"]
