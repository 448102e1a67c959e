"""``InvokeEndpointAsync`` on the lean HTTP path (:mod:`mmserver.api.lean.asynchronous`), over raw
sockets: accepted and refused byte for byte as aiohttp's handler does, journaled before its 202,
answered in order among pipelined inference requests, and left to aiohttp where its answer is
aiohttp's own (no ``state_dir``, ``access_log`` on)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mmserver.api.web import STATE
from tests.integration.harness import Harness, Serve, wait_until
from tests.integration.test_async import ended
from tests.integration.test_hostile_http import Sockets
from tests.integration.test_hostile_http import sockets as sockets  # the fixture
from tests.integration.test_lean_http import _STATUS, _exchange, _front, _request, _without_date

_PATH = "/endpoints/sklearn-1/async-invocations"


def _folders(tmp_path: Path, tag: str) -> dict[str, Any]:
    """A server's asynchronous settings: a state of its own, the inputs and outputs shared (the
    same request then gets the same locations from either server)."""
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    (inputs / "x.json").write_bytes(b"[[0.5]]")
    return {
        "state_dir": str(tmp_path / f"state-{tag}"),
        "async_input_roots": str(inputs),
        "async_output_path": str(tmp_path / "outputs"),
    }


def _invoke(body: bytes = b"", **headers: str) -> bytes:
    return _request(_PATH, body, Content_Type="", **headers)


def _cases(tmp_path: Path) -> dict[str, bytes]:
    source = (tmp_path / "inputs" / "x.json").as_uri()
    named = {"X_Amzn_SageMaker_InputLocation": source}
    return {
        "accepted": _invoke(
            X_Amzn_SageMaker_Content_Type="application/json",
            X_Amzn_SageMaker_Inference_Id="lean-1",
            X_Amzn_SageMaker_Custom_Attributes="a=1",
            **named,
        ),
        "inline body": _invoke(
            b"[[0.25]]",
            X_Amzn_SageMaker_Content_Type="application/json",
            X_Amzn_SageMaker_Inference_Id="inline-1",
        ),
        "into a folder": _invoke(
            X_Amzn_SageMaker_Inference_Id="folder-1",
            X_Amzn_SageMaker_S3OutputPathExtension="night/2",
            **named,
        ),
        "no input": _invoke(),
        "both inputs": _invoke(b"[[1]]", **named),
        "outside the roots": _invoke(X_Amzn_SageMaker_InputLocation="file:///etc/passwd"),
        "bad ttl": _invoke(X_Amzn_SageMaker_RequestTTLSeconds="soon", **named),
        "bad id": _invoke(X_Amzn_SageMaker_Inference_Id="-no", **named),
        "unsupported type": _invoke(X_Amzn_SageMaker_Content_Type="application/xml", **named),
        "another model": _request(
            "/endpoints/sklearn-9/async-invocations",
            b"",
            Content_Type="",
            X_Amzn_SageMaker_Inference_Id="other-1",
            **named,
        ),
    }


async def test_lean_async_answers_are_aiohttps_byte_for_byte(
    serve: Serve, sockets: Sockets, tmp_path: Path
) -> None:
    lean = await serve(**_folders(tmp_path, "lean"))
    plain = await serve(lean_http=False, **_folders(tmp_path, "plain"))
    cases = _cases(tmp_path)
    for case, request in cases.items():
        got = await _exchange(lean, sockets, request, 1)
        expected = await _exchange(plain, sockets, request, 1)
        assert _without_date(got) == _without_date(expected), case
    assert b"202 Accepted" in await _exchange(lean, sockets, cases["accepted"], 1)
    front = _front(lean)
    assert front.handed_over == 0
    assert front.taken == len(cases) + 1
    # Accepted once: the same inference id again is the same request, not a second one.
    assert (await ended(lean, "lean-1"))["Status"] == "done"
    assert (await ended(lean, "inline-1"))["Status"] == "done"


async def test_pipelined_with_inference_requests_answered_in_order(
    serve: Serve, sockets: Sockets, tmp_path: Path
) -> None:
    harness = await serve(**_folders(tmp_path, "lean"))
    source = (tmp_path / "inputs" / "x.json").as_uri()
    stream = b"".join(
        [
            _request("/predictions/sklearn-1"),
            _invoke(X_Amzn_SageMaker_InputLocation=source, X_Amzn_SageMaker_Inference_Id="p-1"),
            _request("/predictions/sklearn-2"),
            _invoke(),  # refused: no input
            _invoke(X_Amzn_SageMaker_InputLocation=source, X_Amzn_SageMaker_Inference_Id="p-2"),
        ]
    )
    received = await _exchange(harness, sockets, stream, 5)
    assert _STATUS.findall(received) == [b"200", b"202", b"200", b"400", b"202"]
    assert received.index(b'"p-1"') < received.index(b'"p-2"')
    assert _front(harness).taken == 5
    real_time = await harness.client.post(
        "/predictions/sklearn-1", data=b"[[0.5]]", headers={"Content-Type": "application/json"}
    )
    for inference_id in ("p-1", "p-2"):
        described = await ended(harness, inference_id)
        assert described["Status"] == "done"
        output = Path(described["OutputLocation"].removeprefix("file://"))
        assert await asyncio.to_thread(output.read_bytes) == await real_time.read()


@pytest.mark.parametrize("options", [{"access_log": True}, {"state_dir": ""}])
async def test_left_to_aiohttp_where_its_answer_is_its_own(
    serve: Serve, sockets: Sockets, tmp_path: Path, options: dict[str, Any]
) -> None:
    harness: Harness = await serve(**{**_folders(tmp_path, "lean"), **options})
    source = (tmp_path / "inputs" / "x.json").as_uri()
    received = await _exchange(harness, sockets, _invoke(X_Amzn_SageMaker_InputLocation=source), 1)
    front = _front(harness)
    assert (front.taken, front.handed_over) == (0, 1)
    asynchronous = harness.client.app[STATE].asynchronous
    assert _STATUS.findall(received) == ([b"404"] if asynchronous is None else [b"202"])
    if asynchronous is not None:
        await wait_until(lambda: asynchronous.open_requests == 0)
