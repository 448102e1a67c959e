"""Every row of the error table (DESIGN §8): status, type, message and ``x-amzn-ErrorType``.

Errors are checked on a SageMaker path (which carries ``x-amzn-ErrorType``) and, where it makes
sense, on the DJL path (which does not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from mmserver.api.middleware import answers_errors
from mmserver.api.web import STATE
from mmserver.config.server import MAX_BATCH_DELAY_MS, ServerConfig
from mmserver.errors import ConfigError
from tests.integration.gate import Gate
from tests.integration.harness import Harness, Serve, error_of, hold_gate, wait_until

TARGET = "X-Amzn-SageMaker-Target-Model"


async def check(
    response: Any, status: int, type_: str, message: str, amzn: str | None
) -> dict[str, Any]:
    assert response.status == status
    body = await error_of(response)
    assert body["type"] == type_
    assert message in body["message"]
    assert response.headers.get("x-amzn-ErrorType") == amzn
    assert "Traceback" not in body["message"]
    return body


# ------------------------------------------------------------------------------------------------
# 400
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"[[0.5]", "application/json", "the body is not valid JSON"),
        (b"", "application/json", "the request body is empty"),
        (b"", "text/csv", "the request body is empty; expected CSV"),
        (b'[["a"]]', "application/json", "value at row 0, column 0 is a JSON string ('a')"),
        (b"x\n", "text/csv", "CSV value 'x' at line 1, column 1 is not a number"),
        (b"[[1], [2, 3]]", "application/json", "row 0 has 1 values, row 1 has 2"),
        (b"[NaN]", "application/json", "is not finite"),
        (b"not npy", "application/x-npy", "does not start with the NumPy magic bytes"),
    ],
)
async def test_400_bad_body(server: Harness, body: bytes, content_type: str, message: str) -> None:
    response = await server.post("/invocations", body, content_type, **{TARGET: "sklearn-0"})
    await check(response, 400, "BadRequestException", message, "ValidationError")
    response = await server.post("/predictions/sklearn-0", body, content_type)
    await check(response, 400, "BadRequestException", message, None)


async def test_400_wrong_number_of_features(server: Harness) -> None:
    response = await server.post("/models/iris-classifier/invoke", "[[1.0, 2.0]]")
    await check(
        response,
        400,
        "BadRequestException",
        "model iris-classifier expects 4 feature(s) per row, got 2",
        "ValidationError",
    )
    response = await server.post("/predictions/sklearn-0", "[[1.0, 2.0, 3.0]]")
    await check(
        response,
        400,
        "BadRequestException",
        "model sklearn-0 expects 1 feature(s) per row, got 3",
        None,
    )


@pytest.mark.parametrize("name", ["-starts-with-dash", "a" * 129, "sp ace", "bad%2Fslash", "é"])
async def test_400_bad_model_name(server: Harness, name: str) -> None:
    response = await server.post(f"/models/{name}/invoke", "[[0.5]]")
    await check(response, 400, "BadRequestException", "invalid model name", "ValidationError")
    response = await server.post("/invocations", "[[0.5]]", **{TARGET: name.replace("%2F", "/")})
    await check(response, 400, "BadRequestException", "invalid model name", "ValidationError")


@pytest.mark.parametrize("path", ["/invocations", "/endpoints/ep/invocations"])
async def test_400_missing_target_model(server: Harness, path: str) -> None:
    response = await server.post(path, "[[0.5]]")
    await check(
        response,
        400,
        "BadRequestException",
        "missing target model: set the X-Amzn-SageMaker-Target-Model header",
        "ValidationError",
    )


# ------------------------------------------------------------------------------------------------
# 404, 405
# ------------------------------------------------------------------------------------------------


async def test_404_unknown_model(server: Harness) -> None:
    response = await server.post("/endpoints/ep/invocations", "[[0.5]]", **{TARGET: "nope.tar.gz"})
    await check(
        response,
        404,
        "ModelNotFoundException",
        "model nope is not in the model store",
        "ValidationError",
    )
    response = await server.post("/predictions/nope", "[[0.5]]")
    await check(
        response, 404, "ModelNotFoundException", "model nope is not in the model store", None
    )
    response = await server.client.get("/models/nope")
    await check(response, 404, "ModelNotFoundException", "nope", None)


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nothing"), ("POST", "/models/sklearn-0/invoke/more"), ("GET", "/endpoints/x")],
)
async def test_404_unknown_path(server: Harness, method: str, path: str) -> None:
    response = await server.client.request(method, path)
    await check(response, 404, "ResourceNotFoundException", f"no such path: {method} {path}", None)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/invocations", "POST"),
        ("PUT", "/models/sklearn-0/invoke", "POST"),
        ("GET", "/predictions/sklearn-0", "POST"),
        ("POST", "/ping", "GET,HEAD"),
        ("POST", "/models/sklearn-0", "DELETE,GET,HEAD,PUT"),
        ("DELETE", "/models", "GET,HEAD,POST"),
    ],
)
async def test_405_wrong_method(server: Harness, method: str, path: str, allowed: str) -> None:
    response = await server.client.request(method, path)
    await check(
        response,
        405,
        "MethodNotAllowedException",
        f"method {method} is not allowed on {path}",
        None,
    )
    assert sorted(response.headers["Allow"].split(",")) == allowed.split(",")


# ------------------------------------------------------------------------------------------------
# 413, 415
# ------------------------------------------------------------------------------------------------


async def test_413_declared_length(serve: Serve) -> None:
    harness = await serve(max_request_size=1024)
    body = b"[" + b"[0.5]," * 400 + b"[0.5]]"
    response = await harness.post("/invocations", body, **{TARGET: "sklearn-0"})
    await check(
        response,
        413,
        "BadRequestException",
        f"the request body is {len(body)} bytes; the limit is 1024 bytes",
        "ValidationError",
    )


async def test_413_chunked_body_is_refused_before_its_end(serve: Serve) -> None:
    """A chunked body is refused as soon as it passes the limit, not once it has all arrived."""
    harness = await serve(max_request_size=1024)
    answered = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"[" + b"[0.5]," * 400
        await answered.wait()  # the rest is sent only after the server has answered
        yield b"[0.5]]"

    try:
        response = await asyncio.wait_for(
            harness.client.post(
                "/models/sklearn-0/invoke",
                data=body(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=10,
        )
    finally:
        answered.set()
    await check(response, 413, "BadRequestException", "the limit is 1024 bytes", "ValidationError")


@pytest.mark.parametrize("content_type", ["application/xml", "text/plain", "image/png"])
async def test_415_unsupported_content_type(server: Harness, content_type: str) -> None:
    response = await server.post("/invocations", "[[0.5]]", content_type, **{TARGET: "sklearn-0"})
    await check(
        response,
        415,
        "BadRequestException",
        f"content type {content_type!r} is not supported; send one of application/json, "
        "text/csv, application/x-npy",
        "ValidationError",
    )


# ------------------------------------------------------------------------------------------------
# 424, 500
# ------------------------------------------------------------------------------------------------


async def test_424_model_raised(
    server: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="mmserver.api.dataplane")
    lines = server.client.app[STATE].model_errors
    response = await server.post("/models/raising-handler/invoke", "[[0.5]]")
    await check(
        response, 424, "TranslateException", "ValueError: feature 0 is out of range", "ModelError"
    )
    for _ in range(3):
        response = await server.post("/predictions/raising-handler", "[[0.5]]")
        await check(
            response, 424, "TranslateException", "ValueError: feature 0 is out of range", None
        )
    # One line a minute for the model, with the error, not one a request.
    raised = [
        r for r in caplog.records if r.getMessage().startswith("model raising-handler raised")
    ]
    assert len(raised) == 1
    assert "ValueError: feature 0 is out of range" in raised[0].getMessage()
    assert raised[0].model == "raising-handler"  # type: ignore[attr-defined]
    # The next minute's line counts what the minute before did not write.
    monkeypatch.setattr(lines, "every_s", 0.0)
    response = await server.post("/predictions/raising-handler", "[[0.5]]")
    assert response.status == 424
    raised = [
        r for r in caplog.records if r.getMessage().startswith("model raising-handler raised")
    ]
    assert len(raised) == 2 and raised[1].getMessage().endswith("; 3 more in the last 0 s")


async def test_500_model_failed_to_load(server: Harness) -> None:
    response = await server.post("/invocations", "[[0.5]]", **{TARGET: "broken-model"})
    await check(
        response, 500, "EngineException", "model.joblib cannot be loaded", "InternalFailure"
    )
    # The server keeps serving the other models.
    response = await server.post("/predictions/sklearn-0", "[[0.5]]")
    assert response.status == 200


async def test_500_backend_died(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    harness = await serve(backend_processes=1)
    caplog.set_level(logging.WARNING, logger="mmserver.api.dataplane")
    response = await harness.post("/models/dying-handler/invoke", "[[0.5]]")
    await check(response, 500, "EngineException", "died", "InternalFailure")
    # A line names the request and its model, with both as the line's fields.
    rid = response.headers["X-Request-Id"]
    [line] = [r for r in caplog.records if r.getMessage().startswith(f"request {rid} ")]
    assert f"request {rid} of model dying-handler: backend process" in line.getMessage()
    assert (line.model, line.request_id) == ("dying-handler", rid)  # type: ignore[attr-defined]
    # The process is replaced: other models still answer.
    response = await harness.post("/models/sklearn-0/invoke", "[[0.5]]")
    assert response.status == 200


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("secret internal detail")


async def test_500_unexpected_exception_is_generic(serve: Serve) -> None:
    harness = await serve(routes=[web.get("/boom", answers_errors(_boom))])
    response = await harness.client.get("/boom")
    body = await check(
        response,
        500,
        "InternalServerException",
        "the server failed to answer this request; it has logged the cause",
        None,
    )
    assert "secret" not in body["message"] and "RuntimeError" not in body["message"]


async def test_500_unexpected_exception_on_the_inference_path_is_generic(
    server: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.wlm, "submit", broken)
    response = await server.post("/invocations", "[[0.5]]", **{TARGET: "sklearn-0"})
    body = await check(
        response,
        500,
        "InternalServerException",
        "the server failed to answer this request; it has logged the cause",
        "InternalFailure",
    )
    assert "secret" not in body["message"]
    monkeypatch.undo()
    assert (await server.post("/predictions/sklearn-0", "[[0.5]]")).status == 200


# ------------------------------------------------------------------------------------------------
# 503, 504, 507
# ------------------------------------------------------------------------------------------------


def queue_length(server: Harness, model: str) -> int:
    """Jobs waiting in the queue of ``model`` (0 when it is not loaded)."""
    pool = server.wlm.room.loaded.get(model)
    return len(pool.queue) if pool is not None else 0


async def test_503_queue_full(server: Harness, gate: Gate) -> None:
    running = await hold_gate(server, gate, "/models/gated-handler/invoke")
    queued = asyncio.ensure_future(server.post("/models/gated-handler/invoke", "[[0.5]]"))
    await wait_until(lambda: queue_length(server, "gated-handler") == 1)
    response = await server.post("/models/gated-handler/invoke", "[[0.5]]")
    await check(response, 503, "WlmCapacityException", "", "ServiceUnavailable")
    assert int(response.headers["Retry-After"]) >= 1
    gate.open()
    for task in (running, queued):
        answer = await task
        assert answer.status == 200
        assert len((await answer.json())["predictions"]) == 1


async def test_503_nothing_evictable_and_507_for_management(serve: Serve, gate: Gate) -> None:
    harness = await serve(max_loaded_models=1, room_wait_seconds=0.1)
    running = await hold_gate(harness, gate, "/predictions/gated-handler")
    response = await harness.post("/invocations", "[[0.5]]", **{TARGET: "sklearn-0"})
    await check(
        response,
        503,
        "WlmOutOfMemoryException",
        "no room to load model sklearn-0",
        "ServiceUnavailable",
    )
    assert response.headers["Retry-After"] == "1"

    response = await harness.client.post(
        "/models", json={"url": "sklearn-5.tar.gz", "model_name": "another"}
    )
    await check(response, 507, "WlmOutOfMemoryException", "no room to load model another", None)
    gate.open()
    assert (await running).status == 200
    # Once the busy model is idle, it is evicted for the next one.
    response = await harness.post("/predictions/sklearn-0", "[[0.5]]")
    assert response.status == 200


async def test_503_shutting_down(server: Harness) -> None:
    server.wlm.begin_shutdown()
    response = await server.post("/invocations", "[[0.5]]", **{TARGET: "sklearn-0"})
    await check(response, 503, "WlmShutdownException", "shutting down", "ServiceUnavailable")
    response = await server.client.get("/ping")
    assert response.status == 503
    body = await response.json()
    assert body["status"] == "Unhealthy"
    assert body["code"] == 503 and body["type"] == "WlmShutdownException"


async def test_504_predict_timeout(serve: Serve, gate: Gate) -> None:
    harness = await serve(predict_timeout=0.3)
    response = await harness.post("/models/gated-handler/invoke", "[[0.5]]")
    await check(
        response,
        504,
        "TimeoutException",
        "did not finish within option.predict_timeout",
        "ServiceUnavailable",
    )
    assert gate.entered.acquire(blocking=False)


async def test_client_gone_is_not_computed(server: Harness, gate: Gate) -> None:
    """A queued request whose client leaves is dropped, not predicted (and counted as 504)."""
    running = await hold_gate(server, gate, "/predictions/gated-handler")
    leaving = asyncio.ensure_future(server.post("/predictions/gated-handler", "[[0.5]]"))
    await wait_until(lambda: queue_length(server, "gated-handler") == 1)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    gate.open()
    assert (await running).status == 200

    key = ("mmserver_requests_total", (("code", "504"), ("model", "gated-handler")))
    samples: dict[Any, float] = {}

    async def refresh() -> None:
        samples.clear()
        samples.update(await server.samples())

    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while samples.get(key) != 1.0 and loop.time() < end:
        await refresh()
        await asyncio.sleep(0.01)
    assert samples.get(key) == 1.0
    assert gate.passed == 1  # the left request never reached the model


# ------------------------------------------------------------------------------------------------
# Batch delay and deadlines
# ------------------------------------------------------------------------------------------------


async def test_max_batch_delay_is_bounded(server: Harness) -> None:
    for delay in ("100000000000000000", str(MAX_BATCH_DELAY_MS + 1)):
        response = await server.client.put(
            "/models/sklearn-1", params={"max_batch_delay": delay, "batch_size": "4"}
        )
        body = await check(response, 400, "BadRequestException", "max_batch_delay=", None)
        assert f"over the limit of {MAX_BATCH_DELAY_MS} ms" in body["message"]
    response = await server.client.put(
        "/models/sklearn-1", params={"max_batch_delay": str(MAX_BATCH_DELAY_MS)}
    )
    assert response.status == 200, await response.text()
    with pytest.raises(ConfigError, match="max_batch_delay"):
        ServerConfig(max_batch_delay=MAX_BATCH_DELAY_MS + 1)


async def test_a_request_waiting_for_its_batch_is_answered_504_at_its_deadline(
    serve: Serve,
) -> None:
    harness = await serve(predict_timeout=0.3)
    response = await harness.client.put(
        "/models/sklearn-2", params={"max_batch_delay": str(MAX_BATCH_DELAY_MS), "batch_size": "4"}
    )
    assert response.status == 200, await response.text()
    # Alone, the request waits for company for 10 s; its deadline passes long before.
    started = asyncio.get_running_loop().time()
    response = await asyncio.wait_for(harness.post("/predictions/sklearn-2", "[[0.5]]"), 5.0)
    await check(response, 504, "TimeoutException", "longer than option.predict_timeout", None)
    assert asyncio.get_running_loop().time() - started < 5.0
    assert queue_length(harness, "sklearn-2") == 0
