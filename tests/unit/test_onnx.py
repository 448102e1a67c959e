"""The ONNX family in the backend: its files and engine, the graph's answers (equal to
onnxruntime's own ``run``), the classifier's probabilities with and without ZipMap, a DataFrame
pipeline's per-column inputs, the graph's description, and the loads that fail and why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

from mmserver.codecs.requests import decode_as
from mmserver.config.server import ModelConfig, model_config_from_properties
from mmserver.errors import ModelLoadError
from mmserver.execution.families import ONNX, find_model_file, missing_extra
from mmserver.execution.onnxgraph import OnnxModel
from mmserver.execution.predictor import EstimatorPredictor, load_predictor, signature
from tests import onnx_models

onnx_models.require()

DEFAULTS = ModelConfig(max_workers=2)


def config_for(props: dict[str, str]) -> ModelConfig:
    return model_config_from_properties(props, DEFAULTS, "test serving.properties")


def load(folder: Path, props: dict[str, str] | None = None) -> EstimatorPredictor:
    predictor = load_predictor(folder, config_for(props or {}))
    assert isinstance(predictor, EstimatorPredictor)
    return predictor


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx")
    onnx_models.regressor(root / "linear")
    onnx_models.regressor(root / "forest", forest=True)
    onnx_models.classifier(root / "zipmap")
    onnx_models.classifier(root / "tensor", zipmap=False)
    onnx_models.pipeline(root / "pipeline")
    onnx_models.pipeline(root / "pipeline-zipmap", zipmap=True)
    return {path.name: path for path in root.iterdir()}


@pytest.mark.parametrize("name", ["linear", "forest"])
def test_a_regressor_answers_as_onnxruntime(folders: dict[str, Path], name: str) -> None:
    predictor = load(folders[name])
    rows = onnx_models.rows(40, seed=3)
    [want] = onnx_models.session(folders[name] / "model.onnx").run(
        None, {"X": rows.astype(np.float32)}
    )
    got = predictor.predict(rows)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (40, 1)
    assert_allclose(got, want, rtol=1e-5)
    assert_allclose(predictor.predict(rows[:1]), want[:1], rtol=1e-5)
    assert predictor.family == ONNX and predictor.n_features == onnx_models.WIDTH
    assert not predictor.inputs.frame
    # One backend process is one core's work: the session runs on one thread.
    model = predictor.model
    assert isinstance(model, OnnxModel)
    options = model.session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)
    assert model.session.get_providers() == ["CPUExecutionProvider"]


@pytest.mark.parametrize("name", ["zipmap", "tensor"])
def test_a_classifier_answers_labels_and_probabilities(folders: dict[str, Path], name: str) -> None:
    rows = onnx_models.rows(25, seed=4)
    label, probabilities = onnx_models.session(folders[name] / "model.onnx").run(
        None, {"X": rows.astype(np.float32)}
    )
    labels = load(folders[name]).predict(rows)
    assert np.array_equal(labels, label)
    proba = load(folders[name], {"option.method": "predict_proba"})
    got = proba.predict(rows)
    assert isinstance(got, np.ndarray) and got.shape == (25, 3)
    assert_allclose(got, onnx_models.probabilities(probabilities), rtol=1e-5)
    assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)
    # Both outputs are there for the V2 API, the method's first.
    assert proba.outputs == ("predict_proba", "predict")
    assert np.array_equal(proba.output("predict", rows), label)


def test_a_method_the_graph_cannot_answer_fails_the_load(folders: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError) as info:
        load(folders["linear"], {"option.method": "predict_proba"})
    assert info.value.message == (
        "model linear (an ONNX graph with outputs variable: tensor(float)) has no "
        "predict_proba; option.method must be one of: predict"
    )
    with pytest.raises(ModelLoadError, match=r"has no decision_function; option\.method must"):
        load(folders["zipmap"], {"option.method": "decision_function"})


def test_the_signature_describes_the_graph(folders: dict[str, Path]) -> None:
    facts = signature(load(folders["zipmap"]))
    assert facts["platform"] == ONNX
    assert facts["tensors"] == [{"name": "X", "dtype": "<f4", "shape": [-1, onnx_models.WIDTH]}]
    assert facts["outputs"] == [
        {"name": "predict", "dtype": "<i8", "shape": [-1]},
        {"name": "predict_proba", "dtype": "<f4", "shape": [-1, 3]},
    ]
    assert signature(load(folders["linear"]))["outputs"] == [
        {"name": "predict", "dtype": "<f4", "shape": [-1, 1]}
    ]


@pytest.mark.parametrize("name", ["pipeline", "pipeline-zipmap"])
def test_a_dataframe_pipeline_takes_its_columns_by_name(
    folders: dict[str, Path], name: str
) -> None:
    predictor = load(folders[name], {"option.method": "predict_proba"})
    inputs = predictor.inputs
    assert inputs.frame and inputs.names == ("city", "age", "income")
    assert [c.kind for c in inputs.columns] == ["string", "number", "number"]
    assert signature(predictor)["tensors"] == [
        {"name": "city", "dtype": "|O", "shape": [-1, 1]},
        {"name": "age", "dtype": "<f4", "shape": [-1, 1]},
        {"name": "income", "dtype": "<f4", "shape": [-1, 1]},
    ]
    frame = onnx_models.customers(12, seed=9)
    records = frame.to_dict(orient="records")
    batch = decode_as(json.dumps(records).encode(), "application/json", inputs, "model")
    label, probabilities = onnx_models.session(folders[name] / "model.onnx").run(
        None, onnx_models.feeds(frame)
    )
    assert_allclose(predictor.predict(batch), onnx_models.probabilities(probabilities), rtol=1e-5)
    assert np.array_equal(predictor.output("predict", batch), label)


def test_missing_values_a_converted_pipeline_cannot_answer_are_refused(
    folders: dict[str, Path],
) -> None:
    # A converted linear model answers NaN probabilities (and a label that means nothing) for
    # a missing number, and fails on a missing string: no column takes one.
    for method in ("predict", "predict_proba"):
        predictor = load(folders["pipeline"], {"option.method": method})
        assert [c.missing for c in predictor.inputs.columns] == [False, False, False]


def test_the_files_and_engine_choose_the_family(folders: dict[str, Path], tmp_path: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    (single / "churn-v3.onnx").write_bytes((folders["linear"] / "model.onnx").read_bytes())
    found = find_model_file(single, DEFAULTS)
    assert found is not None and (found.family, found.path.name) == (ONNX, "churn-v3.onnx")
    for engine in ("OnnxRuntime", "onnx"):
        predictor = load(single, {"engine": engine})
        assert predictor.family == ONNX
    named = load(single, {"option.model_file": "churn-v3.onnx"})
    assert named.family == ONNX


def test_a_broken_file_fails_its_load_saying_why(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"\x08\x07not a graph at all")
    with pytest.raises(ModelLoadError) as info:
        load(folder)
    assert info.value.message.startswith("model.onnx cannot be loaded as an onnx model: ")


def test_a_missing_onnxruntime_names_the_extra(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert missing_extra("onnxruntime") == (
        "the onnxruntime package is not installed; install it with "
        "pip install 'mmserver[onnx]' (or pip install onnxruntime)"
    )
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ModelLoadError) as info:
        load(folders["linear"])
    assert info.value.message == f"model.onnx is an onnx model: {missing_extra('onnxruntime')}"


def _graph(folder: Path, dtype: int, shape: list[int | None]) -> Path:
    """A graph that casts its one input ``x`` to float (``y``)."""
    from onnx import TensorProto, helper

    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)
    graph = helper.make_graph(
        [node],
        "cast",
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir()
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    return folder


def test_an_integer_input_takes_whole_numbers(tmp_path: Path) -> None:
    from onnx import TensorProto

    predictor = load(_graph(tmp_path / "ints", TensorProto.INT64, [None, 2]))
    assert predictor.n_features == 2
    assert predictor.predict(np.array([[1.0, -3.0], [7.0, 0.0]])).tolist() == [
        [1.0, -3.0],
        [7.0, 0.0],
    ]
    with pytest.raises(ValueError, match=r"input 'x' takes integers"):
        predictor.predict(np.array([[1.5, 2.0]]))


def test_a_graph_that_does_not_take_rows_is_refused(tmp_path: Path) -> None:
    from onnx import TensorProto

    with pytest.raises(ModelLoadError) as info:
        load(_graph(tmp_path / "images", TensorProto.FLOAT, [None, 3, 8, 8]))
    assert info.value.message == (
        "model.onnx: the ONNX graph's input 'x' has shape [N, 3, 8, 8]; graphs that take rows "
        "are served: one input of numbers [N, k], or one input per column, each [N] or [N, 1]"
    )


@pytest.mark.parametrize("location", ["ABSOLUTE", "../other-model/weights.bin"])
def test_a_graph_cannot_read_weights_from_outside_its_folder(tmp_path: Path, location: str) -> None:
    """A model's graph naming external data elsewhere (another model's files, any file) fails
    its load: onnxruntime keeps external data inside the model's folder."""
    from onnx import TensorProto, helper

    other = tmp_path / "other-model"
    other.mkdir()
    (other / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    weights = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    weights.data_location = TensorProto.EXTERNAL
    where = str(other / "weights.bin") if location == "ABSOLUTE" else location
    for key, value in (("location", where), ("offset", "0"), ("length", "16")):
        weights.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "reads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = tmp_path / "reader"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match=r"cannot be loaded as an onnx model: .*External data"):
        load_predictor(folder, ModelConfig(), "reader")
