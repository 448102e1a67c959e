"""The Open Inference Protocol (KServe V2 REST) over real HTTP: health, metadata, inference,
the model repository extension, its errors, and its place in the queues and metrics."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientResponse

from tests.integration.harness import Harness, Serve, error_of, wait_until

X = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]


def infer_body(
    values: Any, shape: list[int], datatype: str = "FP64", **extra: Any
) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "shape": shape, "datatype": datatype, "data": values}],
        **extra,
    }


async def v2_error(response: ClientResponse, status: int) -> str:
    """The protocol's error body, ``{"error": message}``, with the server's request id."""
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    body = json.loads(await response.read())
    assert set(body) == {"error"}
    assert body["error"].endswith(f" (request id {response.headers['X-Request-Id']})")
    message: str = body["error"]
    return message


async def test_health_live_stays_200_while_draining_and_ready_goes_503(server: Harness) -> None:
    client = server.client
    # JSON bodies, as KServe's own server answers (its Python client reads them).
    for path, body in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True})):
        response = await client.get(path)
        assert response.status == 200 and await response.json() == body
    server.wlm.begin_shutdown()
    live = await client.get("/v2/health/live")
    assert live.status == 200 and await live.json() == {"live": True}
    ready = await client.get("/v2/health/ready")
    assert ready.status == 503 and await ready.json() == {"ready": False}
    response = await client.post("/v2/models/sklearn-0/infer", json=infer_body([0.5], [1]))
    assert "shutting down" in await v2_error(response, 503)


async def test_model_ready_follows_the_model_s_status(server: Harness) -> None:
    client = server.client
    message = await v2_error(await client.get("/v2/models/sklearn-4/ready"), 400)
    assert message.startswith("model sklearn-4 is not ready: it is unloaded; it loads on its first")
    response = await client.post("/v2/models/sklearn-4/infer", json=infer_body([0.5], [1]))
    assert response.status == 200
    ready = await client.get("/v2/models/sklearn-4/ready")
    assert ready.status == 200 and await ready.json() == {"name": "sklearn-4", "ready": True}
    assert (await client.get("/v2/models/sklearn-4.tar.gz/versions/1/ready")).status == 200
    assert "has one version, 1; there is no version '2'" in await v2_error(
        await client.get("/v2/models/sklearn-4/versions/2/ready"), 404
    )
    assert "not in the store nor registered" in await v2_error(
        await client.get("/v2/models/no-such-model/ready"), 404
    )
    await v2_error(await client.get("/v2/models/.hidden/ready"), 400)
    # A model whose load failed says why.
    await client.post("/v2/models/broken-model/infer", json=infer_body([0.5], [1]))
    message = await v2_error(await client.get("/v2/models/broken-model/ready"), 400)
    assert "is not ready: it is failed (model broken-model failed to load:" in message


async def test_server_and_model_metadata(server: Harness) -> None:
    response = await server.client.get("/v2")
    assert await response.json() == {
        "name": "mmserver",
        "version": "0.1.0",
        "extensions": ["binary_tensor_data", "model_repository"],
    }
    response = await server.client.get("/v2/models/iris-classifier/versions/1")
    assert response.status == 200
    assert await response.json() == {
        "name": "iris-classifier",
        "versions": ["1"],
        "platform": "sklearn",
        "inputs": [{"name": "input-0", "datatype": "FP64", "shape": [-1, 4]}],
        "outputs": [
            {"name": "predict_proba", "datatype": "FP64", "shape": [-1, 3]},
            {"name": "predict", "datatype": "INT64", "shape": [-1]},
            {"name": "decision_function", "datatype": "FP64", "shape": [-1, 3]},
        ],
    }
    assert server.wlm.status("iris-classifier").value == "READY"  # metadata loads the model


async def test_infer_with_json_tensors_answers_as_the_djl_path(server: Harness) -> None:
    djl = await server.post("/predictions/pipeline-scaler", "[[1, 1, 1], [1, 0, 0]]")
    expected = (await djl.json())["predictions"]
    body = infer_body([1, 1, 1, 1, 0, 0], [2, 3], "INT32", id="req-7")
    for path in ("/v2/models/pipeline-scaler/infer", "/v2/models/pipeline-scaler/versions/1/infer"):
        response = await server.client.post(path, json=body)
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/json"
        assert "Inference-Header-Content-Length" not in response.headers
        assert await response.json() == {
            "model_name": "pipeline-scaler",
            "model_version": "1",
            "id": "req-7",
            "outputs": [{"name": "predict", "datatype": "FP64", "shape": [2], "data": expected}],
        }


async def test_a_classifier_answers_the_outputs_asked_for(server: Harness) -> None:
    body = infer_body(X, [2, 4], outputs=[{"name": "predict"}, {"name": "predict_proba"}])
    response = await server.client.post("/v2/models/iris-classifier/infer", json=body)
    outputs = {o["name"]: o for o in (await response.json())["outputs"]}
    assert outputs["predict"]["data"] == [0, 2] and outputs["predict"]["datatype"] == "INT64"
    probabilities = np.array(outputs["predict_proba"]["data"]).reshape(2, 3)
    assert outputs["predict_proba"]["shape"] == [2, 3]
    assert probabilities.sum(axis=1) == pytest.approx([1.0, 1.0])
    assert probabilities.argmax(axis=1).tolist() == [0, 2]


async def test_binary_tensors_in_and_out(server: Harness) -> None:
    x = np.array(X, dtype=np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [2, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    response = await server.post(
        "/v2/models/iris-classifier/infer",
        header + x.tobytes(),
        "application/octet-stream",
        **{"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/octet-stream"
    length = int(response.headers["Inference-Header-Content-Length"])
    raw = await response.read()
    answer = json.loads(raw[:length])
    assert answer["outputs"] == [
        {
            "name": "predict_proba",
            "datatype": "FP64",
            "shape": [2, 3],
            "parameters": {"binary_data_size": 48},
        }
    ]
    probabilities = np.frombuffer(raw[length:], "<f8").reshape(2, 3)
    assert probabilities.argmax(axis=1).tolist() == [0, 2]


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        (infer_body(X, [2, 4], "BYTES"), {}, "has datatype BYTES; the model takes numbers"),
        (infer_body(X, [4, 4]), {}, "has shape [4, 4], 16 value(s), but its data has 8"),
        (
            infer_body(X, [2, 4], outputs=[{"name": "label"}]),
            {},
            "the model has no output 'label'; its outputs are predict_proba, predict",
        ),
        (
            infer_body([[1.0, 2.0]], [1, 2]),
            {},
            "model iris-classifier expects 4 feature(s) per row, got 2",
        ),
        (
            infer_body(X, [2, 4]),
            {"Inference-Header-Content-Length": "100000"},
            "Inference-Header-Content-Length is 100000 but the body has only",
        ),
        ("{not json", {}, "the body must be the JSON inference request; it is not valid JSON"),
    ],
)
async def test_bad_requests_are_400_with_the_protocol_s_error(
    server: Harness, body: Any, headers: dict[str, str], expected: str
) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    response = await server.post("/v2/models/iris-classifier/infer", data, **headers)
    assert expected in await v2_error(response, 400)
    samples = await server.samples()
    label = "iris-classifier" if "Header" not in expected else "-"
    assert samples[("mmserver_requests_total", (("code", "400"), ("model", label)))] == 1.0


async def test_unknown_models_versions_and_paths(server: Harness) -> None:
    client = server.client
    response = await client.post("/v2/models/no-such-model/infer", json=infer_body([1], [1]))
    assert "is not in the model store" in await v2_error(response, 404)
    response = await client.post("/v2/models/sklearn-0/versions/3/infer", json=infer_body([1], [1]))
    assert "there is no version '3'" in await v2_error(response, 404)
    assert "no such path" in await v2_error(await client.get("/v2/models/sklearn-0/stats"), 404)
    response = await client.get("/v2/models/sklearn-0/infer")
    assert "method GET is not allowed" in await v2_error(response, 405)
    # Outside /v2, errors keep their own shape.
    outside = await error_of(await client.get("/nothing-here"))
    assert outside["type"] == "ResourceNotFoundException"


async def test_v2_requests_share_the_queue_batches_and_metrics(serve: Serve) -> None:
    server = await serve(metrics_model_label="all")  # per-model series of every family
    for values in ([0.5], [1.0]):
        response = await server.client.post(
            "/v2/models/sklearn-2/infer", json=infer_body(values, [1])
        )
        assert response.status == 200
    assert (await server.post("/predictions/sklearn-2", "[[0.5]]")).status == 200
    samples = await server.samples()
    assert samples[("mmserver_requests_total", (("code", "200"), ("model", "sklearn-2")))] == 3.0
    assert samples[("mmserver_batch_size_count", (("model", "sklearn-2"),))] == 3.0
    assert samples[("mmserver_queue_wait_seconds_count", (("model", "sklearn-2"),))] == 3.0


async def test_repository_index_load_and_unload(server: Harness) -> None:
    client = server.client
    response = await client.post("/v2/repository/index")
    index = {m["name"]: m for m in await response.json()}
    assert len(index) > 1000
    assert index["sklearn-9"] == {
        "name": "sklearn-9",
        "version": "1",
        "state": "UNAVAILABLE",
        "reason": "not loaded",
    }
    response = await client.post("/v2/repository/models/sklearn-9/load")
    assert response.status == 200
    assert server.wlm.status("sklearn-9").value == "READY"
    response = await client.post("/v2/repository/index", json={"ready": True})
    assert await response.json() == [
        {"name": "sklearn-9", "version": "1", "state": "READY", "reason": ""}
    ]
    response = await client.post(
        "/v2/repository/models/sklearn-9/unload", json={"parameters": {"unload_dependents": False}}
    )
    assert response.status == 200
    await wait_until(lambda: server.wlm.status("sklearn-9").value == "UNLOADED")
    # Unloading a model of the store that is not loaded leaves it as it is.
    assert (await client.post("/v2/repository/models/sklearn-9/unload")).status == 200
    assert "not in the store nor registered" in await v2_error(
        await client.post("/v2/repository/models/no-such-model/unload"), 404
    )
    assert "is not in the model store" in await v2_error(
        await client.post("/v2/repository/models/no-such-model/load"), 404
    )
    response = await client.post(
        "/v2/repository/models/sklearn-9/load", json={"parameters": {"config": "{}"}}
    )
    assert "load parameter 'config' is not supported" in await v2_error(response, 400)
    response = await client.post("/v2/repository/models/broken-model/load")
    assert "model broken-model failed to load" in await v2_error(response, 500)
    index = {m["name"]: m for m in await (await client.post("/v2/repository/index")).json()}
    assert index["broken-model"]["state"] == "UNAVAILABLE"
    assert index["broken-model"]["reason"].startswith("model broken-model failed to load")


async def test_repository_load_and_unload_follow_the_management_rules(serve: Serve) -> None:
    harness = await serve(management_token="s3cret-token")
    client = harness.client
    for action in ("load", "unload"):
        response = await client.post(f"/v2/repository/models/sklearn-3/{action}")
        assert "Authorization: Bearer <management token>" in await v2_error(response, 401)
    assert harness.wlm.status("sklearn-3").value == "UNLOADED"
    good = {"Authorization": "Bearer s3cret-token"}
    assert (await client.post("/v2/repository/models/sklearn-3/load", headers=good)).status == 200
    assert harness.wlm.status("sklearn-3").value == "READY"
    # The index, health, metadata and inference need no token.
    assert (await client.post("/v2/repository/index")).status == 200
    response = await client.post("/v2/models/sklearn-3/infer", json=infer_body([0.5], [1]))
    assert response.status == 200
    response = await client.post("/v2/repository/models/sklearn-3/unload", headers=good)
    assert response.status == 200


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**62], [0, 2**62, 4]])
async def test_a_shape_beyond_any_array_is_the_request_s_fault(
    server: Harness, shape: list[int]
) -> None:
    response = await server.client.post("/v2/models/sklearn-0/infer", json=infer_body([], shape))
    assert "beyond any array" in await v2_error(response, 400)
    samples = await server.samples()
    assert not [k for k in samples if k[0] == "mmserver_requests_total" and ("code", "424") in k[1]]
