"""Tabular inputs over real HTTP (the app in process): what a DataFrame model refuses, and how;
missing values where a model takes none; the describe call's inputs; a custom handler that takes
requests as they came. Other models keep serving through every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import joblib
import numpy as np
import pytest

from tests.integration.harness import Harness, Serve, describe, error_of
from tests.models import make_linear_model
from tests.tabular_models import make_pipeline_model

RAW_HANDLER = """\
import json


def predict(model, requests):
    out = []
    for request in requests:
        if request.content_type.startswith("text/plain"):
            out.append((request.body.upper(), "text/plain"))
        else:
            out.append({"length": len(request.body), "type": request.content_type})
    return out
"""


@pytest.fixture
async def tabular(serve: Serve, tmp_path: Path) -> Harness:
    store = tmp_path / "store"
    store.mkdir()
    make_pipeline_model(store / "pipeline")
    make_linear_model(store / "linear")
    raw = store / "raw"
    raw.mkdir()
    (raw / "model.py").write_text(RAW_HANDLER)
    (raw / "serving.properties").write_text("option.raw_input=true\n")
    strict = store / "strict"
    make_pipeline_model(strict)
    (strict / "serving.properties").write_text("option.missing_values=refuse\n")
    return await serve(model_store=str(store))


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (
            [{"city": "paris", "agee": 30, "income": 1.0}],
            "application/json",
            "record 0: column 'agee' is not one of model pipeline's columns (city, age, income)",
        ),
        (
            [{"city": "paris", "income": 1.0}],
            "application/json",
            "record 0 lacks column 'age'",
        ),
        (
            [{"city": "paris", "age": 1, "income": 1.0}, {"city": 7, "age": 1, "income": 1.0}],
            "application/json",
            "column 'city', row 1: 7 is a number; the model takes a string in this column",
        ),
        (
            [{"city": "paris", "age": "old", "income": 1.0}],
            "application/json",
            "column 'age', row 0: 'old' is a string; the model takes a number in this column",
        ),
        (
            [["paris", 1.0], ["lyon", 2.0, 3.0]],
            "application/json",
            "row 0 has 2 values; model pipeline takes 3 column(s) (city, age, income)",
        ),
        (
            [{"city": "paris", "age": 1, "income": 1.0}, ["lyon", 2.0, 3.0]],
            "application/json",
            "record 1 is a JSON array; expected an object of column: value",
        ),
        (
            b"city,age,wage\nparis,1,2\n",
            "text/csv; header=present",
            "column 'wage' is not one of model pipeline's columns",
        ),
        (
            b"city,age\nparis,1\n",
            "text/csv; header=present",
            "column 'income' is missing of the header",
        ),
        (
            [{"city": "berlin", "age": 1, "income": 1.0}],
            "application/json",
            "column 'city', row 0: 'berlin' is not a category the model knows",
        ),
        (
            [{"city": None, "age": 1, "income": 1.0}],
            "application/json",
            "column 'city', row 0: the value is missing, and the model does not take missing "
            "values in this column",
        ),
        (
            b"city,age,income\nparis,1,x\n",
            "text/csv; header=present",
            "column 'income', line 1: 'x' is not a number",
        ),
    ],
)
async def test_bad_inputs_are_400s_that_name_what_is_wrong(
    tabular: Harness, body: object, content_type: str, message: str
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await tabular.post("/predictions/pipeline", data, content_type)
    error = await error_of(response)
    assert response.status == 400, error
    assert message in error["message"]
    # Nothing else changed: the model and its neighbour answer.
    ok = await tabular.post("/predictions/pipeline", b'[["paris", 30, 300]]')
    assert ok.status == 200 and len(json.loads(await ok.read())["predictions"]) == 1
    assert (await tabular.post("/predictions/linear", b"[[0.5]]")).status == 200


async def test_missing_values_where_taken_and_refused_where_configured(tabular: Harness) -> None:
    gap = b'[{"city": "paris", "age": null, "income": 300}]'
    assert (await tabular.post("/predictions/pipeline", gap)).status == 200
    response = await tabular.post("/predictions/strict", gap)
    assert response.status == 400
    assert "column 'age', row 0: the value is missing" in (await error_of(response))["message"]
    # A model fitted on arrays that cannot take NaN refuses it; an infinity never passes.
    for body in (b"[[null]]", b"[[NaN]]", b'{"instances": [[0.5], [null]]}'):
        response = await tabular.post("/predictions/linear", body)
        error = await error_of(response)
        assert response.status == 400, error
        assert "does not take missing values" in error["message"]


async def test_describe_and_metadata_list_the_columns(tabular: Harness) -> None:
    assert (await tabular.post("/predictions/pipeline", b'[["paris", 30, 300]]')).status == 200
    described = await describe(tabular, "pipeline")
    assert described["inputs"] == [
        {
            "name": "city",
            "kind": "string",
            "missing": False,
            "categories": ["lyon", "nice", "paris"],
        },
        {"name": "age", "kind": "number", "missing": True},
        {"name": "income", "kind": "number", "missing": True},
    ]
    metadata = await (await tabular.client.get("/v2/models/pipeline")).json()
    assert [(i["name"], i["datatype"]) for i in metadata["inputs"]] == [
        ("city", "BYTES"),
        ("age", "FP64"),
        ("income", "FP64"),
    ]


async def test_a_raw_handler_gets_the_request_as_it_came(tabular: Harness) -> None:
    response = await tabular.post("/predictions/raw", b"hello", "text/csv; header=present")
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(await response.read()) == {
        "length": 5,
        "type": "text/csv; header=present",
    }
    response = await tabular.post(
        "/invocations", b'{"any": "thing"}', **{"X-Amzn-SageMaker-Target-Model": "raw"}
    )
    assert response.status == 200
    response = await tabular.post("/predictions/raw", b"[[1]]", None)
    assert json.loads(await response.read()) == {"length": 5, "type": ""}
    v2 = await tabular.post(
        "/v2/models/raw/infer",
        b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1], "data": [1]}]}',
    )
    assert v2.status == 400
    assert "option.raw_input" in (await v2.json())["error"]
    # An explanation is refused: the handler answers predictions only.
    explained = await tabular.post(
        "/invocations",
        b"[[1]]",
        **{
            "X-Amzn-SageMaker-Target-Model": "raw",
            "X-Amzn-SageMaker-Enable-Explanations": "`true`",
        },
    )
    assert explained.status == 400
    assert "custom handler has no explanation" in (await explained.json())["message"]


def test_a_fast_path_that_differs_on_missing_values_is_kept_for_rows_without(
    tmp_path: Path,
) -> None:
    """A forest fitted with missing values: its converted paths are verified on rows with NaN
    too, and a batch with one goes where the answer is the model's own."""
    from sklearn.ensemble import RandomForestRegressor

    from mmserver.config.server import ModelConfig
    from mmserver.execution.predictor import EstimatorPredictor, load_predictor

    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (300, 3))
    x[rng.random(x.shape) < 0.2] = np.nan
    y = np.nan_to_num(x).sum(axis=1)
    folder = tmp_path / "forest"
    folder.mkdir()
    model = RandomForestRegressor(n_estimators=5, random_state=0).fit(x, y)
    joblib.dump(model, folder / "model.joblib")
    predictor = load_predictor(folder, ModelConfig())
    assert isinstance(predictor, EstimatorPredictor)
    assert predictor.inputs.missing
    rows = np.array([[np.nan, 1.0, 2.0], [0.5, np.nan, np.nan], [1.0, 2.0, 3.0]])
    assert np.asarray(predictor.predict(rows)) == pytest.approx(model.predict(rows))
    for path in predictor.plan.finite_only:
        assert path in predictor.plan.uses or path in predictor.plan.measured
