"""Inference over real HTTP: every path, every body format, both response formats."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tests.integration.harness import Harness, error_of, watch_body_reads

# The reference model is y = 2x + 1 (+ noise): about 2.0 at x = 0.5.
AT_HALF = pytest.approx(2.0, abs=0.05)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


async def test_ping(server: Harness) -> None:
    response = await server.client.get("/ping")
    assert response.status == 200
    assert await response.json() == {"status": "Healthy"}


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/predictions/sklearn-7", {}),
        ("/predictions/sklearn-7.tar.gz", {}),
        ("/models/sklearn-7/invoke", {}),
        ("/models/sklearn-7.tar.gz/invoke", {}),
        ("/invocations", {"X-Amzn-SageMaker-Target-Model": "sklearn-7.tar.gz"}),
        ("/invocations?model_name=sklearn-7", {}),
        ("/endpoints/my-endpoint/invocations", {"X-Amzn-SageMaker-Target-Model": "sklearn-7"}),
        ("/endpoints/my-endpoint/invocations?model_name=sklearn-7.tgz", {}),
    ],
)
async def test_every_inference_path(server: Harness, path: str, headers: dict[str, str]) -> None:
    response = await server.post(path, "[[0.5]]", **headers)
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    body = await response.json()
    assert list(body) == ["predictions"]
    assert body["predictions"] == [AT_HALF]


async def test_target_header_wins_over_query(server: Harness) -> None:
    response = await server.post(
        "/invocations?model_name=no-such-model",
        "[[0.5]]",
        **{"X-Amzn-SageMaker-Target-Model": "sklearn-3"},
    )
    assert response.status == 200
    assert (await response.json())["predictions"] == [AT_HALF]


@pytest.mark.parametrize(
    ("body", "content_type", "rows"),
    [
        (b"[[0.5], [1.0], [0.0]]", "application/json", 3),
        (b"[0.5]", "application/json", 1),
        (b'{"inputs": [[0.5], [1.0], [0.0]]}', "application/json", 3),
        (b'{"instances": [[0.5], [1.0], [0.0]]}', "application/json; charset=utf-8", 3),
        (b"[[0.5], [1.0], [0.0]]", None, 3),
        (b"0.5\n1.0\n0.0\n", "text/csv", 3),
        (b"0.5", "text/csv; charset=utf-8", 1),
        (npy(np.array([[0.5], [1.0], [0.0]])), "application/x-npy", 3),
        (npy(np.array([0.5], dtype=np.float32)), "application/x-npy", 1),
    ],
)
async def test_every_body_format(
    server: Harness, body: bytes, content_type: str | None, rows: int
) -> None:
    response = await server.post("/predictions/sklearn-1", body, content_type)
    assert response.status == 200, await response.text()
    predictions = (await response.json())["predictions"]
    expected = [2.0, 3.0, 1.0][:rows]
    assert predictions == [pytest.approx(v, abs=0.05) for v in expected]


async def test_chunked_body_is_accepted(server: Harness) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"[[0.5],"
        yield b" [1.0]]"

    response = await server.client.post(
        "/predictions/sklearn-1", data=chunks(), headers={"Content-Type": "application/json"}
    )
    assert response.status == 200
    assert (await response.json())["predictions"] == [AT_HALF, pytest.approx(3.0, abs=0.05)]


async def test_body_arriving_after_its_headers_is_read_whole(
    server: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Content-Length body whose second half comes in a later packet, after the handler has
    started: the handler waits for it (the usual body is whole by then and read at once)."""
    reading = watch_body_reads(monkeypatch)
    host, port = server.client.host, server.client.port
    reader, writer = await asyncio.open_connection(host, port)
    body = b"[[0.5], [1.0]]"
    writer.write(
        b"POST /predictions/sklearn-1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body[:7]
    )
    await writer.drain()
    await asyncio.wait_for(reading.wait(), timeout=10)  # the handler is reading the body
    writer.write(body[7:])
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(payload)["predictions"] == [AT_HALF, pytest.approx(3.0, abs=0.05)]


@pytest.mark.parametrize("accept", ["text/csv", "text/csv; q=0.9, application/json; q=0.5"])
async def test_csv_response(server: Harness, accept: str) -> None:
    response = await server.post("/predictions/sklearn-2", "[[0.5], [1.0]]", Accept=accept)
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
    lines = (await response.text()).splitlines()
    assert [float(v) for v in lines] == [AT_HALF, pytest.approx(3.0, abs=0.05)]


@pytest.mark.parametrize("accept", ["application/json", "*/*", "image/png", ""])
async def test_json_response(server: Harness, accept: str) -> None:
    response = await server.post("/predictions/sklearn-2", "0.5", "text/csv", Accept=accept)
    assert response.status == 200
    assert response.content_type == "application/json"
    assert (await response.json())["predictions"] == [AT_HALF]


async def test_classifier_probabilities(server: Harness) -> None:
    response = await server.post(
        "/models/iris-classifier/invoke", "[[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]"
    )
    assert response.status == 200
    setosa, virginica = (await response.json())["predictions"]
    assert len(setosa) == 3 and sum(setosa) == pytest.approx(1.0)
    assert setosa[0] > 0.9 and virginica[2] > 0.7


async def test_pipeline(server: Harness) -> None:
    response = await server.post("/predictions/pipeline-scaler", "1,1,1\n0,0,1", "text/csv")
    assert response.status == 200
    assert (await response.json())["predictions"] == [
        pytest.approx(0.0, abs=0.05),
        pytest.approx(-3.0, abs=0.05),
    ]


async def test_custom_handler_rows_of_objects(server: Harness) -> None:
    response = await server.post("/predictions/custom-handler", "[[0.5], [1.0]]")
    assert response.status == 200
    first, second = (await response.json())["predictions"]
    assert set(first) == {"value", "doubled"}
    assert first["value"] == AT_HALF and first["doubled"] == pytest.approx(4.0, abs=0.1)
    assert second["value"] == pytest.approx(3.0, abs=0.05)

    response = await server.post("/predictions/custom-handler", "[[0.5]]", Accept="text/csv")
    value, doubled = (await response.text()).strip().split(",")
    assert float(value) == AT_HALF and float(doubled) == pytest.approx(4.0, abs=0.1)


async def test_large_npy_batch(server: Harness) -> None:
    x = np.linspace(0.0, 1.0, 50_000).reshape(-1, 1)
    response = await server.post("/predictions/sklearn-4", npy(x), "application/x-npy")
    assert response.status == 200
    predictions = np.array((await response.json())["predictions"])
    np.testing.assert_allclose(predictions, 2.0 * x[:, 0] + 1.0, atol=0.05)


async def test_body_of_exactly_the_limit_is_accepted(serve: object) -> None:
    harness: Harness = await serve(max_request_size=64)  # type: ignore[operator]
    body = b"[[0.5]]".ljust(64)
    response = await harness.post("/predictions/sklearn-0", body)
    assert response.status == 200
    response = await harness.post("/predictions/sklearn-0", body + b" ")
    assert response.status == 413
    assert (await error_of(response))["type"] == "BadRequestException"


async def test_head_ping(server: Harness) -> None:
    response = await server.client.head("/ping")
    assert response.status == 200


async def test_keep_alive_after_errors(server: Harness) -> None:
    """Errors do not poison the connection: the next request on it is answered normally."""
    for body, status in [(b"[[", 400), (b"[[0.5]]", 200), (b"x" * 10, 400), (b"[0.5]", 200)]:
        response = await server.post("/predictions/sklearn-0", body)
        assert response.status == status
        json.loads(await response.read())
