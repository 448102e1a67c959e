"""The management API over real HTTP: list and pagination over the 1,000-model store, describe,
register, rescale, unload."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import STORE_COUNT, Harness, Serve, describe, error_of, wait_until


async def names_listed(harness: Harness) -> set[str]:
    names: set[str] = set()
    token = ""
    while True:
        response = await harness.client.get("/models", params={"next_page_token": token})
        body = await response.json()
        names.update(m["modelName"] for m in body["models"])
        if "nextPageToken" not in body:
            return names
        token = body["nextPageToken"]


# ------------------------------------------------------------------------------------------------
# GET /models
# ------------------------------------------------------------------------------------------------


async def test_list_pages_through_every_model(server: Harness, store_names: list[str]) -> None:
    assert len(store_names) > STORE_COUNT
    seen: list[str] = []
    token: str | None = None
    pages = 0
    while True:
        params = {"limit": "100"} if token is None else {"next_page_token": token}
        response = await server.client.get("/models", params=params)
        assert response.status == 200
        body = await response.json()
        page = body["models"]
        assert 1 <= len(page) <= 100
        for model in page:
            assert set(model) == {"modelName", "modelUrl", "status"}
            assert model["status"] == "UNLOADED"
            assert Path(model["modelUrl"]).name.removesuffix(".tar.gz") == model["modelName"]
        seen.extend(m["modelName"] for m in page)
        pages += 1
        if "nextPageToken" not in body:
            assert set(body) == {"models"}
            break
        assert set(body) == {"models", "nextPageToken"}
        assert len(page) == 100
        token = body["nextPageToken"]
    assert seen == store_names
    assert pages == -(-len(store_names) // 100)


@pytest.mark.parametrize(("limit", "size"), [("7", 7), ("1", 1), ("100", 100), ("5000", 100)])
async def test_list_limit(server: Harness, store_names: list[str], limit: str, size: int) -> None:
    response = await server.client.get("/models", params={"limit": limit})
    body = await response.json()
    assert [m["modelName"] for m in body["models"]] == store_names[:size]
    assert body["nextPageToken"] == store_names[size - 1]

    response = await server.client.get(
        "/models", params={"limit": limit, "next_page_token": body["nextPageToken"]}
    )
    body = await response.json()
    assert [m["modelName"] for m in body["models"]] == store_names[size : 2 * size]


async def test_list_last_page_has_no_token(server: Harness, store_names: list[str]) -> None:
    response = await server.client.get(
        "/models", params={"limit": "3", "next_page_token": store_names[-3]}
    )
    body = await response.json()
    assert body == {"models": body["models"]}
    assert [m["modelName"] for m in body["models"]] == store_names[-2:]


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        ("0", "parameter limit=0 must be between 1 and 100"),
        ("-5", "parameter limit=-5 must be between 1 and 100"),
        ("ten", "parameter limit must be an integer, got 'ten'"),
        ("1.5", "parameter limit must be an integer, got '1.5'"),
    ],
)
async def test_list_bad_limit(server: Harness, limit: str, message: str) -> None:
    response = await server.client.get("/models", params={"limit": limit})
    assert response.status == 400
    body = await error_of(response)
    assert body["type"] == "BadRequestException"
    assert body["message"].startswith(message)


async def test_list_shows_loaded_models(server: Harness) -> None:
    assert (await server.post("/predictions/sklearn-10", "[[0.5]]")).status == 200
    response = await server.client.get(
        "/models", params={"limit": "2", "next_page_token": "sklearn-1"}
    )
    models = (await response.json())["models"]
    assert [(m["modelName"], m["status"]) for m in models] == [
        ("sklearn-10", "READY"),
        ("sklearn-100", "UNLOADED"),
    ]


# ------------------------------------------------------------------------------------------------
# GET /models/{model}
# ------------------------------------------------------------------------------------------------


async def test_describe_unloaded_and_loaded(server: Harness) -> None:
    before = await describe(server, "sklearn-20")
    assert before["modelName"] == "sklearn-20"
    assert before["status"] == "UNLOADED"
    assert before["workerGroups"][0]["workers"] == []

    assert (await server.post("/predictions/sklearn-20", "[[0.5]]")).status == 200
    after = await describe(server, "sklearn-20.tar.gz")
    assert after["modelName"] == "sklearn-20"
    assert after["status"] == "Healthy"
    assert after["batchSize"] == 32
    assert after["maxBatchDelayMillis"] == 0
    assert after["maxIdleSeconds"] == 60
    assert after["queueSize"] == 1000
    assert after["requestInQueue"] == 0
    group = after["workerGroups"][0]
    assert (group["minWorkers"], group["maxWorkers"]) == (1, 2)
    assert len(group["workers"]) == 1
    assert {"id", "startTime", "status"} <= set(group["workers"][0])


async def test_describe_tuned_model_shows_its_properties(server: Harness) -> None:
    assert (await server.post("/predictions/tuned-linear", "[[0.5]]")).status == 200
    tuned = await describe(server, "tuned-linear")
    assert tuned["batchSize"] == 8
    assert tuned["maxBatchDelayMillis"] == 5
    assert tuned["queueSize"] == 100
    assert tuned["workerGroups"][0]["maxWorkers"] == 2


async def test_describe_bad_name(server: Harness) -> None:
    response = await server.client.get("/models/..hidden")
    assert response.status == 400
    assert (await error_of(response))["type"] == "BadRequestException"


# ------------------------------------------------------------------------------------------------
# POST /models
# ------------------------------------------------------------------------------------------------


async def test_register_with_query_parameters(server: Harness, store_root: Path) -> None:
    response = await server.client.post(
        "/models",
        params={
            "url": "sklearn-5.tar.gz",
            "model_name": "registered-a",
            "batch_size": "4",
            "max_batch_delay": "7",
            "min_worker": "1",
            "max_worker": "1",
            "job_queue_size": "50",
        },
    )
    assert response.status == 200
    assert await response.json() == {"status": 'Model "registered-a" registered.'}
    info = await describe(server, "registered-a")
    assert info["status"] == "Healthy"
    assert info["modelUrl"] == "sklearn-5.tar.gz"
    assert (info["batchSize"], info["maxBatchDelayMillis"], info["queueSize"]) == (4, 7, 50)
    assert (info["workerGroups"][0]["minWorkers"], info["workerGroups"][0]["maxWorkers"]) == (1, 1)

    response = await server.post("/models/registered-a/invoke", "[[0.5]]")
    assert response.status == 200
    assert (await response.json())["predictions"] == [pytest.approx(2.0, abs=0.05)]
    assert "registered-a" in await names_listed(server)

    response = await server.client.post(
        "/models", params={"url": "sklearn-6.tar.gz", "model_name": "registered-a"}
    )
    assert response.status == 409
    body = await error_of(response)
    assert body["type"] == "BadRequestException"
    assert "registered-a" in body["message"]


async def test_register_sagemaker_json_body(server: Harness, store_root: Path) -> None:
    response = await server.client.post(
        "/models",
        json={
            "model_name": "from-sagemaker",
            "url": str(store_root / "custom-handler"),
            "trusted": "true",  # its model.py runs: the operator says so
        },
    )
    assert response.status == 200
    assert await response.json() == {"status": 'Model "from-sagemaker" registered.'}
    response = await server.post("/models/from-sagemaker/invoke", "[[0.5]]")
    assert response.status == 200
    assert (await response.json())["predictions"][0]["value"] == pytest.approx(2.0, abs=0.05)


async def test_register_json_body_values_and_name_from_url(server: Harness) -> None:
    response = await server.client.post(
        "/models",
        json={"url": "pipeline-scaler", "batch_size": 2, "synchronous": True},
    )
    assert response.status == 200
    assert await response.json() == {"status": 'Model "pipeline_scaler" registered.'}
    assert (await describe(server, "pipeline_scaler"))["batchSize"] == 2


async def test_register_form_body(server: Harness) -> None:
    response = await server.client.post(
        "/models", data={"url": "sklearn-8.tar.gz", "model_name": "from-form"}
    )
    assert response.status == 200
    assert await response.json() == {"status": 'Model "from-form" registered.'}


async def test_register_asynchronously(server: Harness) -> None:
    response = await server.client.post(
        "/models",
        params={"url": "sklearn-9.tar.gz", "model_name": "later", "synchronous": "false"},
    )
    assert response.status == 202
    assert await response.json() == {"status": 'Model "later" registration scheduled.'}
    await wait_until(lambda: server.wlm.status("later").value == "READY")
    assert (await describe(server, "later"))["status"] == "Healthy"


BAD = "BadRequestException"  # DJL's type for a refused request, whatever its 4xx
ONE = {"url": "sklearn-1.tar.gz"}


@pytest.mark.parametrize(
    ("params", "status", "type_", "message"),
    [
        ({}, 400, BAD, "parameter 'url' is required"),
        ({"url": ""}, 400, BAD, "parameter 'url' is required"),
        ({"url": "no-such-dir"}, 404, "ModelNotFoundException", ""),
        ({"url": "/etc"}, 403, BAD, ""),
        ({"url": "../outside"}, 403, BAD, ""),
        ({"url": "http://example.com/model.tar.gz"}, 400, BAD, "scheme 'http'"),
        ({**ONE, "model_name": "bad name"}, 400, BAD, ""),
        ({**ONE, "batch_size": "x"}, 400, BAD, "batch_size must"),
        ({**ONE, "batch_size": "0"}, 400, BAD, "batch_size=0"),
        ({**ONE, "max_idle_time": "-1"}, 400, BAD, "max_idle_time=-1 must not be negative"),
        ({**ONE, "min_worker": "3", "max_worker": "2"}, 400, BAD, "min_worker=3 is greater"),
        ({**ONE, "min_worker": "5"}, 400, BAD, "minWorkers=5 is greater than maxWorkers=2"),
        ({**ONE, "synchronous": "maybe"}, 400, BAD, "synchronous must be true or false"),
        ({"url": "broken-model"}, 500, "EngineException", "model.joblib cannot be loaded"),
    ],
)
async def test_register_refused(
    server: Harness, params: dict[str, str], status: int, type_: str, message: str
) -> None:
    response = await server.client.post("/models", params=params)
    assert response.status == status
    body = await error_of(response)
    assert body["type"] == type_
    assert message in body["message"]
    assert "x-amzn-ErrorType" not in response.headers


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "the body must be a JSON object of parameters"),
        (b"[1, 2]", "the body must be a JSON object of parameters"),
        (b'{"url": 5}', "parameter 'url' is required"),
        (b'{"url": "sklearn-1.tar.gz", "model_name": 5}', "'model_name' must be a string"),
        (b'{"url": "sklearn-1.tar.gz", "batch_size": true}', "batch_size must be an integer"),
        (b'{"url": "sklearn-1.tar.gz", "synchronous": "yes please"}', "synchronous must be"),
    ],
)
async def test_register_bad_json_body(server: Harness, body: bytes, message: str) -> None:
    response = await server.post("/models", body)
    assert response.status == 400
    assert message in (await error_of(response))["message"]


# ------------------------------------------------------------------------------------------------
# PUT /models/{model}, DELETE /models/{model}
# ------------------------------------------------------------------------------------------------


async def test_rescale(server: Harness) -> None:
    response = await server.client.put(
        "/models/sklearn-30",
        params={"min_worker": "2", "max_worker": "2", "batch_size": "3", "max_batch_delay": "9"},
    )
    assert response.status == 200
    assert await response.json() == {
        "status": 'Workflow "sklearn-30" worker scaled. New Worker configuration '
        "min workers:2 max workers:2"
    }
    info = await describe(server, "sklearn-30")
    assert info["status"] == "Healthy"
    assert (info["batchSize"], info["maxBatchDelayMillis"]) == (3, 9)
    group = info["workerGroups"][0]
    assert (group["minWorkers"], group["maxWorkers"]) == (2, 2)
    assert len(group["workers"]) == 2
    assert (await server.post("/predictions/sklearn-30", "[[0.5]]")).status == 200


@pytest.mark.parametrize(
    ("params", "status", "message"),
    [
        ({"min_worker": "3", "max_worker": "1"}, 400, "min_worker=3 is greater than max_worker=1"),
        ({"min_worker": "5"}, 400, "minWorkers=5 is greater than maxWorkers=2"),
        ({"max_worker": "-1"}, 400, "max_worker=-1 must not be negative"),
        ({"batch_size": "many"}, 400, "batch_size must be an integer, got 'many'"),
    ],
)
async def test_rescale_refused(
    server: Harness, params: dict[str, str], status: int, message: str
) -> None:
    response = await server.client.put("/models/sklearn-31", params=params)
    assert response.status == status
    body = await error_of(response)
    assert body["type"] == "BadRequestException"
    assert message in body["message"]


async def test_a_pinned_model_outlives_churn_until_it_is_unpinned(serve: Serve) -> None:
    server = await serve(max_loaded_models=3, pinned_models="sklearn-9")
    assert (await describe(server, "sklearn-9"))["pinned"] is True  # the option's, at start
    response = await server.client.put("/models/sklearn-50", params={"pinned": "true"})
    assert response.status == 200
    assert await response.json() == {"status": 'Model "sklearn-50" pinned', "pinned": True}
    info = await describe(server, "sklearn-50")
    assert (info["status"], info["pinned"]) == ("Healthy", True)
    for i in range(60, 70):  # one place left for the others: each load evicts the one before
        assert (await server.post(f"/predictions/sklearn-{i}", "[[0.5]]")).status == 200
    loaded = server.wlm.room.loaded
    assert list(loaded) == ["sklearn-9", "sklearn-50", "sklearn-69"]
    # A pin with a setting: both apply.
    both = await server.client.put("/models/sklearn-50", params={"pinned": "1", "max_worker": "1"})
    assert both.status == 200
    assert (await both.json())["pinned"] is True
    # The option's pin is the operator's: a call does not undo it.
    refused = await server.client.put("/models/sklearn-9", params={"pinned": "false"})
    assert refused.status == 400
    assert (
        "model sklearn-9 is pinned by option pinned_models=sklearn-9"
        in (await error_of(refused))["message"]
    )
    # Three pins fit max_loaded_models=3; a fourth does not, and is refused before it loads.
    assert (await server.client.put("/models/sklearn-69", params={"pinned": "true"})).status == 200
    too_many = await server.client.put("/models/sklearn-70", params={"pinned": "true"})
    assert too_many.status == 507
    assert "sklearn-70" not in loaded
    assert (
        "model sklearn-70 cannot be pinned: 4 pinned models would pass max_loaded_models=3"
        in (await error_of(too_many))["message"]
    )
    bad = await server.client.put("/models/sklearn-50", params={"pinned": "maybe"})
    assert bad.status == 400
    assert "parameter pinned must be true or false, got 'maybe'" in (await error_of(bad))["message"]
    unpinned = await server.client.put("/models/sklearn-50", params={"pinned": "false"})
    assert await unpinned.json() == {"status": 'Model "sklearn-50" unpinned', "pinned": False}
    assert (await describe(server, "sklearn-50"))["pinned"] is False


async def test_rescale_and_unload_unknown_model(server: Harness) -> None:
    response = await server.client.put("/models/ghost", params={"max_worker": "1"})
    assert response.status == 404
    assert (await error_of(response))["type"] == "ModelNotFoundException"
    response = await server.client.delete("/models/ghost")
    assert response.status == 404
    assert (await error_of(response))["type"] == "ModelNotFoundException"


async def test_unload_then_load_again(server: Harness) -> None:
    assert (await server.post("/predictions/sklearn-40", "[[0.5]]")).status == 200
    response = await server.client.delete("/models/sklearn-40.tar.gz")
    assert response.status == 200
    assert await response.json() == {"status": 'Model or workflow "sklearn-40" unregistered'}
    assert (await describe(server, "sklearn-40"))["status"] == "UNLOADED"
    assert (await server.post("/predictions/sklearn-40", "[[0.5]]")).status == 200
    assert (await describe(server, "sklearn-40"))["status"] == "Healthy"


async def test_unload_registered_model_forgets_it(server: Harness) -> None:
    response = await server.client.post(
        "/models", params={"url": "sklearn-41.tar.gz", "model_name": "temporary"}
    )
    assert response.status == 200
    assert (await server.client.delete("/models/temporary")).status == 200
    assert "temporary" not in await names_listed(server)
    response = await server.post("/predictions/temporary", "[[0.5]]")
    assert response.status == 404


async def test_register_and_rescale_are_refused_once_the_server_is_stopping(
    server: Harness,
) -> None:
    """Once the server is stopping, no management call starts a load (it would outlive the
    stop's bookkeeping)."""
    server.wlm.begin_shutdown()
    response = await server.client.post("/models", params={"url": "sklearn-1.tar.gz"})
    assert response.status == 503
    assert "shutting down" in (await error_of(response))["message"]
    response = await server.client.put("/models/sklearn-30", params={"max_worker": "2"})
    assert response.status == 503
    assert "shutting down" in (await error_of(response))["message"]
    assert server.wlm.room.loaded.get("sklearn-1") is None
    assert server.wlm.room.loaded.get("sklearn-30") is None
