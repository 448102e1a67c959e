"""The error tree: what an error says of its model survives the trips it makes."""

from __future__ import annotations

import pickle

import pytest

from mmserver import errors


def test_an_error_naming_its_model_keeps_saying_so_across_a_pickle() -> None:
    # The unpacking processes send their errors back pickled.
    sent = errors.UnsafeArchive(
        "model m: archive m.tar.gz: member '/x' has an absolute path", model="m"
    )
    received = pickle.loads(pickle.dumps(sent))
    assert type(received) is errors.UnsafeArchive
    assert (received.message, received.model) == (sent.message, "m")
    plain = pickle.loads(pickle.dumps(errors.ModelLoadError("model.joblib cannot be loaded")))
    assert (plain.message, plain.model) == ("model.joblib cannot be loaded", None)


@pytest.mark.parametrize(
    ("kind", "model", "expected"),
    [
        ("ConfigError", "m", errors.ConfigError),
        ("ModelLoadError", None, errors.ModelLoadError),
        ("ShuttingDown", None, errors.ShuttingDown),
        ("KeyError", None, errors.ModelError),  # not one of ours: the model's own failure
        ("Exception", "m", errors.ModelError),
    ],
)
def test_an_error_from_a_backend_process_is_rebuilt_by_class_message_and_model(
    kind: str, model: str | None, expected: type[errors.MMServerError]
) -> None:
    error = errors.from_name(kind, "what happened", model)
    assert type(error) is expected
    assert (error.message, error.model, error.status_code) == (
        "what happened",
        model,
        expected.status_code,
    )
