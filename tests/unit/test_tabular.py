"""What a model takes, found at load, and requests that must be their own 400 and never fail
their batch: real models fitted here, requests through the backends' batch answering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pandas as pd
import pytest

from mmserver.backend.batching import answer_batch
from mmserver.codecs.answers import answer_body
from mmserver.codecs.requests import make_request
from mmserver.codecs.v2 import V2
from mmserver.config.server import ModelConfig
from mmserver.execution.handlers import Predictor
from mmserver.execution.predictor import EstimatorPredictor, load_predictor
from tests.tabular_models import COLUMNS, ROWS_OF_CUSTOMERS, make_pipeline_model


def loaded(folder: Path, model: Any) -> Predictor:
    folder.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, folder / "model.joblib")
    return load_predictor(folder, ModelConfig())


def answers(predictor: Predictor, *bodies: Any) -> list[Any]:
    """Each body's answer from one batch: the decoded JSON, or the error tuple."""
    requests = []
    for body in bodies:
        if isinstance(body, tuple):
            requests.append(make_request(body[0], body[1], None))
        else:
            requests.append(make_request(json.dumps(body).encode(), None, None))

    def predict(batch: Any, output: str | None = None) -> Any:
        return predictor.predict(batch) if output is None else predictor.output(output, batch)

    out = answer_batch(requests, predict, predictor.inputs, "m", predictor.outputs)
    return [json.loads(a)["predictions"] if isinstance(a, bytes) else a for a in out]


def test_a_model_that_fails_on_plain_values_is_sent_no_missing_values(tmp_path: Path) -> None:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    x = np.abs(np.random.default_rng(0).normal(5, 1, (50, 2)))
    model = make_pipeline(FunctionTransformer(np.log), LogisticRegression())
    predictor = loaded(tmp_path / "log", model.fit(x, x[:, 0] > 5))
    assert not predictor.inputs.missing
    good, gap = answers(predictor, [[5.0, 6.0]], [[None, 6.0]])
    assert good == model.predict([[5.0, 6.0]]).tolist()
    assert gap[0] == "InvalidInput" and "does not take missing values" in gap[1]


def test_number_categories_of_an_encoder_that_fails_on_others_are_checked(tmp_path: Path) -> None:
    from sklearn.compose import make_column_transformer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder

    frame = pd.DataFrame({"store": [10, 20, 30, 10], "x": [1.0, 2.0, 3.0, 4.0]})
    prep = make_column_transformer((OneHotEncoder(), ["store"]), remainder="passthrough")
    predictor = loaded(
        tmp_path / "stores", make_pipeline(prep, LogisticRegression()).fit(frame, [0, 1, 0, 1])
    )
    good, unknown = answers(predictor, [{"store": 20, "x": 1.0}], [{"store": 99, "x": 1.0}])
    assert len(good) == 1
    assert unknown == (
        "InvalidInput",
        "column 'store', row 0: 99.0 is not a category the model knows (10, 20, 30)",
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            [{"city": "paris", "age": int("9" * 400), "income": 1.0}],
            "is a number; the model takes a number within a float's range",
        ),
        (
            {
                "inputs": [
                    {"name": "input-0", "datatype": "FP64", "shape": [1, 3], "data": [1, 2, 3]}
                ]
            },
            "input 'input-0' is not one of model m's columns; it takes one input per column",
        ),
        (
            {"inputs": [{"name": "city", "datatype": "BYTES", "shape": [2**62], "data": ["p"]}]},
            "has 4611686018427387904 value(s) by its shape, but its data has 1",
        ),
        ([{"city": ["paris"], "age": 1, "income": 1.0}], "['paris'] is an array"),
    ],
)
def test_bad_cells_are_their_own_400(tmp_path: Path, body: Any, message: str) -> None:
    model = make_pipeline_model(tmp_path / "pipe")
    predictor = load_predictor(tmp_path / "pipe", ModelConfig())
    request = (json.dumps(body).encode(), V2) if "inputs" in body else body
    if isinstance(request, tuple):
        got = answer_batch(
            [make_request(b'[["paris", 30, 300]]', None, None), (request[0], V2, False)],
            lambda batch, output=None: predictor.predict(batch),
            predictor.inputs,
            "m",
            predictor.outputs,
        )
        assert isinstance(got[0], bytes)
        error = got[1]
    else:
        ok, error = answers(predictor, [["paris", 30, 300]], request)
        asked = pd.DataFrame([["paris", 30.0, 300.0]], columns=COLUMNS)
        assert ok == model.predict(asked).tolist()
    assert isinstance(error, tuple) and error[0] == "InvalidInput"
    assert message in error[1]


def test_lightgbm_categories_follow_the_model_s_own_list(tmp_path: Path) -> None:
    """A categorical feature LightGBM never split on is still one of its categorical ones."""
    import lightgbm

    rng = np.random.default_rng(4)
    frame = pd.DataFrame(
        {
            "const": pd.Categorical(["only"] * 200),
            "color": pd.Categorical(rng.choice(["red", "green", "blue"], 200)),
            "size": rng.normal(10, 3, 200),
        }
    )
    target = ((frame["color"] == "red") | (frame["size"] > 12)).astype(int)
    model = lightgbm.LGBMClassifier(n_estimators=8, min_child_samples=5, verbose=-1)
    predictor = loaded(tmp_path / "lgbm", model.fit(frame, target))
    assert [(c.name, c.kind, c.categories) for c in predictor.inputs.columns] == [
        ("const", "category", ("only",)),
        ("color", "category", ("blue", "green", "red")),
        ("size", "number", None),
    ]
    colors = ["red", "blue", "green"]
    body = [{"const": "only", "color": c, "size": 11.0} for c in colors]
    same = pd.DataFrame(
        {
            "const": pd.Categorical(["only"] * 3, categories=["only"]),
            "color": pd.Categorical(colors, categories=["blue", "green", "red"]),
            "size": [11.0] * 3,
        }
    )
    assert answers(predictor, body)[0] == model.predict(same).tolist()


def test_a_compiled_pipeline_answers_as_the_pipeline(tmp_path: Path) -> None:
    model = make_pipeline_model(tmp_path / "pipe")
    predictor = load_predictor(tmp_path / "pipe", ModelConfig())
    assert isinstance(predictor, EstimatorPredictor)
    assert predictor.plan.uses - {"own"}, predictor.plan.rejected
    frame = ROWS_OF_CUSTOMERS
    got = answers(
        predictor,
        [[r.city, r.age if r.age == r.age else None, r.income] for r in frame.itertuples()],
    )
    assert got[0] == model.predict(frame).tolist()


def test_a_csv_answer_that_starts_like_a_typed_one_is_sent_whole(tmp_path: Path) -> None:
    from sklearn.tree import DecisionTreeClassifier

    x = np.array([[0.0], [1.0]])
    predictor = loaded(tmp_path / "labels", DecisionTreeClassifier().fit(x, ["\x01abc", "b"]))
    (raw,) = answer_batch(
        [make_request(b"[[0.0]]", None, "text/csv")],
        lambda batch, output=None: predictor.predict(batch),
        predictor.inputs,
        "m",
        predictor.outputs,
    )
    assert isinstance(raw, bytes)
    assert answer_body(raw, True) == (b"\x01abc\n", "text/csv; charset=utf-8")
