"""``tritonclient`` (Triton's Python HTTP client, unmodified) against the real ``mmserver serve``
with backend processes: health, metadata, inference with JSON and binary tensors, a
classifier's outputs, the model repository, and errors as the client raises them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
import tritonclient.http as triton
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from tritonclient.utils import InferenceServerException

from tests.e2e.server_process import ServerProcess
from tests.models import make_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

IRIS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]])


def make_named_classifier_dir(folder: Path) -> Path:
    """Iris with the species' names as classes: ``predict`` answers strings (BYTES)."""
    folder.mkdir(parents=True)
    x, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    joblib.dump(LogisticRegression(max_iter=1000).fit(x, names), folder / "model.joblib")
    return folder


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = make_store(tmp_path / "store", 3)
    make_named_classifier_dir(root / "iris-names")
    return root


def fp64_input(values: np.ndarray, binary: bool = True, name: str = "input-0") -> triton.InferInput:
    tensor = triton.InferInput(name, list(values.shape), "FP64")
    tensor.set_data_from_numpy(values, binary_data=binary)
    return tensor


def scenario(url: str) -> None:
    """Everything a tritonclient user does, in one blocking run."""
    client = triton.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["extensions"] == [
            "binary_tensor_data",
            "model_repository",
        ]
        assert not client.is_model_ready("sklearn-1")

        # The reference model, binary input and output (tritonclient's default).
        result = client.infer("sklearn-1", [fp64_input(np.array([[0.5], [1.0]]))], request_id="r-1")
        assert result.get_response()["id"] == "r-1"
        assert result.as_numpy("predict") == pytest.approx([2.0, 3.0], abs=0.05)
        assert client.is_model_ready("sklearn-1")

        # JSON input and output, on a version path.
        result = client.infer(
            "sklearn-1",
            [fp64_input(np.array([[0.5]]), binary=False)],
            model_version="1",
            outputs=[triton.InferRequestedOutput("predict", binary_data=False)],
        )
        assert result.get_response()["outputs"][0]["data"] == pytest.approx([2.0], abs=0.05)

        # A classifier: the metadata, then both outputs, one binary and one JSON.
        metadata = client.get_model_metadata("iris-classifier")
        assert [o["name"] for o in metadata["outputs"]] == [
            "predict_proba",
            "predict",
            "decision_function",
        ]
        assert metadata["inputs"] == [{"name": "input-0", "datatype": "FP64", "shape": [-1, 4]}]
        result = client.infer(
            "iris-classifier",
            [fp64_input(IRIS)],
            outputs=[
                triton.InferRequestedOutput("predict"),
                triton.InferRequestedOutput("predict_proba", binary_data=False),
            ],
        )
        assert result.as_numpy("predict").tolist() == [0, 2]
        probabilities = result.as_numpy("predict_proba")
        assert probabilities.shape == (2, 3) and probabilities.argmax(axis=1).tolist() == [0, 2]

        # FP32 in, strings out (BYTES).
        tensor = triton.InferInput("input-0", [2, 4], "FP32")
        tensor.set_data_from_numpy(IRIS.astype(np.float32))
        result = client.infer("iris-names", [tensor])
        assert result.as_numpy("predict").tolist() == [b"setosa", b"virginica"]

        # gzip-compressed requests are read too.
        result = client.infer(
            "sklearn-2", [fp64_input(np.array([[0.5]]))], request_compression_algorithm="gzip"
        )
        assert result.as_numpy("predict") == pytest.approx([2.0], abs=0.05)

        # The model repository.
        index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
        assert index["sklearn-1"] == "READY" and index["sklearn-0"] == "UNAVAILABLE"
        client.load_model("sklearn-0")
        assert client.is_model_ready("sklearn-0")
        client.unload_model("sklearn-0")
        assert not client.is_model_ready("sklearn-0")
    finally:
        client.close()


def errors(url: str) -> None:
    """Errors reach the user as InferenceServerException with the server's status and message."""
    client = triton.InferenceServerClient(url)
    cases: list[tuple[Callable[[], Any], str, str]] = [
        (
            lambda: client.infer(
                "iris-classifier",
                [fp64_input(IRIS)],
                outputs=[triton.InferRequestedOutput("label")],
            ),
            "400",
            "the model has no output 'label'; its outputs are predict_proba",
        ),
        (
            lambda: client.infer("iris-classifier", [fp64_input(np.array([[1.0, 2.0]]))]),
            "400",
            "model iris-classifier expects 4 feature(s) per row, got 2",
        ),
        (
            lambda: client.infer("no-such-model", [fp64_input(np.array([[1.0]]))]),
            "404",
            "model no-such-model is not in the model store",
        ),
        (
            lambda: client.infer("sklearn-1", [fp64_input(np.array([[1.0]]))], model_version="2"),
            "404",
            "model sklearn-1 has one version, 1; there is no version '2'",
        ),
        (lambda: client.get_model_metadata("no-such-model"), "404", "is not in the model store"),
        (lambda: client.load_model("no-such-model"), "404", "is not in the model store"),
    ]
    try:
        for action, status, message in cases:
            with pytest.raises(InferenceServerException) as info:
                action()
            assert info.value.status() == status
            assert message in info.value.message()
        # A shape that does not match the data, sent as JSON.
        tensor = triton.InferInput("input-0", [2, 4], "FP64")
        tensor.set_data_from_numpy(IRIS, binary_data=False)
        tensor.set_shape([3, 4])
        with pytest.raises(InferenceServerException, match="has shape \\[3, 4\\], 12 value"):
            client.infer("iris-classifier", [tensor])
    finally:
        client.close()


async def test_tritonclient_scenario(store: Path, tmp_path: Path) -> None:
    async with ServerProcess(store, tmp_path / "server.log", "--backend-processes", "1") as server:
        await asyncio.to_thread(scenario, f"127.0.0.1:{server.port}")
        await asyncio.to_thread(errors, f"127.0.0.1:{server.port}")
