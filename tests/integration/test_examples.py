"""``mmserver example-store DIR`` writes models that a server answers as their sources say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mmserver.cli import main
from mmserver.commands.examples import EXAMPLES
from tests.integration.harness import Harness, Serve


@pytest.fixture
async def examples(serve: Serve, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Harness:
    store = tmp_path / "store"
    assert main(["example-store", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {', '.join(EXAMPLES)} into {store}")
    assert f"mmserver serve --model-store {store}" in out
    return await serve(model_store=str(store))


async def predictions(server: Harness, model: str, body: Any) -> Any:
    response = await server.post(f"/predictions/{model}", json.dumps(body))
    assert response.status == 200, await response.text()
    return (await response.json())["predictions"]


async def test_every_example_answers(examples: Harness) -> None:
    [iris] = await predictions(examples, "iris-classifier", [[5.1, 3.5, 1.4, 0.2]])
    assert sum(iris) == pytest.approx(1.0)
    assert iris[0] > 0.9  # a setosa
    [scaled] = await predictions(examples, "pipeline-scaler", [[1.0, 1.0, 1.0]])
    assert scaled == pytest.approx(0.0, abs=0.05)  # x0 + 2 x1 - 3 x2
    [custom] = await predictions(examples, "custom-handler", [[0.5]])
    assert custom["value"] == pytest.approx(2.0, abs=0.05)
    assert custom["doubled"] == pytest.approx(2 * custom["value"], abs=1e-3)  # rounded to 4
    [tuned] = await predictions(examples, "tuned-linear", [[0.5]])
    assert tuned == pytest.approx(2.0, abs=0.05)
    response = await examples.client.get("/models/tuned-linear")
    assert (await response.json())[0]["models"][0]["batchSize"] == 8  # its serving.properties


async def test_the_dataframe_example_takes_records_with_missing_values(examples: Harness) -> None:
    leaving, staying = await predictions(
        examples,
        "customer-churn",
        [
            {"plan": "basic", "region": "eu", "tenure_months": 2, "monthly_spend": None},
            {"plan": "team", "region": "us", "tenure_months": 48, "monthly_spend": 120.0},
        ],
    )
    assert sum(leaving) == pytest.approx(1.0)
    assert leaving[1] > 0.5 > staying[1]  # the class 1 probability: churn
    response = await examples.post(
        "/predictions/customer-churn", json.dumps([{"plan": "basic", "region": "eu"}])
    )
    assert response.status == 400
    assert "tenure_months" in (await response.json())["message"]


def test_a_directory_that_cannot_be_written_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["example-store", str(blocker / "store")]) == 2
    assert capsys.readouterr().err.startswith(f"mmserver: cannot write the examples into {blocker}")
