"""Restricted unpickling: the models of every allowed library load as they are; a pickle that
names anything else fails before that thing is imported or called, naming it."""

from __future__ import annotations

import fractions
import os
import pickle
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pandas as pd
import pytest
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import (
    GradientBoostingClassifier,
    HistGradientBoostingClassifier,
    RandomForestRegressor,
)
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import FunctionTransformer, OneHotEncoder, StandardScaler

from mmserver.config.model import ModelConfig
from mmserver.config.trust import Trust, server_trust
from mmserver.errors import ConfigError, UntrustedModel
from mmserver.execution.families import load_pickle
from mmserver.execution.predictor import load_predictor
from mmserver.execution.unpickling import allowed, restricted_load

RNG = np.random.default_rng(0)
X = RNG.normal(size=(60, 4))
Y = (X[:, 0] > 0).astype(int)
FRAME = pd.DataFrame(
    {
        "age": RNG.integers(18, 80, 60).astype(float),
        "city": RNG.choice(["north", "south", "east"], 60),
        "income": RNG.normal(50, 10, 60),
    }
)
FRAME.loc[3, "income"] = np.nan


def _models() -> dict[str, tuple[Any, Any]]:
    """name -> (fitted model, the input its predictions are compared on)."""
    frame_pipe = Pipeline(
        [
            (
                "prep",
                ColumnTransformer(
                    [
                        ("onehot", OneHotEncoder(handle_unknown="ignore"), ["city"]),
                        (
                            "num",
                            make_pipeline(SimpleImputer(), StandardScaler()),
                            ["age", "income"],
                        ),
                    ]
                ),
            ),
            ("clf", GradientBoostingClassifier(n_estimators=5)),
        ]
    ).fit(FRAME, FRAME.age > 40)
    categorical = FRAME.assign(city=FRAME.city.astype("category"))
    texts = ["apple banana", "banana cherry", "cherry date", "date apple"]
    models: dict[str, tuple[Any, Any]] = {
        "linear": (LinearRegression().fit(X, X @ [1, 2, 3, 4]), X),
        "forest": (RandomForestRegressor(n_estimators=4).fit(X, Y), X),
        "hist": (HistGradientBoostingClassifier(max_iter=4).fit(X, Y), X),
        "hist-categorical": (
            HistGradientBoostingClassifier(max_iter=3, categorical_features="from_dtype").fit(
                categorical, Y
            ),
            categorical,
        ),
        "knn": (KNeighborsClassifier().fit(X, Y), X),
        "frame-pipeline": (frame_pipe, FRAME),
        "ufunc": (
            make_pipeline(FunctionTransformer(np.log1p), LinearRegression()).fit(abs(X), Y),
            abs(X),
        ),
        "text": (
            make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, [0, 1, 0, 1]),
            texts,
        ),
    }
    try:
        import lightgbm
        import xgboost
    except ImportError:
        return models
    models["xgboost-wrapper"] = (xgboost.XGBClassifier(n_estimators=3).fit(X, Y), X)
    models["lightgbm-wrapper"] = (
        lightgbm.LGBMRegressor(n_estimators=3, verbose=-1).fit(categorical, Y),
        categorical,
    )
    models["xgboost-booster"] = (
        xgboost.train({}, xgboost.DMatrix(X, label=Y), 3),
        xgboost.DMatrix(X),
    )
    models["lightgbm-booster"] = (
        lightgbm.train({"verbose": -1}, lightgbm.Dataset(X, label=Y), 3),
        X,
    )
    return models


MODELS = _models()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("how", ["joblib", "joblib-compressed", "pickle-4", "pickle-2"])
def test_allowed_models_load_and_predict_as_saved(tmp_path: Path, name: str, how: str) -> None:
    model, batch = MODELS[name]
    path = tmp_path / "model.joblib"
    if how == "joblib":
        joblib.dump(model, path)
    elif how == "joblib-compressed":
        joblib.dump(model, path, compress=3)
    else:
        path.write_bytes(pickle.dumps(model, protocol=int(how[-1])))
    loaded = restricted_load(path, Trust())
    assert type(loaded) is type(model)
    np.testing.assert_array_equal(loaded.predict(batch), model.predict(batch))


def test_frames_series_and_random_states_load(tmp_path: Path) -> None:
    for value in (FRAME, FRAME.age, np.random.RandomState(3), np.random.default_rng(4)):
        joblib.dump(value, tmp_path / "value.joblib")
        loaded = restricted_load(tmp_path / "value.joblib", Trust())
        assert type(loaded) is type(value)
    pd.testing.assert_frame_equal(restricted_load(_dumped(tmp_path, FRAME), Trust()), FRAME)


def _dumped(tmp_path: Path, value: Any, name: str = "model.joblib") -> Path:
    path = tmp_path / name
    joblib.dump(value, path)
    return path


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


class _NumpyLoad:
    def __reduce__(self) -> Any:
        return (np.load, ("/etc/hostname",))


class _Memmap:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (np.memmap, (str(self.marker), "uint8", "w+", 0, (4,)))


def _hostile(marker: Path) -> dict[str, tuple[Any, str]]:
    """name -> (what is pickled, the global its refusal names)."""
    model = LinearRegression().fit([[0.0], [1.0]], [0.0, 1.0])
    objects = np.empty(2, dtype=object)  # read by joblib's nested unpickler
    objects[:] = [1, _System(marker)]
    return {
        "system": ({"model": model, "payload": _System(marker)}, f"{os.name}.system"),
        "eval": ([model, _Eval(marker)], "builtins.eval"),
        "numpy-load": ([model, _NumpyLoad()], "numpy.load"),
        "memmap": ([_Memmap(marker)], "numpy.memmap"),
        "object-array": (objects, f"{os.name}.system"),
        "fraction": (fractions.Fraction(1, 3), "fractions.Fraction"),
    }


@pytest.mark.parametrize(
    "case", ["system", "eval", "numpy-load", "memmap", "object-array", "fraction"]
)
def test_hostile_pickles_are_refused_naming_the_global(tmp_path: Path, case: str) -> None:
    marker = tmp_path / "pwned"
    value, global_name = _hostile(marker)[case]
    path = _dumped(tmp_path, value)
    # Trusting some other name changes nothing.
    for trust in (Trust(), Trust(types=frozenset({"collections.Counter"}))):
        with pytest.raises(UntrustedModel) as refused:
            load_pickle(path, trust)
        assert f"model.joblib needs {global_name}," in refused.value.message
        assert f"trusted_types={global_name}" in refused.value.message
    assert not marker.exists()


def test_numpy_1_ufunc_rebuilder_returns_ufuncs_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # numpy 1.x's _ufunc_reconstruct(module, name) asked for os.system.
    gadget = (
        b"cnumpy.core\n_ufunc_reconstruct\n(Vos\nVsystem\ntR(Vtouch "
        + str(marker).encode()
        + b"\ntR."
    )
    (tmp_path / "model.pkl").write_bytes(gadget)
    with pytest.raises(UntrustedModel, match=r"needs os\.system"):
        restricted_load(tmp_path / "model.pkl", Trust())
    assert not marker.exists()
    log1p = b"cnumpy.core\n_ufunc_reconstruct\n(Vnumpy\nVlog1p\ntR."
    (tmp_path / "ufunc.pkl").write_bytes(log1p)
    assert restricted_load(tmp_path / "ufunc.pkl", Trust()) is np.log1p


def test_booster_classes_are_rebuilt_never_called(tmp_path: Path) -> None:
    xgboost = pytest.importorskip("xgboost")
    model_file = tmp_path / "other.json"
    booster = xgboost.train({}, xgboost.DMatrix(X, label=Y), 2)
    booster.save_model(model_file)

    class _ReadsAFile:
        def __reduce__(self) -> Any:
            return (xgboost.Booster, (None, None, str(model_file)))

    path = _dumped(tmp_path, _ReadsAFile())
    with pytest.raises(
        UntrustedModel, match=r"calls xgboost\.core\.Booster, which may read a file"
    ):
        restricted_load(path, Trust())
    # The same call through copyreg's rebuilder of protocols 0 and 1 (base.__init__(state)).
    through = b"ccopyreg\n_reconstructor\n(cxgboost.core\nBooster\ncxgboost.core\nBooster\nNtR."
    (tmp_path / "through.pkl").write_bytes(through)
    with pytest.raises(
        UntrustedModel, match=r"calls xgboost\.core\.Booster, which may read a file"
    ):
        restricted_load(tmp_path / "through.pkl", Trust())


def test_trusted_types_and_full_trust_load_what_is_otherwise_refused(tmp_path: Path) -> None:
    path = _dumped(tmp_path, [fractions.Fraction(1, 3)])
    with pytest.raises(UntrustedModel):
        load_pickle(path, Trust())
    trusting = Trust(types=frozenset({"fractions.Fraction"}))
    assert load_pickle(path, trusting)[0] == [fractions.Fraction(1, 3)]
    assert load_pickle(path, Trust(full=True))[0] == [fractions.Fraction(1, 3)]


def test_allowed_imports_nothing_it_refuses() -> None:
    assert allowed("numpy", "load") is None
    assert allowed("numpy.lib.npyio", "NpzFile") is None
    assert allowed("pandas.io.pytables", "HDFStore") is None
    assert allowed("sklearn.tree", "export_graphviz") is None
    assert allowed("builtins", "getattr") is None
    assert allowed("sklearn.linear_model", "LinearRegression") is LinearRegression
    assert allowed("numpy", "log1p") is np.log1p
    assert allowed("fractions", "Fraction", frozenset({"fractions.Fraction"})) is (
        fractions.Fraction
    )


def test_trust_from_the_server_options() -> None:
    trust = server_trust("fractions.Fraction, mypkg.MyTransformer", "team-a-*,special")
    assert trust.types == {"fractions.Fraction", "mypkg.MyTransformer"}
    assert not trust.full
    assert trust.of("team-a-churn").full
    assert trust.of("team-a-churn").because == "trusted_models=team-a-*"
    assert trust.of("special/2").full  # a version is its model's
    assert not trust.of("team-b").full
    assert not trust.of("specialist").full
    assert server_trust("", "*").of("anything").full
    assert not server_trust("", "").of("anything").full
    with pytest.raises(ConfigError, match="trusted_types: 'Fraction' is not an importable name"):
        server_trust("Fraction", "")
    with pytest.raises(ConfigError, match="trusted_models: 'a b' is not a model name"):
        server_trust("", "a b")


def test_a_vectorizer_that_opens_the_files_its_requests_name_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("apple banana")
    reads = make_pipeline(TfidfVectorizer(input="filename"), LogisticRegression())
    docs = [tmp_path / f"d{i}.txt" for i in range(4)]
    texts = ["apple banana", "banana cherry", "cherry date", "date apple"]
    for doc, text in zip(docs, texts, strict=True):
        doc.write_text(text)
    reads.fit([str(d) for d in docs], [0, 1, 0, 1])
    path = _dumped(tmp_path, reads)
    with pytest.raises(UntrustedModel) as refused:
        load_pickle(path, Trust())
    assert refused.value.message == (
        "model.joblib holds a TfidfVectorizer with input='filename', which opens the files its "
        "requests name; it loads only for a model trusted_models names"
    )
    assert load_pickle(path, Trust(full=True))[0].predict([str(secret)]).shape == (1,)


def _skops_dir(tmp_path: Path, model: Any, name: str = "model.skops") -> Path:
    import skops.io

    folder = tmp_path / "skops-model"
    folder.mkdir(exist_ok=True)
    skops.io.dump(model, folder / name)
    return folder


@pytest.mark.parametrize("name", ["linear", "hist", "frame-pipeline", "knn"])
def test_skops_files_load_as_the_pickle_of_the_same_estimator(tmp_path: Path, name: str) -> None:
    model, batch = MODELS[name]
    folder = _skops_dir(tmp_path, model)
    predictor = load_predictor(folder, ModelConfig(), "m")
    assert predictor.family == "sklearn"
    assert predictor.file_format == "skops"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    joblib.dump(model, pickled / "model.joblib")
    same = load_predictor(pickled, ModelConfig(), "m")
    rows = same.sample() if isinstance(batch, pd.DataFrame) else np.asarray(batch, np.float64)
    np.testing.assert_array_equal(predictor.predict(rows), same.predict(rows))
    assert predictor.inputs == same.inputs  # the same columns, kinds and missing values
    assert predictor.describe()["family"] == same.describe()["family"] == "sklearn"


def test_a_skops_file_with_an_untrusted_function_is_refused_naming_it(tmp_path: Path) -> None:
    import operator

    model = make_pipeline(FunctionTransformer(operator.neg), LinearRegression()).fit(X, Y)
    folder = _skops_dir(tmp_path, model)
    with pytest.raises(UntrustedModel) as refused:
        load_predictor(folder, ModelConfig(), "m")
    assert refused.value.message.startswith("model.skops needs _operator.neg, which a model's")
    assert "trusted_types=_operator.neg" in refused.value.message
    trusting = ModelConfig(trust=Trust(types=frozenset({"_operator.neg"})))
    assert load_predictor(folder, trusting, "m").predict(X[:2]).shape == (2,)
    assert load_predictor(folder, ModelConfig(trust=Trust(full=True)), "m").file_format == "skops"
