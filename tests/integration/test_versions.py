"""Models with versions: a model folder holding ``1/``, ``2.tar.gz``...; every way a request
names a version, the default version, each version loaded on its own, and the switch of the
default through the management API (warm first, surviving a restart, refused for a version
that fails to load).

Each version is a custom handler answering a number from its ``serving.properties``
(``option.reply``) plus its model folder's (``option.base``, inherited), so an answer tells
which version gave it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mmserver.api.protocols import ROUTING_KEY
from mmserver.policy.rollout import canary_bucket, shadow_bucket
from tests.integration.harness import Harness, Serve, ServerLikeTestServer, error_of, wait_until
from tests.integration.s3server import s3_environment
from tests.integration.test_objectstore import serving, tar_gz

HANDLER = """\
def load(model_dir, properties):
    return float(properties.get("option.base", "0")) + float(properties["option.reply"])


def predict(model, batch):
    return [model for _ in batch]
"""

FAILING_HANDLER = """\
def load(model_dir, properties):
    raise RuntimeError("version 3 cannot load")


def predict(model, batch):
    return [0.0 for _ in batch]
"""

TARGET = "X-Amzn-SageMaker-Target-Model"


def write_version(folder: Path, answer: int, handler: str = HANDLER) -> None:
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(handler)
    (folder / "serving.properties").write_text(f"option.reply={answer}\n")


def version_archive(answer: int) -> bytes:
    """The version as a ``.tar.gz`` with its files at the root."""
    return tar_gz(
        {"model.py": HANDLER.encode(), "serving.properties": f"option.reply={answer}".encode()}
    )


def write_archive(path: Path, answer: int) -> None:
    path.write_bytes(version_archive(answer))


def make_versioned_store(root: Path, *, default: int | None = None) -> Path:
    """``versioned/``: version 1 a folder, version 2 an archive, both inheriting
    ``option.base=10``; version 3 fails to load. ``plain/``: a model without versions."""
    model = root / "versioned"
    write_version(model / "1", 1)
    model.mkdir(exist_ok=True)
    write_archive(model / "2.tar.gz", 2)
    properties = "option.base=10\n"
    if default is not None:
        properties += f"option.default_version={default}\n"
    (model / "serving.properties").write_text(properties)
    write_version(root / "plain", 5)
    return root


async def predict(harness: Harness, path: str, **headers: str) -> Any:
    response = await harness.post(path, "[[0.5]]", **headers)
    assert response.status == 200, await response.text()
    return json.loads(await response.read())


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return make_versioned_store(tmp_path / "store")


async def test_every_form_of_address_reaches_its_version(serve: Serve, store: Path) -> None:
    harness = await serve(model_store=str(store))
    # Without a version: the highest.
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    # DJL's path, V2's path, SageMaker's TargetModel as a path.
    assert (await predict(harness, "/predictions/versioned/1"))["predictions"] == [11.0]
    assert (await predict(harness, "/predictions/versioned/2"))["predictions"] == [12.0]
    answer = await predict(harness, "/invocations", **{TARGET: "versioned/1.tar.gz"})
    assert answer["predictions"] == [11.0]
    v2 = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]})
    response = await harness.post("/v2/models/versioned/versions/1/infer", v2)
    assert response.status == 200, await response.text()
    body = await response.json()
    assert (body["model_name"], body["model_version"]) == ("versioned", "1")
    assert body["outputs"][0]["data"] == [11.0]
    # Each version is loaded on its own, under its key; the listing shows the model with its
    # default version's status.
    assert sorted(harness.wlm.room.loaded) == ["versioned/1", "versioned/2"]
    listed = (await (await harness.client.get("/models")).json())["models"]
    assert [(m["modelName"], m["status"]) for m in listed] == [
        ("plain", "UNLOADED"),
        ("versioned", "READY"),
    ]
    response = await harness.client.post("/v2/repository/index", json={})
    assert [(m["name"], m["version"], m["state"]) for m in await response.json()] == [
        ("plain", "1", "UNAVAILABLE"),
        ("versioned", "1", "READY"),
        ("versioned", "2", "READY"),
    ]
    samples = await harness.samples()
    for key, count in (("versioned/1", 3), ("versioned/2", 2)):
        labels = (("code", "200"), ("model", key))
        assert samples[("mmserver_requests_total", labels)] == count


async def test_a_version_the_model_does_not_have_is_404(serve: Serve, store: Path) -> None:
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/versioned/3", "[[0.5]]")
    assert response.status == 404
    message = (await error_of(response))["message"]
    assert message.startswith("model versioned has no version 3; its versions are 1, 2")
    # A model without versions has one, 1 (V2's), which is the model itself.
    assert (await predict(harness, "/predictions/plain/1"))["predictions"] == [5.0]
    response = await harness.post("/predictions/plain/2", "[[0.5]]")
    assert response.status == 404
    message = (await error_of(response))["message"]
    assert message.startswith("model plain has one version, 1; there is no version '2'")
    response = await harness.post("/predictions/versioned/x", "[[0.5]]")
    assert response.status == 404
    assert list(harness.wlm.room.loaded) == ["plain"]


async def test_serving_properties_names_the_default(serve: Serve, tmp_path: Path) -> None:
    store = make_versioned_store(tmp_path / "store", default=1)
    harness = await serve(model_store=str(store))
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [11.0]
    response = await harness.client.get("/models/versioned")
    assert response.status == 200
    workflows = await response.json()
    assert [(w["workflowName"], w["version"]) for w in workflows] == [
        ("versioned", "1"),
        ("versioned", "2"),
    ]
    first, second = (w["models"][0] for w in workflows)
    assert (first["isDefault"], first["defaultFrom"], first["status"]) == (
        True,
        "serving.properties",
        "Healthy",
    )
    assert (second["isDefault"], second["status"]) == (False, "UNLOADED")


async def test_a_bad_default_in_serving_properties_fails_with_the_key(
    serve: Serve, tmp_path: Path
) -> None:
    store = make_versioned_store(tmp_path / "store", default=7)
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/versioned", "[[0.5]]")
    assert response.status == 500
    message = (await error_of(response))["message"]
    assert "option.default_version='7' is not one of its versions (1, 2)" in message
    assert (await predict(harness, "/predictions/versioned/1"))["predictions"] == [11.0]


async def test_versions_unload_on_their_own(serve: Serve, store: Path) -> None:
    harness = await serve(model_store=str(store))
    await predict(harness, "/predictions/versioned/1")
    await predict(harness, "/predictions/versioned/2")
    response = await harness.client.delete("/models/versioned/1")
    assert response.status == 200
    assert list(harness.wlm.room.loaded) == ["versioned/2"]
    response = await harness.client.get("/models/versioned/1")
    [workflow] = await response.json()
    assert workflow["version"] == "1" and workflow["models"][0]["status"] == "UNLOADED"
    response = await harness.client.delete("/models/versioned")  # every loaded version
    assert response.status == 200
    assert list(harness.wlm.room.loaded) == []


async def test_the_default_switches_warm_and_survives_a_restart(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    options = {"model_store": str(store), "cache_dir": str(tmp_path / "cache")}
    harness = await serve(**options)
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    response = await harness.client.put("/models/versioned/1/set-default")
    assert response.status == 200, await response.text()
    assert (await response.json())["status"] == 'Default version of model "versioned" set to 1.'
    # Loaded before traffic moved: the next request loads nothing.
    assert "versioned/1" in harness.wlm.room.loaded
    loads = (await harness.samples())[("mmserver_model_loads_total", ())]
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [11.0]
    assert (await harness.samples())[("mmserver_model_loads_total", ())] == loads == 2
    response = await harness.client.get("/models/versioned/1")
    [workflow] = await response.json()
    assert workflow["models"][0]["defaultFrom"] == "management"
    # Rolled back, then forward again: each call answered once its version is loaded.
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    response = await harness.client.put("/models/versioned/1/set-default")
    assert response.status == 200
    saved = json.loads((tmp_path / "cache" / "rollouts.json").read_text())
    assert saved["models"]["versioned"]["default"] == 1

    restarted = await serve(**options)
    assert (await predict(restarted, "/predictions/versioned"))["predictions"] == [11.0]


async def test_a_version_that_fails_to_load_takes_no_traffic(serve: Serve, store: Path) -> None:
    write_version(store / "versioned" / "3", 3, FAILING_HANDLER)
    harness = await serve(model_store=str(store))
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    response = await harness.client.put("/models/versioned/3/set-default")
    assert response.status == 500
    message = (await error_of(response))["message"]
    assert "version 3 cannot load" in message
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    response = await harness.client.put("/models/versioned/9/set-default")
    assert response.status == 404
    assert "has no version 9; its versions are 1, 2, 3" in (await error_of(response))["message"]
    response = await harness.client.put("/models/plain/1/set-default")
    assert response.status == 404
    assert "model plain has no versions" in (await error_of(response))["message"]


async def test_a_version_added_to_the_store_is_found_on_its_first_request(
    serve: Serve, store: Path
) -> None:
    harness = await serve(model_store=str(store))
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    write_version(store / "versioned" / "4", 4)
    assert (await predict(harness, "/predictions/versioned/4"))["predictions"] == [14.0]
    # Read again, the versions have a new highest: the default, as no one named another.
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [14.0]
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    write_version(store / "versioned" / "5", 5)
    assert (await predict(harness, "/predictions/versioned/5"))["predictions"] == [15.0]
    # A default the management API named stays.
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]


async def test_versions_from_an_object_store(tmp_path: Path) -> None:
    with s3_environment(tmp_path / "aws", "models") as s3:
        client = s3.client()
        for key, data in (
            ("mme/versioned/1.tar.gz", version_archive(1)),
            ("mme/versioned/2.tar.gz", version_archive(2)),
            ("mme/versioned/serving.properties", b"option.base=10\noption.default_version=1\n"),
            ("mme/versioned/notes.txt", b"not a version"),
        ):
            client.put_object(Bucket="models", Key=key, Body=data)
        # The versions' model.py runs: the operator trusts the model by name.
        async with serving(
            tmp_path / "cache", "s3://models/mme", trusted_models="versioned"
        ) as server:
            async with TestClient(ServerLikeTestServer(server.app, host="127.0.0.1")) as http:
                for path, headers, expected in (
                    ("/predictions/versioned", {}, 11.0),
                    ("/predictions/versioned/2", {}, 12.0),
                    ("/invocations", {TARGET: "versioned/2.tar.gz"}, 12.0),
                ):
                    response = await http.post(path, json=[[0.5]], headers=headers)
                    assert response.status == 200, await response.text()
                    assert (await response.json())["predictions"] == [expected]
                response = await http.post("/predictions/versioned/3", json=[[0.5]])
                assert response.status == 404
                response = await http.put("/models/versioned/2/set-default")
                assert response.status == 200
                response = await http.post("/predictions/versioned", json=[[0.5]])
                assert (await response.json())["predictions"] == [12.0]
            assert sorted(server.wlm.room.loaded) == ["versioned/1", "versioned/2"]


# ------------------------------------------------------------------------------------------------
# Canary
# ------------------------------------------------------------------------------------------------

CALLERS = [f"caller-{i}" for i in range(1000)]


async def answers_by_key(harness: Harness, keys: list[str]) -> dict[str, float]:
    """The answer to one unversioned request per routing key."""
    answers = {}
    for key in keys:
        body = await predict(harness, "/predictions/versioned", **{ROUTING_KEY: key})
        answers[key] = body["predictions"][0]
    return answers


async def test_a_canary_takes_its_share_by_routing_key(serve: Serve, tmp_path: Path) -> None:
    store = make_versioned_store(tmp_path / "store")
    properties = store / "versioned" / "serving.properties"
    properties.write_text("option.base=10\noption.canary_version=1\noption.canary_percent=10\n")
    harness = await serve(model_store=str(store))
    answers = await answers_by_key(harness, CALLERS)
    to_canary = [key for key, answer in answers.items() if answer == 11.0]
    assert set(answers.values()) == {11.0, 12.0}
    # The keys the hash puts below 10 %: about a tenth of them.
    assert to_canary == [key for key in CALLERS if canary_bucket(key) < 10]
    assert 70 <= len(to_canary) <= 130
    # The same caller always sees the same version.
    assert await answers_by_key(harness, CALLERS[:100]) == {k: answers[k] for k in CALLERS[:100]}
    samples = await harness.samples()
    assert samples[("mmserver_requests_total", (("code", "200"), ("model", "versioned/1")))] == (
        len(to_canary) + sum(1 for k in CALLERS[:100] if k in to_canary)
    )
    response = await harness.client.get("/models/versioned/1")
    [workflow] = await response.json()
    model = workflow["models"][0]
    assert (model["canaryPercent"], model["canaryFrom"]) == (10.0, "serving.properties")


async def test_the_canary_is_set_warm_by_a_call_and_survives_a_restart(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    options = {"model_store": str(store), "cache_dir": str(tmp_path / "cache")}
    harness = await serve(**options)
    response = await harness.client.put("/models/versioned/1/set-canary", params={"percent": "50"})
    assert response.status == 200, await response.text()
    status = (await response.json())["status"]
    assert status == 'The canary of model "versioned" is version 1 at 50%.'
    assert "versioned/1" in harness.wlm.room.loaded  # loaded before any request went to it
    keyed = await answers_by_key(harness, CALLERS[:200])
    assert sorted(k for k, a in keyed.items() if a == 11.0) == sorted(
        k for k in CALLERS[:200] if canary_bucket(k) < 50
    )
    # Without a routing key, at random: both versions answer.
    unkeyed = {
        (await predict(harness, "/predictions/versioned"))["predictions"][0] for _ in range(100)
    }
    assert unkeyed == {11.0, 12.0}
    saved = json.loads((tmp_path / "cache" / "rollouts.json").read_text())
    assert saved["models"]["versioned"] == {"default": None, "canary": [1, 50.0], "shadow": None}

    restarted = await serve(**options)
    assert await answers_by_key(restarted, CALLERS[:200]) == keyed
    response = await restarted.client.put("/models/versioned/1/set-canary?percent=0")
    assert response.status == 200
    assert (await response.json())["status"] == 'The canary of model "versioned" ended.'
    assert set((await answers_by_key(restarted, CALLERS[:50])).values()) == {12.0}


async def test_a_canary_that_fails_to_load_takes_no_traffic(serve: Serve, store: Path) -> None:
    write_version(store / "versioned" / "3", 3, FAILING_HANDLER)
    harness = await serve(model_store=str(store))
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    response = await harness.client.put("/models/versioned/3/set-canary?percent=50")
    assert response.status == 500
    assert "version 3 cannot load" in (await error_of(response))["message"]
    assert set((await answers_by_key(harness, CALLERS[:50])).values()) == {12.0}
    for bad in ("101", "-1", "x", "nan"):
        response = await harness.client.put(f"/models/versioned/2/set-canary?percent={bad}")
        assert response.status == 400
        message = (await error_of(response))["message"]
        assert message.startswith(f"parameter percent='{bad}' must be a number from 0 to 100")
    response = await harness.client.put("/models/versioned/2/set-canary")
    assert response.status == 400


# ------------------------------------------------------------------------------------------------
# Shadow
# ------------------------------------------------------------------------------------------------

GATED_HANDLER = """\
from tests.integration import gate


def load(model_dir, properties):
    return float(properties.get("option.base", "0")) + float(properties["option.reply"])


def predict(model, batch):
    gate.current.pass_through()
    return [model for _ in batch]
"""

RAISING_HANDLER = """\
def load(model_dir, properties):
    return 0.0


def predict(model, batch):
    raise ValueError("the shadow cannot answer")
"""


async def comparisons(harness: Harness) -> dict[str, float]:
    samples = await harness.samples()
    return {
        dict(labels)["result"]: count
        for (name, labels), count in samples.items()
        if name == "mmserver_shadow_comparisons_total" and dict(labels)["model"] == "versioned"
    }


async def test_a_shadow_blocked_at_a_gate_neither_delays_nor_changes_an_answer(
    serve: Serve, store: Path, gate: Any
) -> None:
    write_version(store / "versioned" / "3", 3, GATED_HANDLER)
    harness = await serve(model_store=str(store))
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    response = await harness.client.put("/models/versioned/3/set-shadow?percent=100")
    assert response.status == 200, await response.text()
    assert (await response.json())["status"] == (
        'The shadow of model "versioned" is version 3 at 100%.'
    )
    # The first answer comes back; its shadow run then waits at the gate.
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    assert await asyncio.to_thread(gate.wait_entered)
    # While it is held there, the primary answers every request; their shadow runs find no
    # spare capacity (the one shadow run the in-process backend allows is held) and are skipped.
    for _ in range(5):
        assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    assert gate.passed == 0
    await wait_until(lambda: (harness.wlm.shadows.pending + harness.wlm.shadows.running) == 1)
    assert await comparisons(harness) == {"skipped": 5.0}
    gate.open()
    await wait_until(lambda: (harness.wlm.shadows.pending + harness.wlm.shadows.running) == 0)
    assert await comparisons(harness) == {"skipped": 5.0, "different": 1.0}


async def test_comparisons_count_same_different_and_error(serve: Serve, store: Path) -> None:
    write_version(store / "versioned" / "3", 2)  # answers as version 2 does
    write_version(store / "versioned" / "4", 3)
    write_version(store / "versioned" / "5", 0, RAISING_HANDLER)
    harness = await serve(model_store=str(store))
    response = await harness.client.put("/models/versioned/2/set-default")
    assert response.status == 200
    for shadow, result in (("3", "same"), ("4", "different"), ("5", "error")):
        path = f"/models/versioned/{shadow}/set-shadow?percent=100"
        assert (await harness.client.put(path)).status == 200
        for _ in range(3):  # one at a time: none finds the one shadow run's place taken
            assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
            await wait_until(
                lambda: (harness.wlm.shadows.pending + harness.wlm.shadows.running) == 0
            )
        assert (await comparisons(harness))[result] == 3.0
    # Requests naming a version have no shadow; a share of 0 ends the shadow.
    assert (await predict(harness, "/predictions/versioned/2"))["predictions"] == [12.0]
    response = await harness.client.put("/models/versioned/5/set-shadow?percent=0")
    assert (await response.json())["status"] == 'The shadow of model "versioned" ended.'
    assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    assert await comparisons(harness) == {"same": 3.0, "different": 3.0, "error": 3.0}


async def test_a_shadow_share_is_taken_by_routing_key(serve: Serve, tmp_path: Path) -> None:
    store = make_versioned_store(tmp_path / "store")
    write_version(store / "versioned" / "3", 3)
    (store / "versioned" / "serving.properties").write_text(
        "option.base=10\noption.default_version=2\noption.shadow_version=3\n"
        "option.shadow_percent=20\n"
    )
    harness = await serve(model_store=str(store))
    keys = CALLERS[:300]
    answers = await answers_by_key(harness, keys)
    assert set(answers.values()) == {12.0}
    await wait_until(lambda: (harness.wlm.shadows.pending + harness.wlm.shadows.running) == 0)
    expected = sum(1 for key in keys if shadow_bucket(key) < 20)
    assert 30 <= expected <= 90
    # Each taken request ran on the shadow, or was skipped while the one before still ran.
    counted = await comparisons(harness)
    assert set(counted) <= {"different", "skipped"} and counted.get("different", 0) > 0
    assert sum(counted.values()) == expected
