"""OpenTelemetry traces end to end: the real server, configured by ``OTEL_*`` variables only,
exports to a real OTLP/HTTP receiver (:mod:`tests.e2e.otlp_receiver`), which decodes the
protobuf. Each door's request, an asynchronous request and a transform job are checked by their
spans: names, parents, the trace a ``traceparent`` continues, and attributes.

The tests share one server (``traced``); each calls a model of its own, so each sees its own
cold load."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc as triton_grpc

from mmserver.commands.procfs import free_port
from tests.e2e.otlp_receiver import Receiver, Span
from tests.e2e.server_process import ServerProcess, descendants
from tests.e2e.transform_process import run_transform, write_csv_files
from tests.models import make_linear_archive

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODELS = ("djl", "sagemaker", "v2", "grpc", "asynchronous", "transform", "failing")


@dataclass(frozen=True)
class Traced:
    receiver: Receiver
    server: ServerProcess
    grpc: str
    env: dict[str, str]


def otel_env(receiver: Receiver, service: str) -> dict[str, str]:
    """The standard variables, and nothing else, pointing at ``receiver`` (spans sent every
    50 ms)."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": service,
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Traced]:
    folder = tmp_path_factory.mktemp("traced")
    store = folder / "store"
    store.mkdir()
    for name in MODELS:
        make_linear_archive(store / f"{name}.tar.gz")
    grpc_port = free_port()
    args = (
        "--backend-processes",
        "1",
        "--heavy-processes",
        "0",
        "--grpc-port",
        str(grpc_port),
        "--state-dir",
        str(folder / "state"),
        "--async-output-path",
        str(folder / "outputs"),
    )
    async with Receiver() as receiver:
        env = otel_env(receiver, "mmserver-test")
        async with ServerProcess(store, folder / "server.log", *args, env=env) as server:
            yield Traced(receiver, server, f"127.0.0.1:{grpc_port}", env)


def new_parent() -> tuple[str, str, str]:
    """A sampled ``traceparent`` of a client's span: (the header, its trace id, its span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def request_tree(spans: list[Span], name: str, cold: bool = True) -> dict[str, Span]:
    """The spans of one request by name, checked: the request's span ``name`` (a server's),
    its ``load`` (when ``cold``), ``queue`` and ``batch`` under it, ``predict`` and ``encode``
    under the batch, each within its parent's time."""
    names = ["queue", "batch", "predict", "encode", *(["load"] if cold else [])]
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted([name, *names]), [s.name for s in spans]
    request, batch = by_name[name], by_name["batch"]
    for child in ("queue", "batch", *(["load"] if cold else [])):
        assert by_name[child].parent_id == request.span_id
    for child in ("predict", "encode"):
        assert by_name[child].parent_id == batch.span_id
    for span in spans:
        assert span.trace_id == request.trace_id
        assert span.start <= span.end
        assert request.start <= span.start and span.end <= request.end
    queue, predict, encode = by_name["queue"], by_name["predict"], by_name["encode"]
    if cold:
        assert by_name["load"].end <= queue.start
    assert queue.end == batch.start <= predict.start <= predict.end == encode.start
    assert encode.end <= batch.end
    assert batch.attributes["mmserver.batch.size"] == 1
    assert predict.attributes["mmserver.batch.rows"] == 1
    assert isinstance(predict.attributes["mmserver.predict.path"], str)
    assert predict.attributes["mmserver.predict.path"]
    return by_name


async def post(url: str, body: str, headers: dict[str, str]) -> tuple[int, str]:
    """POST ``body`` with ``headers``: the answer's status and text."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        return response.status, await response.text()


def in_backend(traced: Traced, span: Span) -> None:
    """``span`` says it ran in one of the server's backend processes."""
    assert span.attributes["process.pid"] in descendants(traced.server.pid)


async def test_a_djl_request_on_the_lean_path_continues_the_clients_trace(
    traced: Traced,
) -> None:
    header, trace_id, parent = new_parent()
    status, text = await post(
        f"{traced.server.url}/predictions/djl",
        "[[0.5]]",
        {
            "Content-Type": "application/json",
            "traceparent": header,
            "X-Request-Id": "djl-1",
        },
    )
    assert status == 200, text
    spans = request_tree(await traced.receiver.trace(trace_id, 6), "POST /predictions/{model}")
    request = spans["POST /predictions/{model}"]
    assert request.parent_id == parent
    assert request.kind == "server" and request.service == "mmserver-test"
    assert not request.error
    assert request.attributes == {
        "http.request.method": "POST",
        "http.route": "/predictions/{model}",
        "http.response.status_code": 200,
        "mmserver.model": "djl",
        "mmserver.request_id": "djl-1",
    }
    in_backend(traced, spans["predict"])


async def test_a_sagemaker_request_through_aiohttp_without_a_traceparent_starts_a_trace(
    traced: Traced,
) -> None:
    # A query string leaves the request to aiohttp's handler (the lean path takes none).
    status, text = await post(
        f"{traced.server.url}/invocations?via=aiohttp",
        "[[0.5]]",
        {
            "Content-Type": "application/json",
            "X-Amzn-SageMaker-Target-Model": "sagemaker.tar.gz",
            "X-Request-Id": "sm-1",
        },
    )
    assert status == 200, text

    def found(spans: list[Span]) -> bool:
        return any(s.attributes.get("mmserver.request_id") == "sm-1" for s in spans)

    await traced.receiver.wait(found)
    request = next(
        s for s in traced.receiver.spans if s.attributes.get("mmserver.request_id") == "sm-1"
    )
    assert request.parent_id == ""  # a new trace
    spans = request_tree(await traced.receiver.trace(request.trace_id, 6), "POST /invocations")
    assert spans["POST /invocations"].attributes["http.route"] == "/invocations"
    assert spans["POST /invocations"].attributes["mmserver.model"] == "sagemaker"
    in_backend(traced, spans["predict"])


async def test_a_v2_rest_request_continues_the_clients_trace(traced: Traced) -> None:
    header, trace_id, parent = new_parent()
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]}
    status, text = await post(
        f"{traced.server.url}/v2/models/v2/infer",
        json.dumps(body),
        {"Content-Type": "application/json", "traceparent": header, "tracestate": "vendor=1"},
    )
    assert status == 200, text
    name = "POST /v2/models/{model}/infer"
    spans = request_tree(await traced.receiver.trace(trace_id, 6), name)
    assert spans[name].parent_id == parent
    assert spans[name].attributes["http.route"] == "/v2/models/{model}/infer"
    assert spans[name].attributes["mmserver.model"] == "v2"


def _grpc_infer(url: str, header: str) -> None:
    with triton_grpc.InferenceServerClient(url) as client:
        tensor = triton_grpc.InferInput("input-0", [1, 1], "FP64")
        tensor.set_data_from_numpy(np.array([[0.5]]))
        result = client.infer("grpc", [tensor], headers={"traceparent": header})
        assert result.as_numpy("predict") is not None


async def test_a_grpc_call_continues_the_trace_of_its_metadata(traced: Traced) -> None:
    header, trace_id, parent = new_parent()
    await asyncio.to_thread(_grpc_infer, traced.grpc, header)
    name = "inference.GRPCInferenceService/ModelInfer"
    spans = request_tree(await traced.receiver.trace(trace_id, 6), name)
    call = spans[name]
    assert call.parent_id == parent and call.kind == "server"
    assert call.attributes["rpc.system"] == "grpc"
    assert call.attributes["rpc.method"] == "ModelInfer"
    assert call.attributes["rpc.grpc.status_code"] == 0
    assert call.attributes["mmserver.model"] == "grpc"
    in_backend(traced, spans["predict"])


async def test_a_refused_request_is_a_span_with_its_status(traced: Traced) -> None:
    header, trace_id, parent = new_parent()
    status, text = await post(
        f"{traced.server.url}/predictions/no-such-model",
        "[[0.5]]",
        {"Content-Type": "application/json", "traceparent": header},
    )
    assert status == 404, text
    [request] = await traced.receiver.trace(trace_id, 1)
    assert request.parent_id == parent
    assert request.attributes["http.response.status_code"] == 404
    assert not request.error  # the client's fault, not the server's


async def test_an_asynchronous_request_carries_its_trace_across_the_journal(
    traced: Traced,
) -> None:
    header, trace_id, parent = new_parent()
    status, text = await post(
        f"{traced.server.url}/endpoints/asynchronous/async-invocations",
        json.dumps([[0.5]]),
        {
            "X-Amzn-SageMaker-Content-Type": "application/json",
            "X-Amzn-SageMaker-Inference-Id": "traced-1",
            "traceparent": header,
        },
    )
    assert status == 202, text
    # The call's span, then the run's with the job's five under it (a cold load among them).
    spans = await traced.receiver.trace(trace_id, 7)
    accept = next(s for s in spans if s.name == "POST /endpoints/{endpoint}/async-invocations")
    assert accept.parent_id == parent
    assert accept.attributes["http.response.status_code"] == 202
    assert accept.attributes["mmserver.inference_id"] == "traced-1"
    run = request_tree([s for s in spans if s is not accept], "asynchronous invocation")
    execution = run["asynchronous invocation"]
    assert execution.parent_id == accept.span_id and execution.kind == "consumer"
    assert execution.attributes["mmserver.inference_id"] == "traced-1"
    assert execution.attributes["mmserver.status_code"] == 200
    assert accept.end <= execution.start
    in_backend(traced, run["predict"])


async def test_a_transform_job_is_one_trace_over_its_runs(traced: Traced, tmp_path: Path) -> None:
    data = tmp_path / "in"
    write_csv_files(data, {"a.csv": 3, "b.csv": 2}, features=1)
    common = ("--url", traced.server.url, "--model", "transform", "--input", str(data))
    command = (*common, "--output", str(tmp_path / "out"), "--batch-strategy", "MultiRecord")
    env = otel_env(traced.receiver, "mmserver-transform")
    code, text = await run_transform(*command, env=env)
    assert code == 0, text
    recorded = json.loads((tmp_path / "out" / ".mmserver-transform" / "job.json").read_text())
    _, trace_id, span_id, _ = recorded["traceparent"].split("-")

    # The run's span, and the server's two requests under it (one file each), whole.
    def whole(spans: list[Span]) -> bool:
        names = [s.name for s in spans if s.trace_id == trace_id]
        return names.count("POST /predictions/{model}") == names.count("encode") == 2 and (
            "mmserver transform" in names
        )

    await traced.receiver.wait(whole)
    spans = [s for s in traced.receiver.spans if s.trace_id == trace_id]
    [run] = [s for s in spans if s.name == "mmserver transform"]
    assert run.span_id == span_id and run.parent_id == ""
    assert run.service == "mmserver-transform" and run.kind == "internal"
    assert run.attributes["mmserver.model"] == "transform"
    assert run.attributes["process.exit.code"] == 0
    requests = [s for s in spans if s.name == "POST /predictions/{model}"]
    assert len(requests) == 2
    assert all(r.parent_id == run.span_id and r.service == "mmserver-test" for r in requests)

    # Run again, the job continues its trace (its files are done: nothing is sent).
    code, text = await run_transform(*command, env=env)
    assert code == 0, text
    again = await traced.receiver.trace(trace_id, len(spans) + 1)
    [second] = [s for s in again if s.name == "mmserver transform" and s is not run]
    assert second.parent_id == run.span_id
