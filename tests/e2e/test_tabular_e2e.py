"""The models users have, served by the real ``mmserver serve`` with backend processes: a
DataFrame pipeline with a string column and gaps, an XGBoost booster trained with missing values
(SageMaker's ``xgboost-model`` in a ``.tar.gz``), a HistGradientBoosting model, and a LightGBM
model with a categorical column. Every accepted form answers what the model's own predict answers
on the same DataFrame, through plain HTTP, boto3 (CSV) and tritonclient (one input per column)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import numpy as np
import pandas as pd
import pytest
import tritonclient.http as triton
from botocore.config import Config

from tests.e2e.server_process import ServerProcess
from tests.tabular_models import (
    ROWS_OF_CUSTOMERS,
    lightgbm_frame,
    make_hist_gradient_boosting,
    make_lightgbm_categorical,
    make_pipeline_model,
    make_xgboost_archive,
    missing_rows,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROWS = ROWS_OF_CUSTOMERS


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Any]:
    store = tmp_path / "store"
    store.mkdir()
    return {
        "store": store,
        "pipeline": make_pipeline_model(store / "pipeline"),
        "xgb": make_xgboost_archive(store / "xgb-missing.tar.gz"),
        "hgb": make_hist_gradient_boosting(store / "hgb"),
        "lgbm": make_lightgbm_categorical(store / "lgbm-cat"),
    }


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    out = frame.to_dict(orient="records")
    return [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in out
    ]


async def predictions(session: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": kw.pop("content_type", "application/json"), **kw}
    async with session.post(url, data=data, headers=headers) as response:
        text = await response.text()
        assert response.status == 200, text
        return json.loads(text)["predictions"]


async def test_every_form_answers_as_the_model(models: dict[str, Any], tmp_path: Path) -> None:
    pipeline = models["pipeline"]
    want = pipeline.predict(ROWS).tolist()
    rows = [[r["city"], r["age"], r["income"]] for r in records(ROWS)]
    split = {"columns": ["income", "city", "age"], "data": [[r[2], r[0], r[1]] for r in rows]}
    csv_body = ROWS.to_csv(index=False).encode()
    async with (
        ServerProcess(
            models["store"], tmp_path / "server.log", "--backend-processes", "2"
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        url = f"{server.url}/predictions/pipeline"
        forms: list[tuple[Any, dict[str, str]]] = [
            (rows, {}),
            (records(ROWS), {}),
            ({"dataframe_split": split}, {}),
            ({"dataframe_records": records(ROWS)}, {}),
            ({"instances": records(ROWS)}, {}),
            ({"inputs": {c: [r[c] for r in records(ROWS)] for c in ROWS.columns}}, {}),
            (csv_body, {"content_type": "text/csv; header=present"}),
        ]
        for body, headers in forms:
            assert await predictions(session, url, body, **headers) == want, body

        # The answer to a batch of several requests is each request's own.
        answers = await asyncio.gather(
            *(predictions(session, url, [record]) for record in records(ROWS))
        )
        assert [a[0] for a in answers] == want

        # Missing values, natively: HistGradientBoosting and XGBoost.
        x, _ = missing_rows(rows=5, seed=9)
        hgb = await predictions(session, f"{server.url}/predictions/hgb", _nulls(x))
        assert hgb == pytest.approx(models["hgb"].predict(x).tolist())
        libsvm = "\n".join(
            "0 " + " ".join(f"{j}:{v}" for j, v in enumerate(row) if v == v) for row in x
        ).encode()
        xgb_want = models["xgb"].predict(_dmatrix(x)).tolist()
        # SageMaker's xgboost-model answers as its container: a CSV line unless JSON is asked.
        async with session.post(
            f"{server.url}/predictions/xgb-missing",
            data=libsvm,
            headers={"Content-Type": "text/libsvm"},
        ) as response:
            assert response.status == 200 and response.content_type == "text/csv"
            got = [float(v) for v in (await response.text()).split(",")]
        assert got == pytest.approx(xgb_want, rel=1e-6)

        # LightGBM's categorical column, by name.
        frame = lightgbm_frame(rows=4, seed=11)
        body = [
            {"color": str(c), "size": float(s)}
            for c, s in zip(frame["color"], frame["size"], strict=True)
        ]
        got = await predictions(session, f"{server.url}/predictions/lgbm-cat", body)
        assert got == models["lgbm"].predict(frame).tolist()

        # What V2 metadata tells a client to send.
        async with session.get(f"{server.url}/v2/models/pipeline") as response:
            metadata = await response.json()
        assert metadata["inputs"] == [
            {"name": "city", "datatype": "BYTES", "shape": [-1]},
            {"name": "age", "datatype": "FP64", "shape": [-1]},
            {"name": "income", "datatype": "FP64", "shape": [-1]},
        ]

        await asyncio.to_thread(_boto3_csv, server.url, models, x)
        await asyncio.to_thread(_tritonclient_columns, server.url, want)


def _nulls(x: np.ndarray) -> list[list[float | None]]:
    return [[None if v != v else float(v) for v in row] for row in x]


def _dmatrix(x: np.ndarray) -> Any:
    import xgboost

    return xgboost.DMatrix(x)


def _boto3_csv(url: str, models: dict[str, Any], x: np.ndarray) -> None:
    """boto3 unmodified: CSV with empty fields to the SageMaker XGBoost model, CSV with a header
    line to the pipeline."""
    client = boto3.session.Session().client(
        "sagemaker-runtime",
        region_name="us-east-1",
        endpoint_url=url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 0}),
    )
    body = "\n".join(",".join("" if v != v else repr(float(v)) for v in row) for row in x)
    want = models["xgb"].predict(_dmatrix(x)).tolist()
    response = client.invoke_endpoint(
        EndpointName="mme", TargetModel="xgb-missing.tar.gz", Body=body.encode()
    )
    assert response["ContentType"] == "text/csv"
    got = [float(v) for v in response["Body"].read().decode().split(",")]
    assert got == pytest.approx(want, rel=1e-6)
    response = client.invoke_endpoint(
        EndpointName="mme",
        TargetModel="xgb-missing.tar.gz",
        Body=body.encode(),
        ContentType="text/csv",
        Accept="application/json",
    )
    assert json.loads(response["Body"].read()) == pytest.approx(want, rel=1e-6)
    response = client.invoke_endpoint(
        EndpointName="mme",
        TargetModel="pipeline",
        Body=ROWS.to_csv(index=False).encode(),
        ContentType="text/csv; header=present",
        Accept="text/csv",
    )
    lines = response["Body"].read().decode().split()
    assert [int(v) for v in lines] == models["pipeline"].predict(ROWS).tolist()
    error = None
    try:
        client.invoke_endpoint(
            EndpointName="mme",
            TargetModel="pipeline",
            Body=b"town,age,income\nparis,1,2\n",
            ContentType="text/csv; header=present",
        )
    except client.exceptions.ValidationError as exc:
        error = str(exc)
    assert error is not None and "column 'town' is not one of model pipeline's columns" in error


def _tritonclient_columns(url: str, want: list[int]) -> None:
    """tritonclient unmodified: one input per column, BYTES for the strings, as MLServer's
    pandas codec sends a DataFrame."""
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        city = triton.InferInput("city", [3], "BYTES")
        city.set_data_from_numpy(np.array([b"paris", b"nice", b"lyon"], dtype=object))
        age = triton.InferInput("age", [3], "FP64")
        age.set_data_from_numpy(ROWS["age"].to_numpy(dtype=np.float64))
        income = triton.InferInput("income", [3], "FP64")
        income.set_data_from_numpy(ROWS["income"].to_numpy(dtype=np.float64), binary_data=False)
        result = client.infer("pipeline", [income, city, age])
        assert result.as_numpy("predict").tolist() == want
    finally:
        client.close()
