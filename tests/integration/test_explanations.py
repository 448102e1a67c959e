"""Explanations over real HTTP, through the three doors: boto3's ``invoke_endpoint`` with
``EnableExplanations`` (SageMaker Clarify's answer, records explained only where the expression
is true), KServe V1's ``:explain`` verb and the Open Inference Protocol's ``explain`` parameter
giving the same numbers; the method in ``GET /models/NAME``; a model with none answering 400."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.ensemble import RandomForestRegressor
from sklearn.neighbors import KNeighborsRegressor

from tests.integration.harness import Harness, Serve, describe
from tests.integration.test_boto3 import invoke, runtime_client
from tests.integration.test_grpc import GrpcServe, fp64, infer, outputs_of
from tests.models import tree_models

shap = pytest.importorskip("shap")

X, Y, _ = tree_models.data(rows=300)
ROWS = X[:3]


@pytest.fixture(scope="module")
def explained_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("explained")
    forest = RandomForestRegressor(n_estimators=25, max_depth=6, random_state=0).fit(X, Y)
    tree_models.write_pickle(root / "forest", forest)
    tree_models.write_pickle(root / "knn", KNeighborsRegressor().fit(X, Y))
    return root


@pytest.fixture
async def explaining(serve: Serve, explained_store: Path) -> Harness:
    return await serve(model_store=str(explained_store))


def forest_reference(explained_store: Path) -> tuple[np.ndarray, float]:
    import joblib

    forest = joblib.load(explained_store / "forest" / "model.joblib")
    explainer = shap.TreeExplainer(forest)
    return explainer.shap_values(ROWS), float(np.ravel(explainer.expected_value)[0])


async def test_three_doors_give_the_same_numbers(
    explaining: Harness, explained_store: Path
) -> None:
    reference, base = forest_reference(explained_store)
    names = [f"x{j}" for j in range(X.shape[1])]
    rows = json.dumps(ROWS.tolist())

    response = await explaining.post("/v1/models/forest:explain", f'{{"instances": {rows}}}')
    assert response.status == 200, await response.text()
    kserve = (await response.json())["explanations"]
    assert [e["method"] for e in kserve] == ["tree_shap"] * 3 and kserve[0]["exact"] is True
    kserve_values = np.array([[e["attributions"][n] for n in names] for e in kserve])
    np.testing.assert_allclose(kserve_values, reference, atol=1e-6)
    for explanation, values in zip(kserve, kserve_values, strict=True):
        assert explanation["base_value"] == pytest.approx(base, abs=1e-6)
        assert base + values.sum() == pytest.approx(explanation["prediction"], abs=1e-6)

    v2_body = {
        "inputs": [
            {
                "name": "x",
                "shape": list(ROWS.shape),
                "datatype": "FP64",
                "data": ROWS.ravel().tolist(),
            }
        ],
        "parameters": {"explain": True},
    }
    response = await explaining.post("/v2/models/forest/infer", json.dumps(v2_body))
    assert response.status == 200, await response.text()
    outputs = {o["name"]: o for o in (await response.json())["outputs"]}
    attributions = outputs["attributions"]
    assert attributions["shape"] == list(ROWS.shape)
    assert attributions["parameters"]["columns"] == names
    v2_values = np.array(attributions["data"]).reshape(ROWS.shape)
    np.testing.assert_allclose(v2_values, kserve_values, atol=1e-12)

    client = runtime_client(explaining)
    csv = "\n".join(",".join(map(repr, row)) for row in ROWS.tolist())
    answer = await invoke(
        client,
        TargetModel="forest",
        Body=csv.encode(),
        ContentType="text/csv",
        Accept="text/csv",
        EnableExplanations="`true`",
    )
    clarify = json.loads(answer["Payload"])
    assert clarify["version"] == "1.0"
    assert clarify["predictions"]["content_type"] == "text/csv; charset=utf-8"
    records = clarify["explanations"]["kernel_shap"]
    clarify_values = np.array(
        [[f["attributions"][0]["attribution"][0] for f in record] for record in records]
    )
    assert [f["feature_header"] for f in records[0]] == names
    np.testing.assert_allclose(clarify_values, kserve_values, atol=1e-12)


async def test_clarify_explains_only_where_the_expression_is_true(explaining: Harness) -> None:
    client = runtime_client(explaining)
    body = json.dumps(ROWS.tolist()).encode()
    plain = await invoke(client, TargetModel="forest", Body=body, ContentType="application/json")
    predictions = json.loads(plain["Payload"])["predictions"]
    threshold = sorted(predictions)[1]  # one record below it, two at or above
    answer = await invoke(
        client,
        TargetModel="forest",
        Body=body,
        ContentType="application/json",
        EnableExplanations=f"[0]>=`{threshold!r}`",
    )
    clarify = json.loads(answer["Payload"])
    assert json.loads(clarify["predictions"]["data"]) == {"predictions": predictions}
    records = clarify["explanations"]["kernel_shap"]
    assert [bool(r) for r in records] == [p >= threshold for p in predictions]
    answer = await invoke(
        client,
        TargetModel="forest",
        Body=body,
        ContentType="application/json",
        EnableExplanations="`false`",
    )
    assert json.loads(answer["Payload"])["explanations"] == {}


async def test_the_method_is_described_and_a_model_without_one_is_refused(
    explaining: Harness,
) -> None:
    response = await explaining.post("/v1/models/knn:explain", json.dumps(ROWS.tolist()))
    assert response.status == 400
    message = (await response.json())["error"]
    assert "no background sample (explain_background.csv beside the model" in message
    knn = await describe(explaining, "knn")
    assert knn["explanation"]["method"] == "none"
    assert "explain_background.csv" in knn["explanation"]["missing"]
    response = await explaining.post("/predictions/forest", json.dumps(ROWS.tolist()))
    assert response.status == 200
    forest = await describe(explaining, "forest")
    assert forest["explanation"] == {"method": "tree_shap", "exact": True}


async def test_the_v2_parameter_over_grpc_gives_the_same_numbers(
    grpc_serve: GrpcServe, explained_store: Path
) -> None:
    reference, _ = forest_reference(explained_store)
    node = await grpc_serve(model_store=str(explained_store))
    request = infer("forest", fp64(ROWS))
    request.parameters["explain"].bool_param = True
    response = await node.call("ModelInfer", request)
    outputs = outputs_of(response)
    assert outputs["attributions"].shape == ROWS.shape
    np.testing.assert_allclose(outputs["attributions"], reference, atol=1e-6)
    [attributions] = [o for o in response.outputs if o.name == "attributions"]
    columns = json.loads(attributions.parameters["columns"].string_param)
    assert columns == [f"x{j}" for j in range(X.shape[1])]
