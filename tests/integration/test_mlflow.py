"""MLflow model folders (README, *Model families*): what ``mlflow.sklearn.save_model`` and
``mlflow.xgboost.save_model`` write is served as it is, the flavour's file loaded as its family
loads it, the signature's columns the model's input (records, CSV with a header, V2 per column),
its input example shown; an MLmodel that names no flavour mmserver serves, or a file outside its
folder, fails that model's load only."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import mlflow.sklearn
import numpy as np
import pandas as pd
import pytest
from mlflow.models import infer_signature
from sklearn.linear_model import LinearRegression, LogisticRegression

from tests.integration.harness import Harness, Serve, describe, error_of
from tests.models import make_linear_model

_FRAME = pd.DataFrame(
    {"age": [20.0, 35.0, 50.0, 65.0, 30.0, 45.0], "income": [1.0, 3.0, 2.0, 5.0, 4.0, 2.5]}
)
_LABELS = np.array([0, 0, 1, 1, 0, 1])


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    store = tmp_path_factory.mktemp("mlflow") / "store"
    store.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MLflow's own deprecation warnings under pandas 3
        return _save(store)


def _save(store: Path) -> tuple[Path, dict[str, Any]]:
    # A classifier fitted on a DataFrame, saved as MLflow 3 saves it (skops), with its example.
    churn = LogisticRegression().fit(_FRAME, _LABELS)
    mlflow.sklearn.save_model(
        churn,
        store / "churn",
        signature=infer_signature(_FRAME, churn.predict(_FRAME)),
        input_example=_FRAME.head(2),
    )
    # A regressor fitted on an array, pickled (cloudpickle, as MLflow 2 saved by default): the
    # signature alone names its columns.
    matrix = _FRAME.to_numpy()
    spend = LinearRegression().fit(matrix, matrix @ np.array([2.0, 10.0]) + 1.0)
    mlflow.sklearn.save_model(
        spend,
        store / "spend",
        serialization_format="cloudpickle",
        signature=infer_signature(_FRAME, spend.predict(matrix)),
    )
    # An MLmodel of a flavour mmserver does not serve, and one naming a file outside its folder.
    foreign = store / "foreign"
    foreign.mkdir()
    (foreign / "MLmodel").write_text(
        "flavors:\n  python_function:\n    loader_module: mlflow.pytorch\n    data: data\n"
        "  pytorch:\n    model_data: data\n"
    )
    escaping = store / "escaping"
    escaping.mkdir()
    (escaping / "MLmodel").write_text(
        "flavors:\n  sklearn:\n    pickled_model: ../spend/model.pkl\n"
        "    serialization_format: cloudpickle\n"
    )
    make_linear_model(store / "neighbour")
    own = {
        "churn": churn.predict(_FRAME).tolist(),
        "churn_proba": churn.predict_proba(_FRAME).tolist(),
        "spend": spend.predict(matrix).tolist(),
    }
    return store, own


@pytest.fixture
async def harness(serve: Serve, mlflow_store: tuple[Path, dict[str, Any]]) -> Harness:
    return await serve(model_store=str(mlflow_store[0]))


def _records() -> bytes:
    return json.dumps(_FRAME.to_dict(orient="records")).encode()


async def test_a_folder_mlflow_wrote_is_served_by_records_csv_and_v2_columns(
    harness: Harness, mlflow_store: tuple[Path, dict[str, Any]]
) -> None:
    _, own = mlflow_store
    for name in ("churn", "spend"):
        response = await harness.post(f"/predictions/{name}", _records())
        assert response.status == 200, await response.text()
        assert (await response.json())["predictions"] == pytest.approx(own[name])
        csv = _FRAME.to_csv(index=False).encode()
        response = await harness.post(f"/predictions/{name}", csv, "text/csv; header=present")
        assert response.status == 200, await response.text()
        # MLflow's own scoring form.
        split = {"dataframe_split": json.loads(_FRAME.to_json(orient="split", index=False))}
        response = await harness.post(f"/predictions/{name}", json.dumps(split).encode())
        assert response.status == 200, await response.text()
        assert (await response.json())["predictions"] == pytest.approx(own[name])
    # V2, one input per column of the signature.
    body = {
        "inputs": [
            {
                "name": column,
                "datatype": "FP64",
                "shape": [len(_FRAME)],
                "data": list(_FRAME[column]),
            }
            for column in _FRAME.columns
        ]
    }
    response = await harness.post("/v2/models/spend/infer", json.dumps(body).encode())
    assert response.status == 200, await response.text()
    [output] = (await response.json())["outputs"]
    assert output["data"] == pytest.approx(own["spend"])
    metadata = await (await harness.client.get("/v2/models/spend")).json()
    assert [(i["name"], i["datatype"]) for i in metadata["inputs"]] == [
        ("age", "FP64"),
        ("income", "FP64"),
    ]


async def test_describe_shows_the_format_columns_and_input_example(harness: Harness) -> None:
    assert (await harness.post("/predictions/churn", _records())).status == 200
    described = await describe(harness, "churn")
    assert described["status"] == "Healthy"
    assert described["format"] == "skops"
    assert described["family"] == "sklearn"
    assert [c["name"] for c in described["inputs"]] == ["age", "income"]
    assert described["inputExample"] == {
        "columns": ["age", "income"],
        "data": [[20.0, 1.0], [35.0, 3.0]],
    }
    assert (await harness.post("/predictions/spend", _records())).status == 200
    spend = await describe(harness, "spend")
    assert spend["format"] == "pickle" and "inputExample" not in spend
    assert spend["trust"] == "restricted"  # its cloudpickle file loaded as any pickle


async def test_an_mlmodel_mmserver_cannot_serve_fails_that_model_only(harness: Harness) -> None:
    response = await harness.post("/predictions/foreign", _records())
    assert response.status == 500
    message = (await error_of(response))["message"]
    assert message.startswith(
        "model foreign failed to load: MLmodel's flavours (python_function, pytorch) are none "
        "mmserver serves: sklearn, xgboost, lightgbm"
    )
    response = await harness.post("/predictions/escaping", _records())
    assert response.status == 500
    assert (
        "'../spend/model.pkl' must be a file inside the model folder"
        in ((await error_of(response))["message"])
    )
    response = await harness.post("/predictions/neighbour", b"[[1.0]]")
    assert response.status == 200
