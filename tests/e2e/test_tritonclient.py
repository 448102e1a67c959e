"""``tritonclient`` (Triton's Python clients, unmodified, over HTTP and gRPC) against the real
``mmserver serve`` with backend processes: health, metadata, inference with JSON and binary
tensors, a classifier's outputs, the model repository, errors as the client raises them, and a
SIGTERM while gRPC calls are in flight."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import joblib
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from tritonclient.utils import InferenceServerException

from tests.behaviour_models import make_sleeping_dir
from tests.e2e.server_process import ServerProcess, free_port, until
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


#: A call that fails, the status it fails with, and a part of its message.
Case = tuple[Callable[[], Any], str, str]


def error_cases(client: Any, module: Any, tensor: Callable[[np.ndarray], Any]) -> list[Case]:
    """The errors of inference and metadata calls, as ``(call, HTTP status, message)``, for a
    tritonclient ``module`` (``http`` or ``grpc``), its ``client``, and ``tensor`` making an
    input of values."""
    return [
        (
            lambda: client.infer(
                "iris-classifier",
                [tensor(IRIS)],
                outputs=[module.InferRequestedOutput("label")],
            ),
            "400",
            "the model has no output 'label'; its outputs are predict_proba",
        ),
        (
            lambda: client.infer("iris-classifier", [tensor(np.array([[1.0, 2.0]]))]),
            "400",
            "model iris-classifier expects 4 feature(s) per row, got 2",
        ),
        (
            lambda: client.infer("no-such-model", [tensor(np.array([[1.0]]))]),
            "404",
            "model no-such-model is not in the model store",
        ),
        (
            lambda: client.infer("sklearn-1", [tensor(np.array([[1.0]]))], model_version="2"),
            "404",
            "model sklearn-1 has one version, 1; there is no version '2'",
        ),
        (lambda: client.get_model_metadata("no-such-model"), "404", "is not in the model store"),
    ]


def raised(cases: list[Case]) -> list[str]:
    """Make each call, check the status and message it fails with; the messages."""
    messages = []
    for action, status, message in cases:
        with pytest.raises(InferenceServerException) as info:
            action()
        assert info.value.status() == status
        assert message in info.value.message()
        messages.append(info.value.message())
    return messages


def errors(url: str) -> None:
    """Errors reach the user as InferenceServerException with the server's status and message."""
    client = triton.InferenceServerClient(url)
    cases = error_cases(client, triton, fp64_input)
    cases.append((lambda: client.load_model("no-such-model"), "404", "is not in the model store"))
    try:
        raised(cases)
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


# ------------------------------------------------------------------------------------------------
# tritonclient.grpc
# ------------------------------------------------------------------------------------------------


def grpc_input(values: np.ndarray, datatype: str = "FP64") -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("input-0", list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor


def grpc_scenario(url: str, token: str) -> None:
    """What a tritonclient.grpc user does, in one blocking run."""
    client = triton_grpc.InferenceServerClient(url)
    management = {"authorization": f"Bearer {token}"}
    try:
        assert client.is_server_live() and client.is_server_ready()
        metadata = client.get_server_metadata(as_json=True)
        assert metadata["name"] == "mmserver"
        assert metadata["extensions"] == ["binary_tensor_data", "model_repository"]
        assert not client.is_model_ready("sklearn-1")

        result = client.infer("sklearn-1", [grpc_input(np.array([[0.5], [1.0]]))], request_id="r-1")
        assert result.get_response().id == "r-1"
        assert result.as_numpy("predict") == pytest.approx([2.0, 3.0], abs=0.05)
        assert client.is_model_ready("sklearn-1", "1")

        metadata = client.get_model_metadata("iris-classifier", as_json=True)
        assert metadata["inputs"] == [{"name": "input-0", "datatype": "FP64", "shape": ["-1", "4"]}]
        result = client.infer(
            "iris-classifier",
            [grpc_input(IRIS)],
            outputs=[
                triton_grpc.InferRequestedOutput("predict"),
                triton_grpc.InferRequestedOutput("predict_proba"),
            ],
        )
        assert result.as_numpy("predict").tolist() == [0, 2]
        assert result.as_numpy("predict_proba").argmax(axis=1).tolist() == [0, 2]

        # FP32 in, strings out (BYTES); the same answer as over HTTP.
        result = client.infer("iris-names", [grpc_input(IRIS.astype(np.float32), "FP32")])
        assert result.as_numpy("predict").tolist() == [b"setosa", b"virginica"]

        # The model repository, under the management token.
        index = client.get_model_repository_index(as_json=True)["models"]
        states = {m["name"]: m["state"] for m in index}
        assert states["sklearn-1"] == "READY" and states["sklearn-0"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException) as info:
            client.load_model("sklearn-0")
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        client.load_model("sklearn-0", headers=management)
        assert client.is_model_ready("sklearn-0")
        client.unload_model("sklearn-0", headers=management)
        assert not client.is_model_ready("sklearn-0")
    finally:
        client.close()


#: The gRPC status of each HTTP status of :func:`error_cases`, as tritonclient.grpc shows it.
GRPC_STATUS = {"400": "StatusCode.INVALID_ARGUMENT", "404": "StatusCode.NOT_FOUND"}


def grpc_errors(url: str) -> None:
    """Errors reach the user as InferenceServerException with the status and REST's message."""
    client = triton_grpc.InferenceServerClient(url)
    cases = [
        (call, GRPC_STATUS[status], message)
        for call, status, message in error_cases(client, triton_grpc, grpc_input)
    ]
    try:
        for message in raised(cases):
            assert "(request id " in message
    finally:
        client.close()


async def test_tritonclient_grpc_scenario(store: Path, tmp_path: Path) -> None:
    grpc_port = free_port()
    args = ("--backend-processes", "1", "--grpc-port", str(grpc_port), "--management-token", "t")
    async with ServerProcess(store, tmp_path / "server.log", *args):
        await asyncio.to_thread(grpc_scenario, f"127.0.0.1:{grpc_port}", "t")
        await asyncio.to_thread(grpc_errors, f"127.0.0.1:{grpc_port}")


def slow_calls(
    url: str, count: int, sent: asyncio.Event, loop: asyncio.AbstractEventLoop
) -> list[Any]:
    """``count`` calls to the slow model at once (async_infer), then their results."""
    client = triton_grpc.InferenceServerClient(url)
    results: list[Any] = [None] * count
    done = [asyncio.Event() for _ in range(count)]

    def finished(index: int) -> Callable[[Any, Any], None]:
        def callback(result: Any, error: Any) -> None:
            results[index] = error if error is not None else result.as_numpy("predict").tolist()
            loop.call_soon_threadsafe(done[index].set)

        return callback

    try:
        for i in range(count):
            client.async_infer("slow", [grpc_input(np.array([[float(i)]]))], finished(i))
        loop.call_soon_threadsafe(sent.set)
        for event in done:
            asyncio.run_coroutine_threadsafe(event.wait(), loop).result(timeout=60)
    finally:
        client.close()
    return results


async def test_sigterm_answers_the_grpc_calls_in_flight(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    # 50 ms a batch, one row a batch: 20 calls take about a second.
    make_sleeping_dir(store / "slow", 0.05, maxWorkers=1, batch_size=1)
    grpc_port = free_port()
    args = ("--backend-processes", "1", "--grpc-port", str(grpc_port), "--drain-timeout", "30")
    async with ServerProcess(store, tmp_path / "server.log", *args) as server:
        url = f"127.0.0.1:{grpc_port}"
        loop = asyncio.get_running_loop()
        warm = await asyncio.to_thread(slow_calls, url, 1, asyncio.Event(), loop)
        assert warm == [[0.0]]
        sent = asyncio.Event()
        calls = asyncio.ensure_future(asyncio.to_thread(slow_calls, url, 20, sent, loop))
        await sent.wait()

        async def queued() -> bool:  # accepted: signal once most calls wait in the queue
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/metrics") as response:
                    text = await response.text()
            return any(
                line.startswith("mmserver_queue_length") and float(line.rsplit(" ", 1)[1]) >= 10
                for line in text.splitlines()
            )

        await until(queued, 20, "the calls never queued up")
        server.signal(signal.SIGTERM)
        results = await calls
        assert await server.wait(30) == 0
    answered = [r for r in results if isinstance(r, list)]
    refused = [r for r in results if not isinstance(r, list)]
    # Every call has one answer: its own, or UNAVAILABLE when it reached the server after the
    # signal; none is cut.
    for index, result in enumerate(results):
        if isinstance(result, list):
            assert result == [2.0 * index]
    assert all(e.status() == "StatusCode.UNAVAILABLE" for e in refused), refused
    assert len(answered) >= 10
