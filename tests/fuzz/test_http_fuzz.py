"""The inference paths over real HTTP, through the real app and WorkLoadManager: any body,
content type and model name is answered with a status of the documented set, never a 500, and
every error has the JSON error shape."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st

from mmserver.errors import InvalidModelName
from mmserver.store.names import normalize_name
from tests.fuzz.strategies import (
    SCALE,
    SLOW,
    content_types,
    csv_bodies,
    json_rows,
    json_values,
    npy_bytes,
)
from tests.integration.harness import Harness, Serve, error_of

pytestmark = pytest.mark.timeout(90)

#: What an inference request may be answered with (DESIGN §8), for these models: 424 is the
#: raising handler's answer, 405 a name of "." or ".." (the path becomes /models/invoke). Not
#: 500: no model here fails to load.
DOCUMENTED = {200, 400, 404, 405, 413, 415, 424}
LIMIT = 4096  # max_request_size of the fuzzed server, so that 413 is reached too

GOOD_NAMES = (
    "sklearn-0",
    "sklearn-1.tar.gz",
    "sklearn-999.tgz",
    "iris-classifier",
    "pipeline-scaler",
    "tuned-linear",
    "custom-handler",
    "raising-handler",
)
#: Models of the session store that must not be called here: one ends its process (the backend
#: runs in threads of this one), one waits at a gate, one is broken on purpose (500 by design).
EXCLUDED = {"dying-handler", "gated-handler", "broken-model"}

header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
names = st.one_of(
    st.sampled_from(GOOD_NAMES),
    st.text(max_size=30),
    header_text,
    st.integers(min_value=0, max_value=1200).map(lambda i: f"sklearn-{i}"),
    st.sampled_from(["", ".", "..", "a/b", "sklearn-1.tar.gz.tar.gz", "x" * 129, "%00", "\x00"]),
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    json_rows.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    csv_bodies.map(str.encode),
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=4).map(
        lambda xs: npy_bytes(np.array([xs]))
    ),
    st.integers(min_value=LIMIT // 2 - 8, max_value=LIMIT // 2 + 8).map(
        lambda n: b"[" + b"1," * n + b"1]"
    ),
)
accepts = st.one_of(
    st.none(),
    st.sampled_from(["text/csv", "application/json", "*/*", "text/csv;q=0"]),
    header_text,
)
paths = st.sampled_from(["predictions", "invoke", "invocations", "endpoint", "query"])


def _usable(name: str) -> bool:
    try:
        return normalize_name(name) not in EXCLUDED
    except InvalidModelName:
        return True


def _request(path: str, name: str) -> tuple[str, dict[str, str]]:
    quoted = quote(name, safe="")
    if path == "predictions":
        return f"/predictions/{quoted}", {}
    if path == "invoke":
        return f"/models/{quoted}/invoke", {}
    if path == "query":
        return f"/invocations?model_name={quoted}", {}
    target = {"X-Amzn-SageMaker-Target-Model": name} if name else {}
    return ("/invocations" if path == "invocations" else "/endpoints/ep-1/invocations"), target


@pytest.fixture
async def fuzzed(serve: Serve) -> Harness:
    return await serve(max_request_size=LIMIT)


@settings(SLOW, max_examples=400 * SCALE)
@given(path=paths, name=names, body=bodies, content_type=content_types, accept=accepts)
@example(path="predictions", name="sklearn-0", body=b"[[0.5]]", content_type=None, accept=None)
@example(
    path="invocations",
    name="sklearn-0",
    body=b"\x93NUMPY\x01\x00",
    content_type="application/x-npy",
    accept=None,
)
async def test_inference_paths_answer_within_the_documented_set(
    fuzzed: Harness,
    path: str,
    name: str,
    body: bytes,
    content_type: str | None,
    accept: str | None,
) -> None:
    assume(_usable(name))
    if path in ("invocations", "endpoint"):
        # A header value: printable ASCII (the client refuses the rest), no outer whitespace.
        assume(name.isprintable() and name.isascii() and name.strip() == name)
    url, headers = _request(path, name)
    if accept is not None:
        headers["Accept"] = accept
    response = await fuzzed.post(url, body, content_type, **headers)
    event(f"status {response.status}")
    assert response.status in DOCUMENTED, (response.status, await response.text())
    if response.status != 200:
        error: dict[str, Any] = await error_of(response)
        assert isinstance(error["type"], str) and error["type"]
        if path != "predictions" and response.status not in (404, 405):  # a SageMaker route
            assert response.headers["x-amzn-ErrorType"] in (
                "ValidationError",
                "ModelError",
                "ServiceUnavailable",
            )
        return
    assert response.content_type in ("application/json", "text/csv")
    if response.content_type == "application/json":
        assert "predictions" in json.loads(await response.read())


async def test_a_doubled_archive_suffix_is_refused_and_loads_nothing(server: Harness) -> None:
    """``NAME.tar.gz.tar.gz`` is not a name of ``NAME``: it used to load a second copy of the
    model under the name ``NAME.tar.gz``, which DELETE could not reach."""
    ok = await server.post("/predictions/sklearn-7", "[[0.5]]")
    assert ok.status == 200
    for name in ("sklearn-7.tar.gz.tar.gz", "sklearn-7.tgz.tar.gz", "sklearn-7.tar.gz.tgz"):
        response = await server.post(f"/predictions/{name}", "[[0.5]]")
        assert response.status == 400
        assert (await error_of(response))["type"] == "BadRequestException"
    assert list(server.wlm.room.loaded) == ["sklearn-7"]
