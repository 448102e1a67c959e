"""The pages over real HTTP: the OpenAPI 3.1 document (valid by openapi-spec-validator, every
route of the route table in it, every path of it answered), Swagger UI's page and files from the
package, a model's document with its columns and an example that the server answers, and the
status page's data after traffic, behind the management token on a server with tenants. (The
pages rendered in Chromium: tests/e2e/test_pages_browser.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openapi_spec_validator import validate

from mmserver.api.protocols import ROUTES, plain_path
from tests.integration.harness import Harness, Serve, error_of
from tests.models import make_linear_model
from tests.tabular_models import make_pipeline_model

MANAGEMENT = "the-management-token"


async def _document(server: Harness, path: str = "/openapi.json") -> dict[str, Any]:
    response = await server.client.get(path)
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    document: dict[str, Any] = await response.json()
    return document


async def test_the_document_is_valid_openapi_and_names_every_route(server: Harness) -> None:
    document = await _document(server)
    validate(document)  # raises on any departure from OpenAPI 3.1
    assert document["openapi"] == "3.1.0"
    described = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert described == {(r.method, plain_path(r.path)) for r in ROUTES}
    infer = document["paths"]["/v2/models/{model}/infer"]["post"]
    assert infer["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/V2InferenceRequest"
    }
    assert infer["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/V2Error"
    }
    predict = document["paths"]["/predictions/{model}"]["post"]
    assert predict["responses"]["503"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    options = await server.client.options("/")
    assert options.status == 200
    assert await options.json() == document  # TorchServe's habit


async def test_every_path_of_the_document_is_answered(serve: Serve, tmp_path: Path) -> None:
    store = tmp_path / "store"
    for version in ("1", "2"):
        make_linear_model(store / "versioned" / version)
    server = await serve(model_store=str(store), state_dir=str(tmp_path / "state"))
    target = {"X-Amzn-SageMaker-Target-Model": "versioned"}
    accepted = await server.post("/endpoints/versioned/async-invocations", "[[0.5]]", **target)
    assert accepted.status == 202, await accepted.text()
    values = {
        "model": "versioned",
        "version": "2",
        "endpoint": "versioned",
        "inference_id": (await accepted.json())["InferenceId"],
        "asset": "swagger-ui.css",
    }
    document = await _document(server)
    calls = [
        (method.upper(), re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path))
        for path, item in document["paths"].items()
        for method in item
    ]
    # The unloads last, a version's before its model's.
    calls.sort(key=lambda call: (call[0] == "DELETE", -len(call[1]) if call[0] == "DELETE" else 0))
    for method, concrete in calls:
        if method == "DELETE":  # something loaded for it to unload
            assert (await server.post("/predictions/versioned", "[[0.5]]")).status == 200
        response = await server.client.request(method, concrete, data=b"[[0.5]]", headers=target)
        assert response.status != 404, (
            f"{method} {concrete}: {response.status} {await response.text()}"
        )
    assert len(calls) == len(ROUTES)


async def test_swagger_ui_is_served_from_the_package(server: Harness) -> None:
    page = await server.client.get("/docs")
    assert page.status == 200 and page.content_type == "text/html"
    text = await page.text()
    assert '<script src="/docs/swagger-ui-bundle.js"></script>' in text
    assert 'url: "/openapi.json"' in text
    assert "http" not in text.replace("http-equiv", "")  # no other host named
    bundle = await server.client.get("/docs/swagger-ui-bundle.js")
    assert bundle.status == 200 and bundle.content_type == "application/javascript"
    assert b"SwaggerUIBundle" in (await bundle.read())[:4000]
    css = await server.client.get("/docs/swagger-ui.css")
    assert css.status == 200 and css.content_type == "text/css"
    missing = await server.client.get("/docs/../../etc/passwd")
    assert missing.status == 404
    unknown = await server.client.get("/docs/index.html")
    assert unknown.status == 404
    assert "is not a file of the documentation page" in (await error_of(unknown))["message"]


async def test_a_models_document_describes_its_columns_and_its_example_is_answered(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    make_pipeline_model(store / "tabular-pipeline")
    make_linear_model(store / "sklearn-1")
    server = await serve(model_store=str(store))
    document = await _document(server, "/v2/models/tabular-pipeline/openapi.json")
    validate(document)
    body = document["paths"]["/predictions/tabular-pipeline"]["post"]["requestBody"]
    content = body["content"]["application/json"]
    record = content["schema"]["items"]
    assert set(record["properties"]) == {"city", "age", "income"}
    assert record["properties"]["city"]["examples"][:1] == [content["example"][0]["city"]]
    assert record["properties"]["city"]["description"] == "string; a value is required"
    assert record["properties"]["age"]["description"] == "number; missing values taken"
    answer = await server.post("/predictions/tabular-pipeline", json.dumps(content["example"]))
    assert answer.status == 200, await answer.text()
    v2 = document["paths"]["/v2/models/tabular-pipeline/infer"]["post"]["requestBody"]
    v2_example = v2["content"]["application/json"]["example"]
    v2_answer = await server.post("/v2/models/tabular-pipeline/infer", json.dumps(v2_example))
    assert v2_answer.status == 200, await v2_answer.text()
    matrix = await _document(server, "/v2/models/sklearn-1/openapi.json")
    rows = matrix["paths"]["/predictions/sklearn-1"]["post"]["requestBody"]["content"]
    assert rows["application/json"]["example"] == [[0.0]]  # the row its load probes
    page = await server.client.get("/v2/models/sklearn-1/docs")
    assert page.status == 200
    assert 'url: "/v2/models/sklearn-1/openapi.json"' in await page.text()
    assert (await server.client.get("/v2/models/no-such-model/docs")).status == 404


async def test_the_status_data_counts_the_traffic(server: Harness) -> None:
    before = await (await server.client.get("/status.json")).json()  # the counters' first reading
    assert before["models"] == []
    for _ in range(3):
        assert (await server.post("/predictions/sklearn-5", "[[0.5]]")).status == 200
    assert (await server.post("/predictions/sklearn-5", "[[1, 2, 3]]")).status == 400
    response = await server.client.get("/status.json", params={"filter": "sklearn-5"})
    assert response.status == 200
    data = await response.json()
    [row] = [m for m in data["models"] if m["name"] == "sklearn-5"]
    assert (row["status"], row["requests"], row["errors"], row["last_minute"]) == (
        "READY",
        3,
        1,
        3,
    )
    assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"]
    assert row["workers"] >= 1 and row["lane"] == "light"
    assert data["server"]["models_loaded"] >= 1
    assert data["server"]["memory_budget_bytes"] > 0
    assert data["recent"]["loads"] == 1  # sklearn-5's, since the first reading
    assert all(m["name"].find("sklearn-5") >= 0 for m in data["models"])
    page = await server.client.get("/status")
    assert page.status == 200 and "/status.json" in await page.text()
    bad = await server.client.get("/status.json", params={"page": "two"})
    assert bad.status == 400
    assert "page must be a whole number, got 'two'" in (await error_of(bad))["message"]


async def test_with_tenants_the_pages_follow_the_access_rules(serve: Serve, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  acme: {models: [sklearn-1], tokens: [tok-acme-0001]}\n")
    server = await serve(tenants=str(tenants), management_token=MANAGEMENT)
    acme = {"Authorization": "Bearer tok-acme-0001"}
    assert (await server.client.get("/v2/models/sklearn-1/docs", headers=acme)).status == 200
    other = await server.client.get("/v2/models/sklearn-2/openapi.json", headers=acme)
    assert other.status == 403
    assert (await server.client.get("/v2/models/sklearn-1/docs")).status == 401
    assert (await server.client.get("/status.json", headers=acme)).status == 401
    operator = await server.client.get(
        "/status.json", headers={"Authorization": f"Bearer {MANAGEMENT}"}
    )
    assert operator.status == 200
    assert (await server.client.get("/openapi.json")).status == 200  # names no model
