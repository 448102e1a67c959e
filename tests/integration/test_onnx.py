"""ONNX models over real HTTP: answers equal onnxruntime's own ``run`` in JSON, CSV and V2
tensors; a classifier's probabilities by ``option.method`` and as a V2 output; a DataFrame
pipeline's per-column inputs as records, CSV with a header and V2 columns; the V2 metadata and
the describe call; a broken graph and a missing onnxruntime fail only their own models."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose

from tests import onnx_models
from tests.integration.harness import Harness, Serve, describe, error_of
from tests.models import make_linear_model

onnx_models.require()


@pytest.fixture(scope="module")
def onnx_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("onnx-store")
    onnx_models.regressor(root / "linear")
    onnx_models.regressor(root / "forest", forest=True)
    onnx_models.classifier(root / "zipmap")
    onnx_models.classifier(root / "tensor", zipmap=False)
    for name, zipmap in (("zipmap-proba", True), ("tensor-proba", False)):
        onnx_models.classifier(root / name, zipmap=zipmap)
        (root / name / "serving.properties").write_text("option.method=predict_proba\n")
    onnx_models.pipeline(root / "pipeline")
    onnx_models.regressor(root / "linear-proba")
    (root / "linear-proba" / "serving.properties").write_text("option.method=predict_proba\n")
    broken = root / "broken"
    broken.mkdir()
    (broken / "model.onnx").write_bytes(b"\x08\x07this is no graph")
    make_linear_model(root / "neighbour")
    return root


@pytest.fixture
async def server(serve: Serve, onnx_store: Path) -> Harness:
    return await serve(model_store=str(onnx_store))


def run(store: Path, name: str, feeds: dict[str, np.ndarray]) -> list[Any]:
    """onnxruntime's own answer of model ``name`` (every output)."""
    answer: list[Any] = onnx_models.session(store / name / "model.onnx").run(None, feeds)
    return answer


async def predictions(server: Harness, name: str, body: str, content_type: str) -> Any:
    response = await server.post(f"/predictions/{name}", body, content_type)
    assert response.status == 200, await response.text()
    return (await response.json())["predictions"]


@pytest.mark.parametrize("name", ["linear", "forest"])
async def test_a_regressor_answers_as_onnxruntime_in_json_and_csv(
    server: Harness, onnx_store: Path, name: str
) -> None:
    rows = onnx_models.rows(10, seed=5)
    [want] = run(onnx_store, name, {"X": rows.astype(np.float32)})
    got = await predictions(server, name, json.dumps(rows.tolist()), "application/json")
    assert_allclose(np.array(got), want, rtol=1e-5)
    csv = "".join(",".join(repr(v) for v in row) + "\n" for row in rows.tolist())
    assert_allclose(np.array(await predictions(server, name, csv, "text/csv")), want, rtol=1e-5)


@pytest.mark.parametrize("name", ["zipmap", "tensor"])
async def test_a_classifier_answers_labels_and_its_probabilities(
    server: Harness, onnx_store: Path, name: str
) -> None:
    rows = onnx_models.rows(8, seed=6)
    label, probabilities = run(onnx_store, name, {"X": rows.astype(np.float32)})
    body = json.dumps(rows.tolist())
    assert await predictions(server, name, body, "application/json") == label.tolist()
    got = np.array(await predictions(server, f"{name}-proba", body, "application/json"))
    assert got.shape == (8, 3)
    assert_allclose(got, onnx_models.probabilities(probabilities), rtol=1e-5)


async def test_v2_takes_the_graphs_tensor_and_answers_its_outputs(
    server: Harness, onnx_store: Path
) -> None:
    rows = onnx_models.rows(3, seed=7).astype(np.float32)
    label, probabilities = run(onnx_store, "zipmap", {"X": rows})
    request = {
        "inputs": [
            {
                "name": "X",
                "datatype": "FP32",
                "shape": list(rows.shape),
                "data": rows.ravel().tolist(),
            }
        ],
        "outputs": [{"name": "predict"}, {"name": "predict_proba"}],
    }
    response = await server.post("/v2/models/zipmap/infer", json.dumps(request))
    assert response.status == 200, await response.text()
    outputs = {o["name"]: o for o in (await response.json())["outputs"]}
    assert (outputs["predict"]["datatype"], outputs["predict"]["shape"]) == ("INT64", [3])
    assert outputs["predict"]["data"] == label.tolist()
    assert (outputs["predict_proba"]["datatype"], outputs["predict_proba"]["shape"]) == (
        "FP32",
        [3, 3],
    )
    proba = np.array(outputs["predict_proba"]["data"]).reshape(3, 3)
    assert_allclose(proba, onnx_models.probabilities(probabilities), rtol=1e-5)


async def test_the_metadata_and_describe_say_the_graph(server: Harness) -> None:
    response = await server.client.get("/v2/models/zipmap")
    assert response.status == 200, await response.text()
    metadata = await response.json()
    assert metadata["platform"] == "onnx"
    assert metadata["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}]
    assert metadata["outputs"] == [
        {"name": "predict", "datatype": "INT64", "shape": [-1]},
        {"name": "predict_proba", "datatype": "FP32", "shape": [-1, 3]},
    ]
    linear = await (await server.client.get("/v2/models/linear")).json()
    assert linear["outputs"] == [{"name": "predict", "datatype": "FP32", "shape": [-1, 1]}]
    pipeline = await (await server.client.get("/v2/models/pipeline")).json()
    assert pipeline["inputs"] == [
        {"name": "city", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "age", "datatype": "FP32", "shape": [-1, 1]},
        {"name": "income", "datatype": "FP32", "shape": [-1, 1]},
    ]
    described = await describe(server, "pipeline")
    assert described["family"] == "onnx"
    assert [(c["name"], c["kind"]) for c in described["inputs"]] == [
        ("city", "string"),
        ("age", "number"),
        ("income", "number"),
    ]


async def test_a_dataframe_pipeline_takes_records_csv_and_v2_columns(
    server: Harness, onnx_store: Path
) -> None:
    frame = onnx_models.customers(6, seed=11)
    label, probabilities = run(onnx_store, "pipeline", onnx_models.feeds(frame))
    records = json.dumps(frame.to_dict(orient="records"))
    assert await predictions(server, "pipeline", records, "application/json") == label.tolist()
    csv = frame.to_csv(index=False)  # a header line, then the rows
    answer = await predictions(server, "pipeline", csv, "text/csv; header=present")
    assert answer == label.tolist()
    shuffled = frame[["income", "city", "age"]]  # named columns go by name, in any order
    csv = shuffled.to_csv(index=False)
    assert await predictions(server, "pipeline", csv, "text/csv; header=present") == answer
    request = {
        "inputs": [
            {"name": "city", "datatype": "BYTES", "shape": [6, 1], "data": list(frame["city"])},
            {"name": "age", "datatype": "FP32", "shape": [6, 1], "data": list(frame["age"])},
            {"name": "income", "datatype": "FP64", "shape": [6], "data": list(frame["income"])},
        ],
        "outputs": [{"name": "predict_proba"}],
    }
    response = await server.post("/v2/models/pipeline/infer", json.dumps(request))
    assert response.status == 200, await response.text()
    [output] = (await response.json())["outputs"]
    got = np.array(output["data"]).reshape(output["shape"])
    assert_allclose(got, probabilities, rtol=1e-5)


async def test_a_pipeline_refuses_what_its_graph_cannot_take(server: Harness) -> None:
    for record, message in (
        (
            {"city": "paris", "age": None, "income": 1.0},
            "column 'age', row 0: the value is missing",
        ),
        ({"city": 3, "age": 30, "income": 1.0}, "column 'city', row 0: 3 is a number"),
        ({"city": "paris", "age": 30}, "record 0 lacks column 'income'"),
    ):
        response = await server.post("/predictions/pipeline", json.dumps([record]))
        assert response.status == 400
        assert message in (await error_of(response))["message"]


async def _load_failure(server: Harness, name: str, body: str) -> str:
    """The message of the 500 a request to ``name`` gets when the model fails to load."""
    response = await server.post(f"/predictions/{name}", body)
    assert response.status == 500
    message: str = (await error_of(response))["message"]
    return message


async def test_a_method_the_graph_lacks_and_a_broken_graph_fail_their_loads(
    server: Harness,
) -> None:
    body = json.dumps(onnx_models.rows(1).tolist())
    message = await _load_failure(server, "linear-proba", body)
    assert "has no predict_proba; option.method must be one of: predict" in message
    assert "outputs variable: tensor(float)" in message
    message = await _load_failure(server, "broken", body)
    assert "model.onnx cannot be loaded as an onnx model: " in message
    assert await predictions(server, "neighbour", "[[1.0]]", "application/json")
    assert await predictions(server, "linear", body, "application/json")


async def test_a_missing_onnxruntime_fails_only_its_models(
    server: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in [m for m in sys.modules if m == "onnxruntime" or m.startswith("onnxruntime.")]:
        monkeypatch.setitem(sys.modules, module, None)
    body = json.dumps(onnx_models.rows(1).tolist())
    message = await _load_failure(server, "forest", body)
    assert "model.onnx is an onnx model: the onnxruntime package is not installed" in message
    assert "pip install 'mmserver[onnx]' (or pip install onnxruntime)" in message
    assert await predictions(server, "neighbour", "[[1.0]]", "application/json")
