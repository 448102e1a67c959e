"""Model families: which file of a folder is the model, ``engine`` and ``option.model_file``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from mmserver.config.server import ModelConfig, model_config_from_properties
from mmserver.errors import ConfigError, ModelLoadError
from mmserver.execution.families import (
    FAMILIES,
    LIGHTGBM,
    MLFLOW,
    ONNX,
    SKLEARN,
    SKOPS,
    XGBOOST,
    XGBoostBooster,
    engine_families,
    family_named,
    find_model_file,
    owner,
    wanted_files,
)
from mmserver.execution.predictor import EstimatorPredictor, load_predictor
from mmserver.lifecycle.files import prepare
from mmserver.store.local import ModelStore
from tests.models import make_linear_model, tree_models

xgboost = pytest.importorskip("xgboost")
pytest.importorskip("lightgbm")

DEFAULTS = ModelConfig(max_workers=2)


def config_for(props: dict[str, str]) -> ModelConfig:
    return model_config_from_properties(props, DEFAULTS, "test serving.properties")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    booster = tree_models.xgboost_booster()
    out = {
        "json": root / "json",
        "ubj": root / "ubj",
        "sagemaker": root / "sagemaker",
        "lightgbm": root / "lightgbm",
        "mixed": root / "mixed",
    }
    for kind in ("json", "ubj", "sagemaker"):
        tree_models.write_xgboost(out[kind], booster, kind)
    tree_models.write_lightgbm(out["lightgbm"], tree_models.lightgbm_booster())
    # A folder with a pickle and both boosters: the pickle first, unless engine says.
    make_linear_model(out["mixed"])
    shutil.copy(out["json"] / "model.json", out["mixed"] / "model.json")
    shutil.copy(out["lightgbm"] / "model.txt", out["mixed"] / "model.txt")
    (out["mixed"] / "notes.txt").write_text("not a model\n")
    return out


@pytest.mark.parametrize(
    ("folder", "props", "family", "file"),
    [
        ("json", {}, XGBOOST, "model.json"),
        ("ubj", {}, XGBOOST, "model.ubj"),
        ("sagemaker", {}, XGBOOST, "xgboost-model"),
        ("lightgbm", {}, LIGHTGBM, "model.txt"),
        ("mixed", {}, SKLEARN, "model.joblib"),
        ("mixed", {"engine": "XGBoost"}, XGBOOST, "model.json"),
        ("mixed", {"engine": "lightgbm"}, LIGHTGBM, "model.txt"),
        ("mixed", {"engine": "Python"}, SKLEARN, "model.joblib"),
        ("mixed", {"option.model_file": "model.txt"}, LIGHTGBM, "model.txt"),
        ("mixed", {"option.model_file": "model.json"}, XGBOOST, "model.json"),
    ],
)
def test_the_family_comes_from_the_files_or_the_properties(
    folders: dict[str, Path], folder: str, props: dict[str, str], family: str, file: str
) -> None:
    found = find_model_file(folders[folder], config_for(props))
    assert found is not None
    assert (found.family, found.path.name) == (family, file)


def test_a_sagemaker_xgboost_model_answers_as_its_booster(folders: dict[str, Path]) -> None:
    predictor = load_predictor(folders["sagemaker"], DEFAULTS)
    assert isinstance(predictor, EstimatorPredictor)
    assert predictor.n_features == tree_models.FEATURES
    rows = np.random.default_rng(1).normal(size=(5, tree_models.FEATURES))
    booster = xgboost.Booster()
    booster.load_model(bytearray((folders["sagemaker"] / "xgboost-model").read_bytes()))
    assert np.array_equal(predictor.predict(rows), booster.predict(xgboost.DMatrix(rows)))
    assert predictor.describe()["family"] == XGBOOST


def test_bad_model_files_say_what_is_wrong(tmp_path: Path, folders: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"option.model_file='\.\./x' must be a file inside"):
        load_predictor(folders["mixed"], config_for({"option.model_file": "../x"}))
    with pytest.raises(ModelLoadError, match=r"option.model_file='nope.json' does not exist"):
        load_predictor(folders["mixed"], config_for({"option.model_file": "nope.json"}))
    with pytest.raises(ModelLoadError, match=r"has no model file \(model.txt or a single"):
        load_predictor(folders["json"], config_for({"engine": "LightGBM"}))
    with pytest.raises(
        ModelLoadError, match=r"notes\.txt cannot be loaded as a lightgbm model: LightGBMError"
    ):
        load_predictor(
            folders["mixed"], config_for({"option.model_file": "notes.txt", "engine": "LightGBM"})
        )
    with pytest.raises(
        ModelLoadError, match=r"has no predict_proba; option\.method must be one of: predict"
    ):
        load_predictor(folders["json"], config_for({"option.method": "predict_proba"}))


def test_a_missing_package_names_what_to_install(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "lightgbm", None)
    with pytest.raises(ModelLoadError) as info:
        load_predictor(folders["lightgbm"], DEFAULTS)
    assert info.value.message == (
        "model.txt is a lightgbm model: the lightgbm package is not installed; install it with "
        "pip install 'mmserver[lightgbm]' (or pip install lightgbm)"
    )


def test_a_pickled_wrapper_predicts_on_one_thread(tmp_path: Path) -> None:
    import json

    from mmserver.execution.families import wrap_booster

    X, y, _ = tree_models.data(200)
    wrapper = xgboost.XGBRegressor(n_estimators=5).fit(X, y)  # nthread 0: every core
    served = wrap_booster(wrapper)
    config = json.loads(served.get_booster().save_config())
    assert config["learner"]["generic_param"]["nthread"] == "1"
    assert served.get_params()["n_jobs"] == 1
    assert np.array_equal(served.predict(X), wrapper.predict(X))


def test_a_boosters_signature_is_what_it_answers() -> None:
    from mmserver.execution.families import XGBoostBooster
    from mmserver.execution.predictor import signature

    booster = XGBoostBooster(tree_models.xgboost_booster(objective="multi:softprob"))
    predictor = EstimatorPredictor(booster, "predict", "m", family=XGBOOST)
    [facts] = signature(predictor)["outputs"]
    answer = predictor.predict(np.zeros((4, booster.n_features_in_)))
    assert facts == {"name": "predict", "dtype": answer.dtype.str, "shape": [-1, 3]}
    assert answer.dtype == np.float32 and answer.shape == (4, 3)


@pytest.mark.parametrize(
    ("engine", "families"),
    [
        (None, [MLFLOW, SKOPS, SKLEARN, XGBOOST, LIGHTGBM, ONNX]),
        ("MLflow", [MLFLOW]),
        ("skops", [SKOPS]),
        ("Python", [SKLEARN]),
        ("SKLEARN", [SKLEARN]),
        (" xgboost ", [XGBOOST]),
        ("LightGBM", [LIGHTGBM]),
        ("OnnxRuntime", [ONNX]),
        ("onnx", [ONNX]),
    ],
)
def test_the_engine_chooses_the_families_tried(engine: str | None, families: list[str]) -> None:
    assert [f.name for f in engine_families(engine)] == families


def test_an_engine_no_family_spells_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        engine_families("PyTorch", "m/serving.properties")
    assert info.value.message == (
        "m/serving.properties: engine='PyTorch' must be one of MLflow, skops, Python, sklearn, "
        "XGBoost, LightGBM, OnnxRuntime, onnx"
    )
    # The load's file work says it before the model reaches a backend.
    folder = make_linear_model(tmp_path / "store" / "m")
    (folder / "serving.properties").write_text("engine=PyTorch\n")
    store = ModelStore(tmp_path / "store", tmp_path / "cache", 1 << 20)
    entry = store.find("m")
    assert entry is not None
    with pytest.raises(ConfigError, match=r"m/serving.properties: engine='PyTorch' must be one"):
        prepare(store, entry, DEFAULTS)


def test_every_family_is_one_whole_record() -> None:
    spellings = [e.lower() for family in FAMILIES for e in family.engines]
    assert len(spellings) == len(set(spellings))
    assert [f.name for f in FAMILIES if f.claims is None] == [SKLEARN]  # reads what others don't
    for family in FAMILIES:
        assert family.wanted in wanted_files(None)
        assert wanted_files(family.engines[0]) == family.wanted
        # A family with a package of its own loads its own format and runs its own boosters;
        # a tree library's boosters have a native predict and convert to treelite.
        if family.package is not None:
            assert family.load is not None and family.owns is not None
            assert family.feature_names is not None
        if family.name in (XGBOOST, LIGHTGBM):
            assert family.native is not None and family.treelite is not None


def test_a_booster_is_told_by_its_family_whatever_wraps_it() -> None:
    booster = tree_models.xgboost_booster()
    assert owner(XGBoostBooster(booster)) is family_named(XGBOOST)
    assert owner(LinearRegression()) is None
