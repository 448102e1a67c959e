"""What a user is told when a model cannot be served: an empty folder, an archive without a
model, and the names in the messages are the model's, never the cache's."""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path
from typing import Any

import joblib
import pytest

from tests.integration.harness import Serve, error_of
from tests.models import make_linear_archive


async def test_an_empty_model_folder_says_what_a_model_folder_holds(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    (store / "hollow" / "sub").mkdir(parents=True)  # folders, but no file
    make_linear_archive(store / "sklearn-1.tar.gz")
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/hollow", "[[0.5]]")
    assert response.status == 404
    message = (await error_of(response))["message"]
    assert message.startswith("model hollow has no model file: its folder in the model store")
    assert "model.joblib" in message and "model.py" in message
    unknown = await error_of(await harness.post("/predictions/nowhere", "[[0.5]]"))
    assert "is not in the model store" in unknown["message"]
    assert (await harness.post("/predictions/sklearn-1", "[[0.5]]")).status == 200


async def test_an_archive_without_a_model_names_the_model_not_its_cache_copy(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    notes = tmp_path / "README.txt"
    notes.write_text("no model here")
    with tarfile.open(store / "empty-pack.tar.gz", "w:gz") as tar:
        tar.add(notes, arcname="README.txt")
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/empty-pack", "[[0.5]]")
    assert response.status == 500
    message = (await error_of(response))["message"]
    assert message.startswith("model empty-pack has no model file (an MLflow model (MLmodel)"), (
        message
    )
    assert "empty-pack-" not in message  # the unpacked copy's folder, NAME-KEY


class WarnsOnLoad:
    """An estimator that warns when it is unpickled, as one pickled by another scikit-learn
    version does (its InconsistentVersionWarning)."""

    def __init__(self) -> None:
        self.version = "0.0"  # some state, so that unpickling calls __setstate__

    def __setstate__(self, state: dict[str, object]) -> None:
        import warnings

        warnings.warn("pickled by another version", UserWarning, stacklevel=1)
        warnings.warn("pickled by another version", UserWarning, stacklevel=1)  # once, said
        self.__dict__.update(state)

    def predict(self, batch: Any) -> Any:
        return [0.0] * len(batch)


async def test_warnings_while_loading_are_one_log_line_and_listed_by_describe(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    (store / "warns").mkdir(parents=True)
    joblib.dump(WarnsOnLoad(), store / "warns" / "model.joblib")
    (store / "warns" / "serving.properties").write_text("minWorker=2\nbatchSize=4\nflavour=x\n")
    # A class of the test's own: its pickle loads once the operator trusts the model.
    harness = await serve(model_store=str(store), trusted_models="warns")
    with caplog.at_level(logging.WARNING):
        assert (await harness.post("/predictions/warns", "[[0.5]]")).status == 200
    lines = [r.getMessage() for r in caplog.records if "while it loaded" in r.getMessage()]
    assert lines == [
        "model warns: 1 warning(s) while it loaded: UserWarning: pickled by another version"
    ]
    described = (await (await harness.client.get("/models/warns")).json())[0]["models"][0]
    assert described["warnings"] == [
        "UserWarning: pickled by another version",
        "serving.properties key 'minWorker' is not one mmserver reads; did you mean 'minWorkers'?",
    ]
    assert described["batchSize"] == 4
