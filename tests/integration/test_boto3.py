"""A real ``boto3`` ``sagemaker-runtime`` client against the server on a loopback port.

``invoke_endpoint(EndpointName=..., TargetModel=...)`` sends ``POST /endpoints/{name}/invocations``
with the ``X-Amzn-SageMaker-Target-Model`` header; errors must come back as the client's modelled
exceptions (``ValidationError``, ``ModelError``, ``ServiceUnavailable``, ``InternalFailure``).
The client is synchronous, so it runs in a thread while the server runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.integration.harness import Harness, Serve


def runtime_client(harness: Harness) -> Any:
    return boto3.session.Session().client(
        "sagemaker-runtime",
        region_name="us-east-1",
        endpoint_url=harness.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 0}, connect_timeout=5, read_timeout=30),
    )


async def invoke(client: Any, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("EndpointName", "mme")
    response: dict[str, Any] = await asyncio.to_thread(client.invoke_endpoint, **kwargs)
    response["Payload"] = await asyncio.to_thread(response["Body"].read)
    return response


async def raised(client: Any, **kwargs: Any) -> Any:
    """The exception ``invoke_endpoint`` raised (failing the test if it returned)."""
    try:
        await invoke(client, **kwargs)
    except Exception as exc:
        return exc
    pytest.fail("invoke_endpoint did not raise")


async def test_invoke_json(server: Harness) -> None:
    client = runtime_client(server)
    response = await invoke(
        client,
        TargetModel="sklearn-3.tar.gz",
        Body=b"[[0.5], [1.0]]",
        ContentType="application/json",
        Accept="application/json",
    )
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert response["ContentType"] == "application/json"
    assert json.loads(response["Payload"]) == {
        "predictions": [pytest.approx(2.0, abs=0.05), pytest.approx(3.0, abs=0.05)]
    }


async def test_invoke_csv(server: Harness) -> None:
    client = runtime_client(server)
    response = await invoke(
        client,
        EndpointName="another-endpoint",
        TargetModel="sklearn-4.tar.gz",
        Body=b"0.5\n0.0\n",
        ContentType="text/csv",
        Accept="text/csv",
    )
    assert response["ContentType"] == "text/csv; charset=utf-8"
    values = [float(line) for line in response["Payload"].decode().splitlines()]
    assert values == [pytest.approx(2.0, abs=0.05), pytest.approx(1.0, abs=0.05)]


async def test_invoke_without_content_type(server: Harness) -> None:
    client = runtime_client(server)
    response = await invoke(client, TargetModel="sklearn-5.tar.gz", Body=b"[0.5]")
    assert json.loads(response["Payload"])["predictions"] == [pytest.approx(2.0, abs=0.05)]


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        (
            {
                "TargetModel": "sklearn-3.tar.gz",
                "Body": b"[[0.5]",
                "ContentType": "application/json",
            },
            400,
            "the body is not valid JSON",
        ),
        (
            {"TargetModel": "sklearn-3.tar.gz", "Body": b"[[1, 2]]"},
            400,
            "expects 1 feature(s) per row, got 2",
        ),
        ({"Body": b"[[0.5]]"}, 400, "missing target model"),
        ({"TargetModel": "no-such-model.tar.gz", "Body": b"[[0.5]]"}, 404, "no-such-model"),
        ({"TargetModel": "bad name", "Body": b"[[0.5]]"}, 400, "invalid model name"),
        (
            {"TargetModel": "sklearn-3", "Body": b"[[0.5]]", "ContentType": "application/xml"},
            415,
            "content type 'application/xml' is not supported",
        ),
    ],
)
async def test_validation_error(
    server: Harness, kwargs: dict[str, Any], status: int, message: str
) -> None:
    client = runtime_client(server)
    exc = await raised(client, **kwargs)
    assert isinstance(exc, client.exceptions.ValidationError)
    assert exc.response["Error"]["Code"] == "ValidationError"
    assert message in exc.response["Error"]["Message"]
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == status


async def test_validation_error_for_too_large_body(serve: Serve) -> None:
    harness = await serve(max_request_size=1024)
    client = runtime_client(harness)
    exc = await raised(client, TargetModel="sklearn-3", Body=b"[" + b"0.5, " * 400 + b"0.5]")
    assert isinstance(exc, client.exceptions.ValidationError)
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 413
    assert "the limit is 1024 bytes" in exc.response["Error"]["Message"]


async def test_model_error(server: Harness) -> None:
    client = runtime_client(server)
    exc = await raised(client, TargetModel="raising-handler", Body=b"[[0.5]]")
    assert isinstance(exc, client.exceptions.ModelError)
    assert exc.response["Error"]["Code"] == "ModelError"
    assert "ValueError: feature 0 is out of range" in exc.response["Error"]["Message"]
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 424


async def test_internal_failure(server: Harness) -> None:
    client = runtime_client(server)
    exc = await raised(client, TargetModel="broken-model", Body=b"[[0.5]]")
    assert isinstance(exc, client.exceptions.InternalFailure)
    assert "model.joblib cannot be loaded" in exc.response["Error"]["Message"]
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 500


async def test_service_unavailable(server: Harness) -> None:
    client = runtime_client(server)
    server.wlm.begin_shutdown()
    exc = await raised(client, TargetModel="sklearn-3.tar.gz", Body=b"[[0.5]]")
    assert isinstance(exc, client.exceptions.ServiceUnavailable)
    assert exc.response["Error"]["Code"] == "ServiceUnavailable"
    assert "shutting down" in exc.response["Error"]["Message"]
    assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 503
