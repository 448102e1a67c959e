"""Tenants (the ``tenants`` option) through every door, with real clients: boto3 signing with a
tenant's access keys, bearer tokens on the DJL and V2 paths (the lean path and aiohttp's), the
limits answered 429, the listings a tenant sees, ``/metrics`` behind its token, the file read
again, and a management call's parameters checked."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from mmserver.api.web import STATE
from mmserver.commands.transform.failures import TransformError
from mmserver.commands.transform.sender import Sender
from mmserver.tenancy.gate import THROTTLE_HOLD_S
from tests.integration import gate as gate_module
from tests.integration.harness import (
    Harness,
    Serve,
    describe,
    error_of,
    hold_gate,
    wait_until,
)
from tests.integration.test_hostile_http import Sockets
from tests.integration.test_hostile_http import sockets as sockets  # the fixture
from tests.integration.test_lean_http import _STATUS, _exchange, _request

MANAGEMENT = "the-management-token"
ACME = {"Authorization": "Bearer tok-acme-0001"}
BETA = {"Authorization": "Bearer tok-beta-0001"}
ROOT = {"Authorization": f"Bearer {MANAGEMENT}"}

TENANTS = """\
tenants:
  acme:
    models: ["sklearn-1*"]
    access_keys: {AKIAACME00000001: "acme-secret"}
    tokens: ["tok-acme-0001"]
  beta:
    models: ["sklearn-2"]
    access_keys: {AKIABETA00000001: "beta-secret"}
    tokens: ["tok-beta-0001"]
    requests_per_second: 0.01
    burst: 2
  gamma:
    models: ["gated-handler"]
    tokens: ["tok-gamma-0001"]
    max_concurrent: 1
"""


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return path


@pytest.fixture
async def tenanted(serve: Serve, tenants_file: Path) -> Harness:
    return await serve(
        tenants=str(tenants_file), management_token=MANAGEMENT, metrics_token="scrape-0001"
    )


def runtime(harness: Harness, key: str | None, secret: str = "") -> Any:
    """A boto3 ``sagemaker-runtime`` client (``key=None``: unsigned), retrying nothing."""
    config = Config(retries={"max_attempts": 0}, read_timeout=30)
    if key is None:
        config = config.merge(Config(signature_version=UNSIGNED))
    return boto3.session.Session().client(
        "sagemaker-runtime",
        region_name="eu-west-1",
        endpoint_url=harness.url,
        aws_access_key_id=key or "unused",
        aws_secret_access_key=secret or "unused",
        config=config,
    )


async def invoke(client: Any, model: str) -> Any:
    def call() -> Any:
        response = client.invoke_endpoint(
            EndpointName="mme",
            TargetModel=f"{model}.tar.gz",
            Body=b"[[0.5], [1.0]]",
            ContentType="application/json",
        )
        return json.loads(response["Body"].read())

    return await asyncio.to_thread(call)


async def code_of(client: Any, model: str) -> tuple[str, int, str]:
    with pytest.raises(ClientError) as caught:
        await invoke(client, model)
    error = caught.value.response
    return error["Error"]["Code"], error["ResponseMetadata"]["HTTPStatusCode"], str(caught.value)


async def test_boto3_with_a_tenants_keys_calls_its_models_only(tenanted: Harness) -> None:
    acme = runtime(tenanted, "AKIAACME00000001", "acme-secret")
    answer = await invoke(acme, "sklearn-1")
    assert answer == {"predictions": [pytest.approx(2.0, abs=0.05), pytest.approx(3.0, abs=0.05)]}
    code, status, message = await code_of(acme, "sklearn-2")
    assert (code, status) == ("AccessDeniedException", 403)
    assert "tenant acme may not invoke model sklearn-2" in message
    wrong = runtime(tenanted, "AKIAACME00000001", "not-the-secret")
    assert (await code_of(wrong, "sklearn-1"))[:2] == ("InvalidSignatureException", 403)
    unknown = runtime(tenanted, "AKIAUNKNOWN00001", "x")
    assert (await code_of(unknown, "sklearn-1"))[:2] == ("UnrecognizedClientException", 403)
    unsigned = runtime(tenanted, None)
    assert (await code_of(unsigned, "sklearn-1"))[:2] == (
        "MissingAuthenticationTokenException",
        403,
    )


@pytest.mark.parametrize("lean", [True, False])
async def test_bearer_tokens_on_the_djl_and_v2_paths(
    serve: Serve, tenants_file: Path, lean: bool
) -> None:
    server = await serve(tenants=str(tenants_file), management_token=MANAGEMENT, lean_http=lean)
    body = "[[0.5]]"
    response = await server.post("/predictions/sklearn-1", body, **ACME)
    assert response.status == 200, await response.text()
    assert json.loads(await response.read()) == {"predictions": [pytest.approx(2.0, abs=0.05)]}
    bare = await server.post("/predictions/sklearn-1", body)
    assert bare.status == 401
    assert bare.headers["WWW-Authenticate"] == 'Bearer realm="mmserver"'
    assert "send 'Authorization: Bearer <your token>'" in (await error_of(bare))["message"]
    wrong = await server.post("/predictions/sklearn-1", body, Authorization="Bearer tok-nobody-1")
    assert wrong.status == 401
    assert "not one the server knows" in (await error_of(wrong))["message"]
    other = await server.post("/predictions/sklearn-2", body, **ACME)
    assert other.status == 403
    assert "tenant acme may not invoke model sklearn-2" in (await error_of(other))["message"]
    v2 = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]})
    ok = await server.post("/v2/models/sklearn-1/infer", v2, **ACME)
    assert ok.status == 200
    refused = await server.post("/v2/models/sklearn-2/infer", v2, **ACME)
    assert refused.status == 403
    assert "may not invoke" in (await refused.json())["error"]
    operator = await server.post("/predictions/sklearn-2", body, **ROOT)
    assert operator.status == 200  # the management token calls every model


async def test_a_flood_is_held_to_its_rate_and_a_neighbour_is_answered(tenanted: Harness) -> None:
    beta_answers = [
        (await tenanted.post("/predictions/sklearn-2", "[[0.5]]", **BETA)) for _ in range(3)
    ]
    # A burst of 2, then one request every 100 s: the third is over the rate.
    assert [r.status for r in beta_answers] == [200, 200, 429]
    throttled = beta_answers[2]
    assert 90 <= int(throttled.headers["Retry-After"]) <= 100
    error = await error_of(throttled)
    assert "tenant beta is over its rate of 0.01 requests per second (burst 2)" in error["message"]
    neighbour = await tenanted.post("/predictions/sklearn-1", "[[0.5]]", **ACME)
    assert neighbour.status == 200
    code, status, _ = await code_of(
        runtime(tenanted, "AKIABETA00000001", "beta-secret"), "sklearn-2"
    )
    assert (code, status) == ("ThrottlingException", 429)
    samples = await samples_with(tenanted, "scrape-0001")
    assert count(samples, "-", "429", "beta") == 2
    assert count(samples, "sklearn-2", "200", "beta") == 2
    assert count(samples, "sklearn-1", "200", "acme") == 1


def count(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    model: str,
    code: str,
    tenant: str,
) -> float:
    labels = (("code", code), ("model", model), ("tenant", tenant))
    return samples.get(("mmserver_requests_total", labels), 0.0)


async def samples_with(
    harness: Harness, token: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = await harness.client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    assert response.status == 200
    out = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.mark.parametrize("lean", [True, False])
async def test_a_429_is_held_and_its_connection_reads_nothing_meanwhile(
    serve: Serve, tenants_file: Path, sockets: Sockets, lean: bool
) -> None:
    server = await serve(tenants=str(tenants_file), management_token=MANAGEMENT, lean_http=lean)
    request = _request("/predictions/sklearn-2", Authorization=BETA["Authorization"])
    started = time.monotonic()
    received = await _exchange(server, sockets, request * 5, 5)
    held = time.monotonic() - started
    assert _STATUS.findall(received) == [b"200", b"200", b"429", b"429", b"429"]
    # Each 429 was held before it was sent, and the next request read only after it: a client
    # that retries at once sends one request per hold.
    assert held >= 3 * THROTTLE_HOLD_S
    assert received.count(b"Retry-After: ") == 3
    neighbour = await server.post("/predictions/sklearn-1", "[[0.5]]", **ACME)
    assert neighbour.status == 200


async def test_requests_in_flight_past_max_concurrent_are_answered_429(
    tenanted: Harness, gate: gate_module.Gate
) -> None:
    gamma = {"Authorization": "Bearer tok-gamma-0001"}
    held = await hold_gate(tenanted, gate, "/predictions/gated-handler", **gamma)
    second = await tenanted.post("/predictions/gated-handler", "[[0.5]]", **gamma)
    assert second.status == 429
    assert (
        "tenant gamma has 1 requests in flight, its max_concurrent"
        in (await error_of(second))["message"]
    )
    gate.open()
    assert (await held).status == 200
    third = await tenanted.post("/predictions/gated-handler", "[[0.5]]", **gamma)
    assert third.status == 200  # the first one's place was given back with its answer


async def test_a_full_queue_sheds_low_priority_first(
    serve: Serve, tmp_path: Path, gate: gate_module.Gate
) -> None:
    tenants = tmp_path / "ranked.yaml"
    tenants.write_text(
        "tenants:\n"
        "  bulk: {models: [gated-handler], tokens: [tok-bulk-0001], priority: low}\n"
        "  usual: {models: [gated-handler], tokens: [tok-usual-001]}\n"
        "  vip: {models: [gated-handler], tokens: [tok-vip-00001], priority: high}\n"
    )
    server = await serve(tenants=str(tenants), management_token=MANAGEMENT)
    bulk = {"Authorization": "Bearer tok-bulk-0001"}
    usual = {"Authorization": "Bearer tok-usual-001"}
    vip = {"Authorization": "Bearer tok-vip-00001"}
    path = "/predictions/gated-handler"
    held = await hold_gate(server, gate, path, **bulk)  # its one worker is busy
    queue = server.wlm.room.loaded["gated-handler"].queue  # job_queue_size=1
    queued_low = asyncio.ensure_future(server.post(path, "[[0.5]]", **bulk))
    await wait_until(lambda: len(queue) == 1)
    # The queue is full: a normal request takes the low one's place...
    queued_normal = asyncio.ensure_future(server.post(path, "[[0.5]]", **usual))
    shed = await queued_low
    assert shed.status == 503
    assert (
        "a request of a higher priority took this one's place" in (await error_of(shed))["message"]
    )
    # ... a high one the normal one's; a low one finds no place below its own.
    queued_high = asyncio.ensure_future(server.post(path, "[[0.5]]", **vip))
    assert (await queued_normal).status == 503
    refused = await server.post(path, "[[0.5]]", **bulk)
    assert refused.status == 503
    assert (
        "the model's queue is full (1 jobs waiting); retry later"
        in (await error_of(refused))["message"]
    )
    gate.open()
    assert (await held).status == 200
    assert (await queued_high).status == 200


async def test_a_transform_job_sends_its_token(tenanted: Harness) -> None:
    async with Sender(
        tenanted.url, "sklearn-1", "application/json", 1, 30.0, "tok-acme-0001"
    ) as sender:
        body, kind = await sender.send(b"[[0.5], [1.0]]", "application/json")
    assert kind == "application/json"
    assert json.loads(body) == {
        "predictions": [pytest.approx(2.0, abs=0.05), pytest.approx(3.0, abs=0.05)]
    }
    async with Sender(tenanted.url, "sklearn-1", "application/json", 1, 30.0) as anonymous:
        with pytest.raises(TransformError) as refused:
            await anonymous.send(b"[[0.5]]", "application/json")
    assert "the server refused the job's credentials (401: " in refused.value.args[0]
    assert "give --token (or MMSERVER_TOKEN)" in refused.value.args[0]


async def test_a_tenant_lists_and_describes_its_own_models_only(tenanted: Harness) -> None:
    client = tenanted.client
    assert (await client.get("/models")).status == 401
    listed = await (await client.get("/models?limit=5", headers=ACME)).json()
    names = [m["modelName"] for m in listed["models"]]
    assert names == ["sklearn-1", "sklearn-10", "sklearn-100", "sklearn-101", "sklearn-102"]
    assert listed["nextPageToken"] == "sklearn-102"
    assert listed["models"][0]["modelUrl"] == "sklearn-1.tar.gz"
    page = await (
        await client.get("/models?limit=100&next_page_token=sklearn-198", headers=ACME)
    ).json()
    assert [m["modelName"] for m in page["models"]] == ["sklearn-199"]
    assert "nextPageToken" not in page
    everything = await (await client.get("/models?limit=3", headers=ROOT)).json()
    root_url = everything["models"][0]["modelUrl"]
    assert str(tenanted.config.store_path) in root_url  # the operator sees where it is
    assert (await client.get("/models/sklearn-2", headers=ACME)).status == 403
    own = await (await client.get("/models/sklearn-1", headers=ACME)).json()
    assert own[0]["models"][0]["modelUrl"] == "sklearn-1.tar.gz"
    index = await (await client.post("/v2/repository/index", headers=BETA)).json()
    assert [row["name"] for row in index] == ["sklearn-2"]
    assert (await client.post("/v2/repository/index")).status == 401
    assert (await client.get("/v2/models/sklearn-1", headers=BETA)).status == 403
    metadata = await client.get("/v2/models/sklearn-2", headers=BETA)
    assert metadata.status == 200 and (await metadata.json())["name"] == "sklearn-2"
    # Health stays open; /metrics takes the management token or metrics_token only.
    assert (await client.get("/ping")).status == 200
    assert (await client.get("/v2/health/ready")).status == 200
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/metrics", headers=ACME)).status == 401
    assert (await client.get("/metrics", headers=ROOT)).status == 200


async def test_the_file_is_read_again_and_a_bad_one_keeps_the_tenants(
    tenanted: Harness, tenants_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = tenanted.client.app[STATE].tenants
    assert gate is not None
    await asyncio.to_thread(
        tenants_file.write_text, TENANTS.replace("tok-acme-0001", "tok-acme-0002")
    )
    assert gate.reload("SIGHUP")
    new = {"Authorization": "Bearer tok-acme-0002"}
    assert (await tenanted.post("/predictions/sklearn-1", "[[0.5]]", **new)).status == 200
    assert (await tenanted.post("/predictions/sklearn-1", "[[0.5]]", **ACME)).status == 401
    await asyncio.to_thread(tenants_file.write_text, TENANTS.replace("models:", "modelz:", 1))
    assert not gate.reload("SIGHUP")
    assert "SIGHUP: the tenants in force are kept" in caplog.text
    assert "line 3: tenant acme: unknown key 'modelz'; did you mean 'models'?" in caplog.text
    assert (await tenanted.post("/predictions/sklearn-1", "[[0.5]]", **new)).status == 200


async def test_a_changed_file_is_seen_without_a_signal(
    tenanted: Harness, tenants_file: Path
) -> None:
    gate = tenanted.client.app[STATE].tenants
    assert gate is not None
    read = asyncio.Event()
    reload = gate.reload

    def reloaded(why: str) -> bool:
        done = reload(why)
        read.set()
        return done

    gate.reload = reloaded  # type: ignore[method-assign]
    gate.watch()
    try:
        await asyncio.to_thread(
            tenants_file.write_text, TENANTS.replace("tok-beta-0001", "tok-beta-0002")
        )
        await asyncio.wait_for(read.wait(), 10)
    finally:
        gate.stop()
    new = {"Authorization": "Bearer tok-beta-0002"}
    assert (await tenanted.post("/predictions/sklearn-2", "[[0.5]]", **new)).status == 200


async def test_put_models_takes_every_setting_and_refuses_an_unknown_one(server: Harness) -> None:
    client = server.client
    assert (await server.post("/predictions/sklearn-5", "[[0.5]]")).status == 200
    changed = await client.put("/models/sklearn-5?job_queue_size=8&batch_size=4&max_batch_delay=7")
    assert changed.status == 200, await changed.text()
    model = await describe(server, "sklearn-5")
    assert (model["queueSize"], model["batchSize"], model["maxBatchDelayMillis"]) == (8, 4, 7)
    bogus = await client.put("/models/sklearn-5?bogus=1")
    assert bogus.status == 400
    assert "does not take parameter 'bogus'" in (await error_of(bogus))["message"]
    typo = await client.put("/models/sklearn-5?max_workers=2")
    assert "did you mean 'max_worker'?" in (await error_of(typo))["message"]


async def test_a_tenant_cannot_manage_models_on_loopback_without_the_token(
    serve: Serve, tenants_file: Path
) -> None:
    server = await serve(tenants=str(tenants_file))  # loopback, no management token
    client = server.client
    for method, path in (
        ("PUT", "/models/sklearn-2?max_worker=0"),
        ("DELETE", "/models/sklearn-2"),
        ("POST", "/v2/repository/models/sklearn-2/unload"),
    ):
        response = await client.request(method, path, headers=ACME)
        assert response.status == 401, (method, path)
        body = await response.json()
        message = body["error"] if path.startswith("/v2/") else body["message"]
        assert "on a server with tenants, need a management token" in message
