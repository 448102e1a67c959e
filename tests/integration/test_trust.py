"""Only trusted code runs (docs/security.md, *Model files*): over HTTP, a hostile pickle fails its
own load naming the global and its neighbours keep serving; trust comes from the server's options
(``trusted_types``, ``trusted_models``) or a management call, never from the model's folder."""

from __future__ import annotations

import fractions
import logging
import os
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from tests.integration.harness import Harness, Serve, error_of
from tests.models import make_custom_handler_dir, make_linear_model


class _System:
    """Pickled as ``os.system("touch MARKER")``: runs at load if nothing stops it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _linear() -> LinearRegression:
    return LinearRegression().fit(np.array([[0.0], [1.0]]), np.array([1.0, 3.0]))  # 2x + 1


def _store(tmp_path: Path) -> tuple[Path, Path]:
    """A store with a hostile pickle (twice: once claiming trust in its own serving.properties),
    a benign one holding a type outside the list, a custom handler and a plain neighbour."""
    store = tmp_path / "store"
    marker = tmp_path / "pwned"
    for name, properties in (
        ("hostile", None),
        ("hostile-claims-trust", "option.trust_insecure_model_files=true\n"),
    ):
        folder = store / name
        folder.mkdir(parents=True)
        model = _linear()
        model.payload = _System(marker)  # type: ignore[attr-defined]
        joblib.dump(model, folder / "model.joblib")
        if properties:
            (folder / "serving.properties").write_text(properties)
    fraction = store / "fraction"
    fraction.mkdir()
    model = _linear()
    model.scale = fractions.Fraction(1, 3)  # type: ignore[attr-defined]
    joblib.dump(model, fraction / "model.joblib")
    make_custom_handler_dir(store / "handler")
    make_linear_model(store / "neighbour")
    return store, marker


async def _predict(harness: Harness, name: str) -> tuple[int, dict[str, Any]]:
    response = await harness.post(f"/predictions/{name}", "[[1.0]]")
    if response.status == 200:
        return 200, await response.json()
    return response.status, await error_of(response)


async def _describe(harness: Harness, name: str) -> dict[str, Any]:
    response = await harness.client.get(f"/models/{name}")
    assert response.status == 200
    described: dict[str, Any] = (await response.json())[0]["models"][0]
    return described


async def test_a_hostile_pickle_fails_its_load_naming_the_global_and_runs_nothing(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, marker = _store(tmp_path)
    caplog.set_level(logging.INFO)
    harness = await serve(model_store=str(store), trusted_types="collections.Counter")
    for name in ("hostile", "hostile-claims-trust"):
        for _ in range(2):
            status, body = await _predict(harness, name)
            assert status == 500
            assert body["type"] == "MalformedModelException"
            assert body["message"].startswith(
                f"model {name} failed to load: model.joblib needs {os.name}.system, which a "
                "model's file may not load"
            )
            assert f"trusted_types={os.name}.system" in body["message"]
    assert not marker.exists()
    # The neighbour answers, before and after.
    assert await _predict(harness, "neighbour") == (
        200,
        {"predictions": [pytest.approx(3.0, abs=0.05)]},
    )
    # Its own serving.properties cannot trust it: read, ignored, said.
    ignored = [r.getMessage() for r in caplog.records if "trust_insecure_model_files" in r.message]
    assert len(ignored) == 1
    assert ignored[0].endswith(
        "option.trust_insecure_model_files=true is ignored: a model's files are trusted only by "
        "the server's trusted_models and trusted_types options, never by its own folder"
    )
    # Logged once per model, counted every time.
    refusals = [
        r
        for r in caplog.records
        if r.name == "mmserver.lifecycle.loading" and "needs posix.system" in r.getMessage()
    ]
    assert sorted(r.getMessage().split(" failed")[0] for r in refusals) == [
        "model hostile",
        "model hostile-claims-trust",
    ]
    metrics = (await (await harness.client.get("/metrics")).read()).decode()
    assert 'mmserver_model_load_failures_total{reason="untrusted"}' in metrics
    untrusted = next(
        line
        for line in metrics.splitlines()
        if line.startswith("mmserver_model_load_failures") and 'reason="untrusted"' in line
    )
    assert float(untrusted.split()[-1]) >= 2
    described = await _describe(harness, "hostile")
    assert described["trust"] == "restricted"
    assert "needs posix.system" in described["error"]


async def test_a_type_outside_the_list_is_served_once_the_operator_trusts_it(
    serve: Serve, tmp_path: Path
) -> None:
    store, _ = _store(tmp_path)
    refused = await serve(model_store=str(store))
    status, body = await _predict(refused, "fraction")
    assert status == 500
    assert "model.joblib needs fractions.Fraction" in body["message"]
    assert (await _describe(refused, "neighbour"))["trust"] == "restricted"

    by_type = await serve(model_store=str(store), trusted_types="fractions.Fraction")
    assert await _predict(by_type, "fraction") == (200, {"predictions": [pytest.approx(3.0)]})
    described = await _describe(by_type, "fraction")
    assert (described["format"], described["trust"]) == ("pickle", "restricted")

    by_name = await serve(model_store=str(store), trusted_models="frac*")
    assert await _predict(by_name, "fraction") == (200, {"predictions": [pytest.approx(3.0)]})
    described = await _describe(by_name, "fraction")
    assert (described["trust"], described["trustedBy"]) == ("trusted", "trusted_models=frac*")
    # The pattern trusts the models it names only.
    status, body = await _predict(by_name, "hostile")
    assert status == 500


async def test_a_custom_handler_runs_only_where_the_operator_trusts_it(
    serve: Serve, tmp_path: Path
) -> None:
    store, _ = _store(tmp_path)
    refused = await serve(model_store=str(store), trusted_models="team-a-*")
    status, body = await _predict(refused, "handler")
    assert status == 500
    assert body["message"] == (
        f"model handler: model.py is a custom handler, code that runs in the server; it runs "
        "only for a model the server's trusted_models option names (now trusted_models="
        f"team-a-*) (request id {body['message'].rsplit('request id ', 1)[1]}"
    )
    trusted = await serve(model_store=str(store), trusted_models="handler")
    status, body = await _predict(trusted, "handler")
    assert status == 200
    assert body == {
        "predictions": [
            {"value": pytest.approx(3.0, abs=0.05), "doubled": pytest.approx(6.0, abs=0.1)}
        ]
    }
    described = await _describe(trusted, "handler")
    assert (described["format"], described["trust"]) == ("python", "trusted")


async def test_post_models_may_register_a_model_as_trusted(serve: Serve, tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    harness = await serve(model_store=str(store))
    folder = store / "handler"
    response = await harness.client.post(f"/models?url={folder}&model_name=plain")
    assert response.status == 500
    assert "model.py is a custom handler" in (await error_of(response))["message"]
    response = await harness.client.post(f"/models?url={folder}&model_name=granted&trusted=true")
    assert response.status == 200, await response.text()
    status, _ = await _predict(harness, "granted")
    assert status == 200
    described = await _describe(harness, "granted")
    assert (described["trust"], described["trustedBy"]) == (
        "trusted",
        "POST /models trusted=true",
    )
    assert (await harness.client.delete("/models/granted")).status == 200
    # The grant went with the registration.
    response = await harness.client.post(f"/models?url={folder}&model_name=granted")
    assert response.status == 500


async def test_skops_files_are_served_and_an_untrusted_function_is_named(
    serve: Serve, tmp_path: Path
) -> None:
    import operator

    import skops.io
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    store = tmp_path / "store"
    (store / "secure").mkdir(parents=True)
    skops.io.dump(_linear(), store / "secure" / "model.skops")
    (store / "negated").mkdir()
    negated = make_pipeline(FunctionTransformer(operator.neg), LinearRegression())
    skops.io.dump(negated.fit(np.array([[0.0], [1.0]]), [1.0, 3.0]), store / "negated" / "x.skops")
    harness = await serve(model_store=str(store))
    assert await _predict(harness, "secure") == (200, {"predictions": [pytest.approx(3.0)]})
    described = await _describe(harness, "secure")
    assert (described["format"], described["family"], described["trust"]) == (
        "skops",
        "sklearn",
        "restricted",
    )
    status, body = await _predict(harness, "negated")
    assert status == 500
    assert "x.skops needs _operator.neg, which a model's file may not load" in body["message"]
    trusting = await serve(model_store=str(store), trusted_types="_operator.neg")
    # Fitted on the negated input: 1.0 answers as the fit's 1.0 did.
    assert await _predict(trusting, "negated") == (200, {"predictions": [pytest.approx(3.0)]})
