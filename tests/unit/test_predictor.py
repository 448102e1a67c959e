"""Model handlers on real scikit-learn models: the default one and custom ``model.py`` files."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest

from mmserver.config.server import ModelConfig, load_model_config, model_config_from_properties
from mmserver.config.trust import Trust
from mmserver.errors import ModelError, ModelLoadError, UntrustedModel
from mmserver.execution.predictor import EstimatorPredictor, load_predictor, signature
from tests.models import (
    make_classifier_dir,
    make_custom_handler_dir,
    make_linear_model,
    make_pipeline_dir,
    make_tuned_dir,
)

# Custom handlers run only for models the operator trusts: these tests load them trusted (the
# restricted loads: tests/unit/test_unpickling.py and the server's tests).
DEFAULTS = ModelConfig(max_workers=2, trust=Trust(full=True, because="trusted_models=*"))


def config_for(props: dict[str, str]) -> ModelConfig:
    return model_config_from_properties(props, DEFAULTS, "test serving.properties")


def write_handler(folder: Path, source: str, name: str = "model.py") -> Path:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(source)
    return folder


# ------------------------------------------------------------------------------------------------
# Default handler
# ------------------------------------------------------------------------------------------------


def test_linear_model_predicts_two_at_half(tmp_path: Path) -> None:
    predictor = load_predictor(make_linear_model(tmp_path / "lin"), DEFAULTS)
    assert predictor.n_features == 1
    out = predictor.predict(np.array([[0.5], [0.0], [1.0]]))
    assert isinstance(out, np.ndarray)
    assert out.shape == (3,)
    assert out[0] == pytest.approx(2.0, abs=0.02)
    assert out[1] == pytest.approx(1.0, abs=0.02)
    assert out[2] == pytest.approx(3.0, abs=0.02)


def test_tuned_example_loads_with_its_properties(tmp_path: Path) -> None:
    folder = make_tuned_dir(tmp_path / "tuned")
    config = load_model_config(folder, DEFAULTS)
    assert (config.batch_size, config.max_batch_delay) == (8, 5)
    assert (config.min_workers, config.max_workers, config.job_queue_size) == (1, 2, 100)
    out = load_predictor(folder, config).predict(np.array([[0.5]]))
    assert float(np.asarray(out)[0]) == pytest.approx(2.0, abs=0.02)


def test_classifier_answers_predict_proba(tmp_path: Path) -> None:
    folder = make_classifier_dir(tmp_path / "iris")
    config = load_model_config(folder, DEFAULTS)
    assert config.method == "predict_proba"
    predictor = load_predictor(folder, config)
    assert predictor.n_features == 4
    batch = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])
    out = np.asarray(predictor.predict(batch))
    assert out.shape == (2, 3)
    assert out.sum(axis=1) == pytest.approx([1.0, 1.0])
    assert out.argmax(axis=1).tolist() == [0, 2]  # setosa, virginica


def test_classifier_with_decision_function(tmp_path: Path) -> None:
    folder = make_classifier_dir(tmp_path / "iris")
    predictor = load_predictor(folder, DEFAULTS.replace(method="decision_function"))
    out = np.asarray(predictor.predict(np.array([[5.1, 3.5, 1.4, 0.2]])))
    assert out.shape == (1, 3)
    assert int(out.argmax()) == 0


def test_pipeline_features_and_prediction(tmp_path: Path) -> None:
    predictor = load_predictor(make_pipeline_dir(tmp_path / "pipe"), DEFAULTS)
    assert predictor.n_features == 3
    out = np.asarray(predictor.predict(np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])))
    assert out == pytest.approx([0.0, 1.0], abs=0.05)  # y = x0 + 2 x1 - 3 x2


def test_missing_method_fails_at_load(tmp_path: Path) -> None:
    linear = make_linear_model(tmp_path / "lin")
    with pytest.raises(ModelLoadError) as info:
        load_predictor(linear, DEFAULTS.replace(method="predict_proba"))
    assert info.value.message == (
        "model lin (LinearRegression) has no predict_proba; option.method must be one of: predict"
    )
    pipe = make_pipeline_dir(tmp_path / "pipe")
    with pytest.raises(ModelLoadError, match=r"model pipe \(Pipeline\) has no transform"):
        load_predictor(pipe, DEFAULTS.replace(method="transform"))


def test_other_model_file_names(tmp_path: Path) -> None:
    pkl = make_linear_model(tmp_path / "pkl")
    (pkl / "model.joblib").rename(pkl / "model.pkl")
    assert load_predictor(pkl, DEFAULTS).n_features == 1

    single = make_linear_model(tmp_path / "single")
    (single / "model.joblib").rename(single / "regressor.joblib")
    assert load_predictor(single, DEFAULTS).n_features == 1

    (single / "second.joblib").write_bytes((single / "regressor.joblib").read_bytes())
    with pytest.raises(
        ModelLoadError,
        match=r"has no model file \(an MLflow model \(MLmodel\) of the sklearn, xgboost or "
        r"lightgbm flavour; model\.skops",
    ):
        load_predictor(single, DEFAULTS)


def test_missing_and_broken_model_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError) as info:
        load_predictor(empty, DEFAULTS)
    assert info.value.message == (
        "model empty has no model file (an MLflow model (MLmodel) of the sklearn, xgboost or "
        "lightgbm flavour; model.skops or a single *.skops; "
        "model.joblib, model.pkl or a single *.joblib/*.pkl; "
        "xgboost-model, model.json, model.ubj or a single *.ubj or XGBoost *.json; model.txt "
        "or a single LightGBM *.txt; model.onnx or a single *.onnx), and no model.py"
    )
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_predictor(tmp_path / "nowhere", DEFAULTS)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.joblib").write_bytes(b"\x80\x04 definitely not a pickle")
    with pytest.raises(ModelLoadError) as info:
        load_predictor(broken, DEFAULTS)
    assert info.value.message.startswith("model.joblib cannot be loaded: ")
    assert "Traceback" not in info.value.message


class WarnsOnLoad:
    """Unpickling this warns, as a model pickled by another library version does."""

    def __init__(self) -> None:
        self.version = "0.0"  # some state, so that unpickling calls __setstate__

    def __setstate__(self, state: dict[str, Any]) -> None:
        warnings.warn("pickled by another version", UserWarning, stacklevel=1)
        self.__dict__.update(state)

    def predict(self, batch: np.ndarray) -> np.ndarray:
        return np.zeros(len(batch))


def test_load_warnings_are_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "warns"
    folder.mkdir()
    joblib.dump(WarnsOnLoad(), folder / "model.joblib")
    with caplog.at_level(logging.WARNING, logger="mmserver.execution.predictor"):
        predictor = load_predictor(folder, DEFAULTS)  # warnings are errors in this suite
    assert predictor.n_features is None
    assert np.asarray(predictor.predict(np.zeros((2, 5)))).tolist() == [0.0, 0.0]
    assert any("pickled by another version" in r.getMessage() for r in caplog.records)


def test_model_exceptions_propagate_unchanged(tmp_path: Path) -> None:
    predictor = load_predictor(make_linear_model(tmp_path / "lin"), DEFAULTS)
    with pytest.raises(ValueError, match="features"):
        predictor.predict(np.zeros((1, 3)))


# ------------------------------------------------------------------------------------------------
# Custom handlers
# ------------------------------------------------------------------------------------------------


def test_custom_handler_example(tmp_path: Path) -> None:
    predictor = load_predictor(make_custom_handler_dir(tmp_path / "custom"), DEFAULTS)
    assert predictor.n_features == 1
    out = predictor.predict(np.array([[0.5], [1.0]]))
    assert isinstance(out, list) and len(out) == 2
    assert out[0]["value"] == pytest.approx(2.0, abs=0.02)
    assert out[0]["doubled"] == pytest.approx(4.0, abs=0.04)
    assert out[1]["value"] == pytest.approx(3.0, abs=0.02)


def test_load_gets_the_folder_and_every_property(tmp_path: Path) -> None:
    folder = write_handler(
        tmp_path / "props",
        "def load(model_dir, properties):\n"
        "    return {'dir': model_dir, 'props': properties}\n"
        "def predict(model, batch):\n"
        "    return [[str(model['dir']), model['props'].get('option.scale')]] * len(batch)\n",
    )
    config = config_for({"option.scale": "3", "batch_size": "2"})
    out = load_predictor(folder, config).predict(np.zeros((2, 1)))
    assert out == [[str(folder), "3"], [str(folder), "3"]]


def test_djl_handle_through_option_handler(tmp_path: Path) -> None:
    folder = make_linear_model(tmp_path / "djl")
    write_handler(
        folder,
        "def handle(model, batch):\n    return (model.predict(batch) * 10).tolist()\n",
    )
    predictor = load_predictor(folder, config_for({"option.handler": "handle"}))
    out = predictor.predict(np.array([[0.5]]))
    assert out == [pytest.approx(20.0, abs=0.2)]  # no load(): model.joblib was loaded
    assert predictor.n_features == 1


@pytest.mark.parametrize("entry", ["serve.py", "code/serve.py"])
def test_custom_entry_point_and_no_model(tmp_path: Path, entry: str) -> None:
    folder = write_handler(
        tmp_path / "entry",
        "def predict(model, batch):\n    return [model is None] * len(batch)\n",
        name=entry,
    )
    predictor = load_predictor(folder, config_for({"option.entryPoint": entry}))
    assert predictor.n_features is None
    assert predictor.predict(np.zeros((3, 2))) == [True, True, True]


def test_a_missing_model_folder_is_said(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model folder .*gone does not exist"):
        load_predictor(tmp_path / "gone", DEFAULTS)


def test_two_models_with_model_py_do_not_collide(tmp_path: Path) -> None:
    source = "NAME = {!r}\ndef predict(m, b):\n    return [NAME] * len(b)\n"
    a = write_handler(tmp_path / "a", source.format("a"))
    b = write_handler(tmp_path / "b", source.format("b"))
    pa, pb = load_predictor(a, DEFAULTS), load_predictor(b, DEFAULTS)
    assert pa.predict(np.zeros((1, 1))) == ["a"]
    assert pb.predict(np.zeros((1, 1))) == ["b"]
    # Reloading a changed model.py picks up the change.
    write_handler(a, "def predict(m, b):\n    return ['a2'] * len(b)\n")
    assert load_predictor(a, DEFAULTS).predict(np.zeros((1, 1))) == ["a2"]


def test_handler_imports_its_sibling_modules(tmp_path: Path) -> None:
    folder = write_handler(
        tmp_path / "sib",
        "import sibling_helper_mm\n"
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Scale:\n    k: float\n"
        "def load(model_dir, properties):\n    return Scale(sibling_helper_mm.K)\n"
        "def predict(model, batch):\n    return (batch[:, 0] * model.k).tolist()\n",
    )
    (folder / "sibling_helper_mm.py").write_text("K = 7.0\n")
    path_before = list(sys.path)
    try:
        out = load_predictor(folder, DEFAULTS).predict(np.array([[1.0], [2.0]]))
    finally:
        sys.modules.pop("sibling_helper_mm", None)
    assert out == [7.0, 14.0]
    assert sys.path == path_before


@pytest.mark.parametrize(
    ("source", "props", "expected"),
    [
        (
            "def load(model_dir, properties):\n    return 1\n",
            {},
            "model m: model.py defines no function 'predict' (option.handler)",
        ),
        (
            "def predict(model, batch):\n    return batch\n",
            {"option.handler": "handle"},
            "model m: model.py defines no function 'handle' (option.handler)",
        ),
        ("predict = 42\n", {}, "defines no function 'predict'"),
        (
            "import definitely_not_installed_mm\n",
            {},
            "model.py failed to import: "
            "ModuleNotFoundError: No module named 'definitely_not_installed_mm'",
        ),
        ("x = 1 / 0\n", {}, "model.py failed to import: ZeroDivisionError: division by zero"),
        ("def predict(:\n", {}, "model.py failed to import: SyntaxError"),
        (
            "def load(model_dir, properties):\n    raise RuntimeError('no weights here')\n"
            "def predict(model, batch):\n    return batch\n",
            {},
            "model m: model.py load() failed: RuntimeError: no weights here",
        ),
    ],
)
def test_broken_handlers_fail_with_a_clear_message(
    tmp_path: Path, source: str, props: dict[str, str], expected: str
) -> None:
    folder = write_handler(tmp_path / "m", source)
    modules_before = set(sys.modules)
    with pytest.raises(ModelLoadError) as info:
        load_predictor(folder, config_for(props))
    assert expected in info.value.message
    assert "Traceback" not in info.value.message
    assert not {m for m in set(sys.modules) - modules_before if m.startswith("mmserver_handler")}


def test_bad_entry_points(tmp_path: Path) -> None:
    folder = make_linear_model(tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"option.entryPoint='missing.py' does not exist"):
        load_predictor(folder, config_for({"option.entryPoint": "missing.py"}))
    with pytest.raises(ModelLoadError, match="must be a file inside the model folder"):
        load_predictor(folder, config_for({"option.entryPoint": "../model.py"}))
    with pytest.raises(ModelLoadError, match=r"option\.handler='handle' needs a handler file"):
        load_predictor(folder, config_for({"option.handler": "handle"}))


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return [1]", "model returned 1 rows for 3 inputs"),
        ("return np.zeros((4, 2))", "model returned 4 rows for 3 inputs"),
        ("return []", "model returned 0 rows for 3 inputs"),
        ("return np.float64(1.0)", "model returned float64; expected a list or array"),
        ("return np.array(1.0)", "model returned None rows for 3 inputs"),
        ("return {'a': 1, 'b': 2, 'c': 3}", "model returned dict; expected a list or array"),
        ("return 'abc'", "model returned str"),
    ],
)
def test_wrong_outputs_are_model_errors(tmp_path: Path, body: str, expected: str) -> None:
    folder = write_handler(
        tmp_path / "out", f"import numpy as np\ndef predict(model, batch):\n    {body}\n"
    )
    predictor = load_predictor(folder, DEFAULTS)
    with pytest.raises(ModelError) as info:
        predictor.predict(np.zeros((3, 1)))
    assert expected in info.value.message


def test_tuples_and_iterables_become_lists(tmp_path: Path) -> None:
    folder = write_handler(
        tmp_path / "tup",
        "import numpy as np\ndef predict(model, batch):\n    return tuple(range(len(batch)))\n",
    )
    assert load_predictor(folder, DEFAULTS).predict(np.zeros((2, 1))) == [0, 1]


def test_custom_predict_exceptions_propagate_unchanged(tmp_path: Path) -> None:
    folder = write_handler(
        tmp_path / "raises",
        "class Boom(Exception):\n    pass\ndef predict(model, batch):\n    raise Boom('bad row')\n",
    )
    predictor = load_predictor(folder, DEFAULTS)
    with pytest.raises(Exception, match="bad row") as info:
        predictor.predict(np.zeros((1, 1)))
    assert type(info.value).__name__ == "Boom"


# ------------------------------------------------------------------------------------------------
# Linear regressors: the product without scikit-learn's per-call checks
# ------------------------------------------------------------------------------------------------


def _linear_cases() -> list[tuple[str, Any, int]]:
    from sklearn.linear_model import HuberRegressor, Lars, LinearRegression

    rng = np.random.default_rng(7)
    X = rng.normal(size=(50, 3))
    y = X @ np.array([1.5, -2.0, 0.25]) + 4.0
    Y = np.column_stack([y, 2 * y - 1])
    return [
        ("LinearRegression", LinearRegression().fit(X, y), 3),
        ("LinearRegression, two outputs", LinearRegression().fit(X, Y), 3),
        ("LinearRegression, no intercept", LinearRegression(fit_intercept=False).fit(X, y), 3),
        ("Lars, two outputs", Lars().fit(X, Y), 3),
        ("HuberRegressor", HuberRegressor().fit(X, y), 3),
    ]


@pytest.mark.parametrize("case", _linear_cases(), ids=lambda c: c[0])
def test_linear_regressors_predict_exactly_as_scikit_learn_does(case: tuple[str, Any, int]) -> None:
    _, model, width = case
    predictor = EstimatorPredictor(model, "predict", "m")
    assert predictor.plan.describe()["routes"] == [
        {"fromRows": 1, "toRows": None, "path": "linear"}
    ]
    batch = np.random.default_rng(3).uniform(-100, 100, (33, width))
    assert np.array_equal(predictor.predict(batch), model.predict(batch))


def test_models_whose_predict_is_not_the_linear_product_keep_their_own() -> None:
    from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X = np.array([[0.0], [1.0], [2.0], [3.0]])
    y = np.array([1.0, 3.0, 5.0, 7.0])

    class Clipped(LinearRegression):
        def predict(self, X: Any) -> Any:
            return np.clip(super().predict(X), 0, 4)

    def paths(model: Any) -> set[str]:
        return EstimatorPredictor(model, "predict", "m").plan.uses

    assert paths(Clipped().fit(X, y)) == {"own"}
    assert paths(Ridge().fit(X, y)) == {"own"}  # a predict of its own
    assert paths(LogisticRegression().fit(X, y > 4)) == {"own"}
    tampered = LinearRegression().fit(X, y)
    tampered.coef_ = tampered.coef_.astype(np.float32)  # not the dtype the product is for
    assert paths(tampered) == {"own"}
    # A pipeline's last step qualifies, behind its scaler.
    pipeline = make_pipeline(StandardScaler(), LinearRegression()).fit(X, y)
    assert paths(pipeline) == {"linear"}
    predictor = EstimatorPredictor(pipeline, "predict", "m")
    assert np.array_equal(predictor.predict(X), pipeline.predict(X))


def test_a_loaded_linear_model_answers_through_the_product(tmp_path: Path) -> None:
    predictor = load_predictor(make_linear_model(tmp_path / "m"), DEFAULTS)
    assert isinstance(predictor, EstimatorPredictor)
    assert predictor.plan.uses == {"linear"}
    out = predictor.predict(np.array([[0.5], [2.0]]))
    assert predictor.last_path == "linear"
    assert np.allclose(out, [2.0, 5.0], atol=0.05)


# ------------------------------------------------------------------------------------------------
# Outputs and signature (the V2 API's metadata and requested outputs)
# ------------------------------------------------------------------------------------------------


def test_a_classifier_names_its_methods_as_outputs(tmp_path: Path) -> None:
    folder = make_classifier_dir(tmp_path / "iris")
    predictor = load_predictor(folder, load_model_config(folder, DEFAULTS))
    assert predictor.outputs == ("predict_proba", "predict", "decision_function")
    batch = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])
    assert np.asarray(predictor.output("predict", batch)).tolist() == [0, 2]
    assert np.array_equal(predictor.output("predict_proba", batch), predictor.predict(batch))
    assert signature(predictor) == {
        "platform": "sklearn",
        "format": "pickle",
        "n_features": 4,
        "inputs": None,
        "raw": False,
        "outputs": [
            {"name": "predict_proba", "dtype": "<f8", "shape": [-1, 3]},
            {"name": "predict", "dtype": "<i8", "shape": [-1]},
            {"name": "decision_function", "dtype": "<f8", "shape": [-1, 3]},
        ],
    }


def test_signatures_of_a_regressor_a_pipeline_and_a_custom_handler(tmp_path: Path) -> None:
    linear = load_predictor(make_linear_model(tmp_path / "lin"), DEFAULTS)
    assert signature(linear) == {
        "platform": "sklearn",
        "format": "pickle",
        "n_features": 1,
        "inputs": None,
        "raw": False,
        "outputs": [{"name": "predict", "dtype": "<f8", "shape": [-1]}],
    }
    pipeline = load_predictor(make_pipeline_dir(tmp_path / "pipe"), DEFAULTS)
    assert signature(pipeline)["outputs"] == [{"name": "predict", "dtype": "<f8", "shape": [-1]}]
    custom = load_predictor(make_custom_handler_dir(tmp_path / "custom"), DEFAULTS)
    assert custom.outputs == ("predict",)
    assert signature(custom) == {
        "platform": "python",
        "format": "python",
        "n_features": 1,
        "inputs": None,
        "raw": False,
        "outputs": [{"name": "predict", "dtype": None, "shape": None}],
    }


# ------------------------------------------------------------------------------------------------
# Random forests and extra-trees: the node tables walked by NumPy
# ------------------------------------------------------------------------------------------------


def _forest_cases() -> list[tuple[str, Any, str]]:
    from sklearn import ensemble as e

    rng = np.random.default_rng(11)
    X = rng.normal(size=(300, 4))
    y = X[:, 0] * 3 + np.sin(X[:, 1]) - X[:, 2] * X[:, 3]
    labels = np.array(["low", "mid", "high"])[np.digitize(y, [-1.0, 1.0])]
    return [
        (
            "RandomForestRegressor",
            e.RandomForestRegressor(25, max_depth=9, random_state=0).fit(X, y),
            "predict",
        ),
        (
            "ExtraTreesRegressor, unbounded depth",
            e.ExtraTreesRegressor(15, random_state=0).fit(X, y),
            "predict",
        ),
        (
            "RandomForestClassifier, labels",
            e.RandomForestClassifier(20, random_state=0).fit(X, labels),
            "predict",
        ),
        (
            "ExtraTreesClassifier, probabilities",
            e.ExtraTreesClassifier(20, random_state=0).fit(X, labels),
            "predict_proba",
        ),
    ]


@pytest.mark.parametrize("case", _forest_cases(), ids=lambda c: c[0])
def test_the_forest_walk_answers_bit_for_bit_as_the_forest(case: tuple[str, Any, str]) -> None:
    from mmserver.execution.candidates import WALK_GROUPED_FROM, WALK_ROWS, forest_walk

    _, model, method = case
    built = forest_walk(model)
    assert built is not None
    _, scores, _ = built
    rng = np.random.default_rng(5)
    # Rows on and around the thresholds (where float32 and float64 comparisons part), and more
    # rows than one walk takes at once; fewer rows are walked every tree at once.
    thresholds = np.concatenate([t.tree_.threshold for t in model.estimators_])
    picks = rng.choice(thresholds[thresholds != -2], (WALK_ROWS + 3, 4))
    batch = np.where(rng.random(picks.shape) < 0.5, picks, np.nextafter(picks, np.inf))
    for rows in (batch, batch[: WALK_GROUPED_FROM - 1]):
        got = np.asarray(scores(rows))
        if method == "predict" and hasattr(model, "classes_"):
            got = model.classes_.take(np.argmax(got, axis=1))
            assert got.tolist() == model.predict(rows).tolist()
        else:
            assert np.array_equal(got, getattr(model, method)(rows))
    assert np.array_equal(
        np.asarray(scores(batch[:1])).ravel(),
        np.asarray(
            model.predict_proba(batch[:1])
            if hasattr(model, "classes_")
            else model.predict(batch[:1])
        ).ravel(),
    )
    predictor = EstimatorPredictor(model, method, "m")
    assert "numpy" in predictor.plan.describe()["measuredMillis"]
    assert np.array_equal(predictor.predict(batch), getattr(model, method)(batch))


def test_the_forest_walk_refuses_what_it_does_not_compute() -> None:
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestRegressor

    from mmserver.execution.candidates import forest_walk

    X = np.random.default_rng(2).normal(size=(60, 3))
    two_outputs = RandomForestRegressor(5, random_state=0).fit(X, X[:, :2])
    assert forest_walk(two_outputs) is None
    assert forest_walk(GradientBoostingRegressor(n_estimators=5).fit(X, X[:, 0])) is None
    built = forest_walk(RandomForestRegressor(5, random_state=0).fit(X, X[:, 0]))
    assert built is not None
    with pytest.raises(ValueError, match="expects rows of 3 features"):
        built[1](np.zeros((2, 4)))


def test_a_classifier_on_a_fast_path_keeps_its_other_outputs() -> None:
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

    X = np.random.default_rng(4).normal(size=(200, 3))
    labels = (X[:, 0] > 0).astype(int)
    forest = RandomForestClassifier(10, random_state=0).fit(X, labels)
    predictor = EstimatorPredictor(forest, "predict", "m")
    assert predictor.plan.ranges()[0][2] in {"numpy", "treelite"}  # large batches: maybe its own
    assert "predict_proba" in predictor.outputs
    assert np.array_equal(predictor.output("predict_proba", X), forest.predict_proba(X))
    assert np.array_equal(predictor.predict(X), forest.predict(X))
    # A model with one output only drops the estimator once its trees are converted, unless a
    # chosen path leaves batches with missing values to the estimator's own method.
    regressor = RandomForestRegressor(10, random_state=0).fit(X, X[:, 0])
    lean = EstimatorPredictor(regressor, "predict", "m")
    assert lean.outputs == ("predict",)
    assert (lean.model is None) == ("own" not in lean.plan.uses and not lean.plan.finite_only)
    assert np.array_equal(lean.predict(X), regressor.predict(X))


def test_batches_past_the_measured_sizes_go_to_the_path_cheapest_along_its_last_two() -> None:
    from mmserver.execution.fastpath import LARGE_ROWS, Candidate, Plan, routes

    def fn(batch: np.ndarray) -> np.ndarray:
        return batch[:, 0]

    # Costs in ms as a small forest's are measured: its own predict about the same at any
    # size, the walk cheaper up to the large batch and growing with the rows.
    own = Candidate("own", fn, one_row_s=1.4e-3, batch_s=1.39e-3, large_s=1.38e-3)
    walk = Candidate("numpy", fn, one_row_s=0.08e-3, batch_s=0.17e-3, large_s=0.33e-3)
    plan = Plan(routes([own, walk], 32), 32, measured={"own": (1.4e-3, 1.39e-3, 1.38e-3)})
    assert LARGE_ROWS == 256
    # The walk costs 0.33 + 0.16 / 224 ms a row past 256 rows: 0.88 ms at 1,024, 1.6 at 2,048.
    assert plan.ranges() == [(1, 1024, "numpy"), (1025, None, "own")]
    assert plan.describe()["largeRows"] == 256
    assert plan.describe()["measuredMillis"]["own"] == {"oneRow": 1.4, "batch": 1.39, "large": 1.38}
    # Measured at one row and a full batch only: costs follow that line past it (1.006 ms at
    # 64 rows, past the own predict's 1.0).
    cheap_start = Candidate("treelite", fn, one_row_s=0.01e-3, batch_s=0.5e-3)
    flat = Candidate("own", fn, one_row_s=1.0e-3, batch_s=1.0e-3)
    assert Plan(routes([flat, cheap_start], 32), 32).ranges() == [
        (1, 32, "treelite"),
        (33, None, "own"),
    ]


def test_a_custom_handler_runs_only_for_a_trusted_model(tmp_path: Path) -> None:
    folder = make_custom_handler_dir(tmp_path / "custom")
    marker = tmp_path / "handler-ran"
    (folder / "model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef predict(model, batch):\n    return batch\n"
    )
    restricted = ModelConfig(trust=Trust(models=("team-a-*",)))
    with pytest.raises(UntrustedModel) as refused:
        load_predictor(folder, restricted, "custom")
    assert refused.value.message == (
        "model custom: model.py is a custom handler, code that runs in the server; it runs "
        "only for a model the server's trusted_models option names (now trusted_models=team-a-*)"
    )
    assert not marker.exists()
    load_predictor(folder, DEFAULTS, "custom")
    assert marker.exists()
