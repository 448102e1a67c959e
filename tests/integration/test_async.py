"""Asynchronous inference through a real boto3 ``sagemaker-runtime`` client's
``invoke_endpoint_async``, with inputs and outputs in local folders and on the S3 test server
(moto in server mode). Tests wait on the state call (``GET /async-invocations/{id}``) and on the
gate a gated model waits at, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psutil
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from botocore.exceptions import ClientError

from mmserver import errors
from mmserver.api.web import STATE
from mmserver.asynchronous import AsyncInference
from mmserver.asynchronous.admission import LOOK_S, Intake
from mmserver.asynchronous.journal import Invocation, Journal
from mmserver.asynchronous.journal import State as JournalState
from mmserver.asynchronous.locations import Locations
from mmserver.asynchronous.objectcalls import NICE
from mmserver.codecs.requests import make_request
from mmserver.ops.metrics import Metrics
from tests.integration import gate as gate_module
from tests.integration.harness import Harness, Serve, wait_until
from tests.integration.s3server import S3Server, s3_environment
from tests.integration.test_boto3 import invoke, runtime_client
from tests.models import make_tuned_dir

BUCKET = "async-io"
ENDED = ("done", "failed", "expired")


def path_of(location: str) -> Path:
    assert location.startswith("file://"), location
    return Path(unquote(urlsplit(location).path))


async def invoke_async(client: Any, **kwargs: Any) -> dict[str, Any]:
    response: dict[str, Any] = await asyncio.to_thread(client.invoke_endpoint_async, **kwargs)
    return response


async def state(harness: Harness, inference_id: str, **headers: str) -> dict[str, Any]:
    response = await harness.client.get(f"/async-invocations/{inference_id}", headers=headers)
    assert response.status == 200, await response.text()
    described: dict[str, Any] = await response.json()
    return described


async def ended(
    harness: Harness, inference_id: str, seconds: float = 20.0, **headers: str
) -> dict[str, Any]:
    """The request's state once it has ended, asked of the state call until then (with
    ``headers``: a tenant's token, say)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + seconds
    while True:
        described = await state(harness, inference_id, **headers)
        if described["Status"] in ENDED:
            return described
        assert loop.time() < give_up, f"request {inference_id} still {described['Status']}"
        await asyncio.sleep(0.01)


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    return {"state": tmp_path / "state", "inputs": inputs, "outputs": tmp_path / "outputs"}


async def serve_async(serve: Serve, folders: dict[str, Path], **options: Any) -> Harness:
    settings: dict[str, Any] = {
        "state_dir": str(folders["state"]),
        "async_input_roots": str(folders["inputs"]),
        "async_output_path": str(folders["outputs"]),
    }
    settings.update(options)
    return await serve(**settings)


async def test_an_answer_in_a_local_folder_is_the_real_time_answer(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    source = folders["inputs"] / "rows.csv"
    source.write_bytes(b"0.5\n1.0\n")
    response = await invoke_async(
        client,
        EndpointName="sklearn-3",
        InputLocation=source.as_uri(),
        ContentType="text/csv",
        Accept="text/csv",
        InferenceId="rows-1",
    )
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 202
    assert response["InferenceId"] == "rows-1"
    output = path_of(response["OutputLocation"])
    assert output == folders["outputs"].resolve() / "rows-1.out"
    assert path_of(response["FailureLocation"]).name == "rows-1-error.out"
    described = await ended(harness, "rows-1")
    assert described["Status"] == "done"
    assert described["OutputLocation"] == response["OutputLocation"]
    real_time = await invoke(
        client,
        TargetModel="sklearn-3",
        Body=b"0.5\n1.0\n",
        ContentType="text/csv",
        Accept="text/csv",
    )
    assert output.read_bytes() == real_time["Payload"]
    assert [float(v) for v in output.read_text().split()] == [
        pytest.approx(2.0, abs=0.05),
        pytest.approx(3.0, abs=0.05),
    ]
    assert not path_of(response["FailureLocation"]).exists()
    assert [p.name for p in folders["outputs"].iterdir()] == ["rows-1.out"]  # no leftovers


async def test_an_inline_body_and_a_generated_id(serve: Serve, folders: dict[str, Path]) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    response = await invoke_async(
        client, EndpointName="sklearn-4", Body=b"[[0.5]]", ContentType="application/json"
    )
    inference_id = response["InferenceId"]
    assert len(inference_id) == 36  # a UUID
    assert (await ended(harness, inference_id))["Status"] == "done"
    answer = json.loads(path_of(response["OutputLocation"]).read_bytes())
    assert answer == {"predictions": [pytest.approx(2.0, abs=0.05)]}
    # The saved body goes once the request has ended.
    assert list((folders["state"] / "inputs").iterdir()) == []


async def test_the_same_inference_id_is_accepted_once(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    source = folders["inputs"] / "one.json"
    source.write_bytes(b"[[1.0]]")
    first = await invoke_async(
        client, EndpointName="sklearn-5", InputLocation=source.as_uri(), InferenceId="same"
    )
    again = await invoke_async(
        client, EndpointName="sklearn-5", InputLocation=source.as_uri(), InferenceId="same"
    )
    assert again["OutputLocation"] == first["OutputLocation"]
    assert (await ended(harness, "same"))["Status"] == "done"
    runner = harness.client.app[STATE].asynchronous
    assert runner is not None
    assert harness.metrics.async_requests.labels("accepted").value == 1
    assert harness.metrics.async_requests.labels("done").value == 1
    other = await invoke_async_error(
        client, EndpointName="sklearn-6", InputLocation=source.as_uri(), InferenceId="same"
    )
    assert other.response["Error"]["Code"] == "ValidationError"
    assert "names another request already accepted" in other.response["Error"]["Message"]


async def invoke_async_error(client: Any, **kwargs: Any) -> ClientError:
    try:
        await invoke_async(client, **kwargs)
    except ClientError as exc:
        return exc
    pytest.fail("invoke_endpoint_async did not raise")


async def test_a_missing_input_ends_in_a_failure_object(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    missing = folders["inputs"] / "not-there.json"
    response = await invoke_async(
        client, EndpointName="sklearn-3", InputLocation=missing.as_uri(), InferenceId="gone"
    )
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 202
    described = await ended(harness, "gone")
    assert described["Status"] == "failed"
    assert f"the input {missing.as_uri()} does not exist" in described["Error"]
    failure = json.loads(path_of(response["FailureLocation"]).read_bytes())
    assert failure["inferenceId"] == "gone"
    assert failure["code"] == 400
    assert f"the input {missing.as_uri()} does not exist" in failure["message"]
    assert not path_of(response["OutputLocation"]).exists()


async def test_a_model_that_fails_ends_in_a_failure_object_with_its_error(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    source = folders["inputs"] / "rows.json"
    source.write_bytes(b"[[0.5]]")
    response = await invoke_async(
        client, EndpointName="raising-handler", InputLocation=source.as_uri(), InferenceId="bad"
    )
    described = await ended(harness, "bad")
    assert described["Status"] == "failed"
    assert "feature 0 is out of range" in described["Error"]
    failure = json.loads(path_of(response["FailureLocation"]).read_bytes())
    assert failure["code"] == 424
    assert "feature 0 is out of range" in failure["message"]


@pytest.mark.parametrize(
    "location",
    [
        "file:///etc/passwd",
        "file://{inputs}/../elsewhere.json",
        "http://127.0.0.1:1/input.json",
        "relative/input.json",
    ],
)
async def test_an_input_outside_the_allowed_folders_is_refused_before_queuing(
    serve: Serve, folders: dict[str, Path], location: str
) -> None:
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    error = await invoke_async_error(
        client,
        EndpointName="sklearn-3",
        InputLocation=location.format(inputs=folders["inputs"]),
        InferenceId="refused",
    )
    assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert error.response["Error"]["Code"] == "ValidationError"
    assert "input location" in error.response["Error"]["Message"]
    response = await harness.client.get("/async-invocations/refused")
    assert response.status == 404
    assert harness.metrics.async_requests.labels("accepted").value == 0


async def test_without_a_state_dir_the_call_is_not_found(server: Harness) -> None:
    response = await server.post(
        "/endpoints/sklearn-3/async-invocations",
        b"[[0.5]]",
        **{"X-Amzn-SageMaker-Content-Type": "application/json"},
    )
    assert response.status == 404
    assert "start it with a state_dir" in (await response.json())["message"]


@pytest.fixture
def held(gate: gate_module.Gate) -> Iterator[gate_module.Gate]:
    yield gate
    gate.open()


async def test_a_full_queue_is_answered_429_with_retry_after(
    serve: Serve, folders: dict[str, Path], held: gate_module.Gate
) -> None:
    harness = await serve_async(serve, folders, async_max_queued=2)
    headers = {"X-Amzn-SageMaker-Content-Type": "application/json"}
    path = "/endpoints/gated-handler/async-invocations"
    first = await harness.post(
        path, b"[[0.5]]", **headers, **{"X-Amzn-SageMaker-Inference-Id": "a"}
    )
    assert first.status == 202
    assert await asyncio.to_thread(held.wait_entered)  # running, held at the gate
    second = await harness.post(path, b"[[0.5]]", **headers)
    assert second.status == 202
    refused = await harness.post(path, b"[[0.5]]", **headers)
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["x-amzn-ErrorType"] == "ThrottlingException"
    assert "async_max_queued" in (await refused.json())["message"]
    held.open()
    assert (await ended(harness, "a"))["Status"] == "done"


async def test_a_request_not_started_within_its_ttl_expires(
    serve: Serve, folders: dict[str, Path], held: gate_module.Gate
) -> None:
    harness = await serve_async(serve, folders)
    path = "/endpoints/gated-handler/async-invocations"
    headers = {"X-Amzn-SageMaker-Content-Type": "application/json"}
    running = await harness.post(
        path, b"[[0.5]]", **headers, **{"X-Amzn-SageMaker-Inference-Id": "running"}
    )
    assert running.status == 202
    assert await asyncio.to_thread(held.wait_entered)
    # The model runs one asynchronous request at a time (async_max_workers=1): this one waits.
    waiting = await harness.post(
        path,
        b"[[0.5]]",
        **headers,
        **{"X-Amzn-SageMaker-Inference-Id": "late", "X-Amzn-SageMaker-RequestTTLSeconds": "1"},
    )
    assert waiting.status == 202
    failure = path_of(waiting.headers["X-Amzn-SageMaker-FailureLocation"])
    described = await ended(harness, "late")
    assert described["Status"] == "expired"
    assert "not started within its RequestTTLSeconds (1 s)" in described["Error"]
    assert "RequestTTLSeconds (1 s)" in json.loads(failure.read_bytes())["message"]
    assert (await state(harness, "running"))["Status"] == "running"
    held.open()
    assert (await ended(harness, "running"))["Status"] == "done"
    assert harness.metrics.async_requests.labels("expired").value == 1


async def test_a_request_past_its_invocation_timeout_fails(
    serve: Serve, folders: dict[str, Path], held: gate_module.Gate
) -> None:
    harness = await serve_async(serve, folders)
    response = await harness.post(
        "/endpoints/gated-handler/async-invocations",
        b"[[0.5]]",
        **{
            "X-Amzn-SageMaker-Content-Type": "application/json",
            "X-Amzn-SageMaker-Inference-Id": "slow",
            "X-Amzn-SageMaker-InvocationTimeoutSeconds": "1",
        },
    )
    assert response.status == 202
    assert await asyncio.to_thread(held.wait_entered)
    described = await ended(harness, "slow")
    assert described["Status"] == "failed"
    assert "invocation timeout (1 s)" in described["Error"]
    held.open()


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-Amzn-SageMaker-RequestTTLSeconds": "0"}, "must be between 1 and 21600"),
        ({"X-Amzn-SageMaker-InvocationTimeoutSeconds": "3601"}, "must be between 1 and 3600"),
        ({"X-Amzn-SageMaker-Inference-Id": "a b"}, "inference id 'a b'"),
        ({"X-Amzn-SageMaker-Content-Type": "application/xml"}, "is not supported"),
        ({"X-Amzn-SageMaker-Filename": "../x"}, "X-Amzn-SageMaker-Filename"),
    ],
)
async def test_bad_headers_are_refused_before_queuing(
    serve: Serve, folders: dict[str, Path], headers: dict[str, str], message: str
) -> None:
    harness = await serve_async(serve, folders)
    response = await harness.post("/endpoints/sklearn-3/async-invocations", b"[[0.5]]", **headers)
    assert response.status in (400, 415)
    assert message in (await response.json())["message"]
    assert harness.metrics.async_requests.labels("accepted").value == 0


# On the S3 test server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_environment(tmp_path_factory.mktemp("aws"), BUCKET) as server:
        yield server


async def test_inputs_and_answers_on_the_object_store(
    serve: Serve, folders: dict[str, Path], s3: S3Server
) -> None:
    harness = await serve_async(
        serve,
        folders,
        async_output_path=f"s3://{BUCKET}/answers",
        async_failure_path=f"s3://{BUCKET}/failures/",
    )
    # The answers go to S3: the process of the object calls starts with the server, before any
    # request (its imports would otherwise be made beside the first requests).
    niceness = psutil.Process().nice() + NICE
    await wait_until(lambda: any(p.nice() == niceness for p in psutil.Process().children()), 60)
    objects = s3.client()
    objects.put_object(Bucket=BUCKET, Key="requests/rows.json", Body=b"[[0.5], [1.0]]")
    client = runtime_client(harness)
    response = await invoke_async(
        client,
        EndpointName="sklearn-7",
        InputLocation=f"s3://{BUCKET}/requests/rows.json",
        ContentType="application/json",
        Accept="application/json",
        InferenceId="from-s3",
    )
    assert response["OutputLocation"] == f"s3://{BUCKET}/answers/from-s3.out"
    assert response["FailureLocation"] == f"s3://{BUCKET}/failures/from-s3-error.out"
    assert (await ended(harness, "from-s3"))["Status"] == "done"
    written = objects.get_object(Bucket=BUCKET, Key="answers/from-s3.out")
    real_time = await invoke(
        client,
        TargetModel="sklearn-7",
        Body=b"[[0.5], [1.0]]",
        ContentType="application/json",
        Accept="application/json",
    )
    assert written["Body"].read() == real_time["Payload"]
    assert written["ContentType"] == "application/json"

    missing = await invoke_async(
        client,
        EndpointName="sklearn-7",
        InputLocation=f"s3://{BUCKET}/requests/missing.json",
        InferenceId="missing-s3",
    )
    described = await ended(harness, "missing-s3")
    assert described["Status"] == "failed"
    failure = objects.get_object(Bucket=BUCKET, Key="failures/missing-s3-error.out")
    assert (
        f"s3://{BUCKET}/requests/missing.json does not exist"
        in json.loads(failure["Body"].read())["message"]
    )
    assert missing["FailureLocation"] == f"s3://{BUCKET}/failures/missing-s3-error.out"


async def test_requests_a_crash_left_running_end_once_at_the_next_start(
    serve: Serve, folders: dict[str, Path]
) -> None:
    # As a server killed between writing an answer and recording it leaves its journal: "x"
    # has its answer written, "y" had not got that far.
    outputs = folders["outputs"]
    outputs.mkdir()
    (outputs / "x.out").write_bytes(b"written before the crash")
    (folders["inputs"] / "y.json").write_bytes(b"[[1.0]]")
    journal = Journal(folders["state"])
    for name in ("x", "y"):
        journal.add(
            Invocation(
                id=name,
                model="sklearn-3",
                input=(folders["inputs"] / f"{name}.json").as_uri(),
                output=(outputs / f"{name}.out").as_uri(),
                failure=(outputs / f"{name}-error.out").as_uri(),
                content_type="application/json",
                accept=None,
                custom_attributes=None,
                accepted_at=time.time(),
                ttl_s=60.0,
                timeout_s=60.0,
            )
        )
        assert journal.move(name, JournalState.RUNNING)
    journal.close()
    # A body saved by a server killed before it journaled the request (never answered 202).
    orphan = folders["state"] / "inputs" / "orphan.in"
    orphan.parent.mkdir()
    orphan.write_bytes(b"[[9.0]]")
    # What the killed writes left: y's answer and failure half-written beside their places, an
    # answer for an object store being prepared in the state folder. Another request's is
    # left alone: it may be another server's, writing to the same folder.
    torn = [outputs / ".y.out.0123456789ab.part", outputs / ".y-error.out.fedcba987654.part"]
    staged = Locations.staging("s3://bucket/z.out", folders["state"] / "answers")
    others = [outputs / ".z.out.0123456789ab.part", staged.parent / "kept.out"]
    for path in (*torn, staged, *others):
        path.write_bytes(b"half an answer")

    harness = await serve_async(serve, folders)
    assert (await state(harness, "x"))["Status"] == "done"  # at once: it is not run again
    assert (outputs / "x.out").read_bytes() == b"written before the crash"
    assert not orphan.exists()
    assert [p.exists() for p in (*torn, staged, *others)] == [False, False, False, True, True]
    assert (await ended(harness, "y"))["Status"] == "done"
    assert json.loads((outputs / "y.out").read_bytes()) == {
        "predictions": [pytest.approx(3.0, abs=0.05)]
    }
    assert harness.metrics.async_requests.labels("done").value == 2


async def test_a_second_server_on_the_same_state_dir_is_refused(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    first = harness.asynchronous
    second = AsyncInference(harness.config, harness.wlm, Metrics())
    with pytest.raises(errors.ConfigError) as refused:
        second.claim()
    assert refused.value.message == (
        f"option state_dir={folders['state'].resolve()}: another mmserver (pid {os.getpid()}) "
        "is using it; give each server its own state_dir (two servers on one journal would "
        "run its requests twice)"
    )
    # The first goes on, and once it has stopped the folder is free.
    source = folders["inputs"] / "row.json"
    source.write_bytes(b"[[1.0]]")
    client = runtime_client(harness)
    await invoke_async(
        client, EndpointName="sklearn-3", InputLocation=source.as_uri(), InferenceId="a"
    )
    assert (await ended(harness, "a"))["Status"] == "done"
    first.close()
    await first.stop(2.0)
    second.claim()
    await second.stop(0)


# Real time first ---------------------------------------------------------------------------------


async def test_asynchronous_jobs_do_not_scale_a_model_up_as_real_time_ones_do(
    serve: Serve, held: gate_module.Gate
) -> None:
    harness = await serve()
    wlm = harness.wlm
    await wlm.rescale("gated-handler", {"max_workers": 4, "job_queue_size": 100})
    pool = wlm.room.loaded.get("gated-handler")
    assert pool is not None and len(pool.workers) == 1
    job = make_request(b"[[0.5]]", "application/json", None)
    background = [wlm.submit("gated-handler", job, background=True).answer for _ in range(10)]
    assert await asyncio.to_thread(held.wait_entered)
    # Ten queued asynchronous jobs: still one worker (async_max_workers=1).
    assert len(pool.workers) == 1
    assert pool.queue.background == 9
    assert wlm.real_time_queued == 0
    real_time = [wlm.submit("gated-handler", job).answer for _ in range(10)]
    assert wlm.real_time_queued == 10
    assert len(pool.workers) == 4  # the real-time rule: more than 2 * batch_size queued
    held.open()
    answers = await asyncio.gather(*background, *real_time)
    assert len(answers) == 20


async def test_asynchronous_requests_wait_while_real_time_requests_are_queued(
    serve: Serve, folders: dict[str, Path], held: gate_module.Gate
) -> None:
    harness = await serve_async(serve, folders)
    # One real-time request runs (held at the gate), another waits in the model's queue.
    running = asyncio.ensure_future(harness.post("/predictions/gated-handler", "[[0.5]]"))
    assert await asyncio.to_thread(held.wait_entered)
    waiting = asyncio.ensure_future(harness.post("/predictions/gated-handler", "[[1.0]]"))
    await wait_until(lambda: harness.wlm.real_time_queued == 1)
    response = await harness.post(
        "/endpoints/sklearn-3/async-invocations",
        b"[[0.5]]",
        **{
            "X-Amzn-SageMaker-Content-Type": "application/json",
            "X-Amzn-SageMaker-Inference-Id": "after-real-time",
        },
    )
    assert response.status == 202
    await wait_until(lambda: harness.metrics.async_yields.labels().value >= 3)
    assert (await state(harness, "after-real-time"))["Status"] == "queued"
    samples = await harness.samples()
    assert samples[("mmserver_async_backlog", (("model", "sklearn-3"),))] == 1
    assert samples[("mmserver_async_oldest_queued_seconds", ())] > 0
    assert samples[("mmserver_async_requests_total", (("status", "accepted"),))] == 1

    held.open()
    assert [(await r).status for r in (running, waiting)] == [200, 200]
    assert (await ended(harness, "after-real-time"))["Status"] == "done"
    samples = await harness.samples()
    assert ("mmserver_async_backlog", (("model", "sklearn-3"),)) not in samples
    assert samples[("mmserver_async_oldest_queued_seconds", ())] == 0
    assert samples[("mmserver_async_requests_total", (("status", "done"),))] == 1


async def test_requests_start_one_at_a_time_while_real_time_keeps_the_event_loop_busy(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    runner = harness.asynchronous
    # What the runner's intake reads, set here: its clock stands still while the event loop's
    # thread spent 90 % of a look on the CPU and real-time requests arrived.
    looked = {"now": 100.0, "cpu": 10.0, "arrived": 0}
    runner.intake = Intake(
        lambda: looked["arrived"], lambda: None, lambda: looked["now"], lambda: looked["cpu"]
    )
    looked.update(now=100.0 + 2 * LOOK_S, cpu=10.0 + 1.8 * LOOK_S, arrived=5)
    assert runner.intake.busy()
    for name in ("first", "second", "third"):
        response = await harness.post(
            "/endpoints/sklearn-3/async-invocations",
            b"[[0.5]]",
            **{
                "X-Amzn-SageMaker-Content-Type": "application/json",
                "X-Amzn-SageMaker-Inference-Id": name,
            },
        )
        assert response.status == 202
    assert (await ended(harness, "first"))["Status"] == "done"
    held_back = harness.metrics.async_yields.labels().value
    # Two more looks of the dispatcher (each after the pause it was told): the others still wait.
    await wait_until(lambda: harness.metrics.async_yields.labels().value >= held_back + 2)
    assert [(await state(harness, n))["Status"] for n in ("second", "third")] == ["queued"] * 2

    looked.update(now=looked["now"] + 2 * LOOK_S)  # a quiet look: the rest start at once
    assert not runner.intake.busy()
    assert (await ended(harness, "second"))["Status"] == "done"
    assert (await ended(harness, "third"))["Status"] == "done"


# Notifications -----------------------------------------------------------------------------------


class Receiver:
    """A webhook on loopback that refuses its first ``refusals`` calls with 503."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls: list[dict[str, Any]] = []
        self.delivered: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        message = await request.json()
        self.calls.append(message)
        if len(self.calls) <= self.refusals:
            return web.Response(status=503)
        self.delivered.append(message)
        self.arrived.set()
        return web.Response(status=204)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    hook = Receiver(refusals=1)
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield hook, str(server.make_url("/hook"))
    await server.close()


async def test_an_ended_request_is_notified_and_a_refused_notification_retried(
    serve: Serve, folders: dict[str, Path], receiver: tuple[Receiver, str]
) -> None:
    hook, url = receiver
    harness = await serve_async(serve, folders, async_notify_url=url)
    client = runtime_client(harness)
    source = folders["inputs"] / "rows.csv"
    source.write_bytes(b"0.5\n")
    sent = await invoke_async(
        client,
        EndpointName="sklearn-3",
        InputLocation=source.as_uri(),
        ContentType="text/csv",
        CustomAttributes="trace=7",
        InferenceId="notified",
    )
    await asyncio.wait_for(hook.arrived.wait(), 10)
    assert len(hook.calls) == 2  # refused once, then delivered
    assert hook.calls[0] == hook.calls[1]
    [message] = hook.delivered
    assert message["inferenceId"] == "notified"
    assert message["invocationStatus"] == "Completed"
    assert message["eventName"] == "InferenceResult"
    assert message["requestParameters"] == {
        "endpointName": "sklearn-3",
        "inputLocation": source.resolve().as_uri(),
        "contentType": "text/csv",
        "customAttributes": "trace=7",
    }
    assert message["responseParameters"] == {
        "outputLocation": sent["OutputLocation"],
        "contentType": "application/json",  # as the real-time answer to CSV without Accept
    }
    assert message["receivedTime"].endswith("Z") and message["eventTime"].endswith("Z")

    hook.arrived.clear()
    failed = await invoke_async(
        client,
        EndpointName="raising-handler",
        InputLocation=source.as_uri(),
        ContentType="text/csv",
        InferenceId="notified-failure",
    )
    await asyncio.wait_for(hook.arrived.wait(), 10)
    message = hook.delivered[-1]
    assert message["invocationStatus"] == "Failed"
    assert "feature 0 is out of range" in message["failureReason"]
    assert message["responseParameters"] == {"failureLocation": failed["FailureLocation"]}


# Large inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("accept", ["application/json", "text/csv"])
async def test_an_input_larger_than_a_request_runs_in_pieces_and_answers_as_a_whole(
    serve: Serve, folders: dict[str, Path], accept: str
) -> None:
    rows = b"".join(b"%.3f\n" % (i / 1000) for i in range(2000))  # 12 kB, 2,000 rows
    limit = 1024
    harness = await serve_async(serve, folders, max_request_size=limit)
    whole = await serve()  # takes the whole body in one real-time request
    source = folders["inputs"] / "rows.csv"
    source.write_bytes(rows)
    sent = await invoke_async(
        runtime_client(harness),
        EndpointName="sklearn-3",
        InputLocation=source.as_uri(),
        ContentType="text/csv",
        Accept=accept,
        InferenceId="large",
    )
    assert (await ended(harness, "large"))["Status"] == "done"
    real_time = await invoke(
        runtime_client(whole),
        TargetModel="sklearn-3",
        Body=rows,
        ContentType="text/csv",
        Accept=accept,
    )
    assert path_of(sent["OutputLocation"]).read_bytes() == real_time["Payload"]
    # Each piece was a request of its own, none over the limit.
    batches = (await harness.samples())[("mmserver_batch_size_count", ())]
    assert batches >= len(rows) / limit
    assert not list(folders["outputs"].glob(".*"))  # no staged answer left


async def test_a_large_input_on_the_object_store_runs_in_pieces(
    serve: Serve, folders: dict[str, Path], s3: S3Server
) -> None:
    rows = b"".join(b"%.3f\n" % (i / 1000) for i in range(2000))
    harness = await serve_async(
        serve, folders, max_request_size=1024, async_output_path=f"s3://{BUCKET}/large"
    )
    objects = s3.client()
    objects.put_object(Bucket=BUCKET, Key="requests/large.csv", Body=rows)
    await invoke_async(
        runtime_client(harness),
        EndpointName="sklearn-8",
        InputLocation=f"s3://{BUCKET}/requests/large.csv",
        ContentType="text/csv",
        InferenceId="large-s3",
    )
    assert (await ended(harness, "large-s3"))["Status"] == "done"
    written = objects.get_object(Bucket=BUCKET, Key="large/large-s3.out")
    assert written["ContentType"] == "application/json"
    predictions = json.loads(written["Body"].read())["predictions"]
    assert len(predictions) == 2000
    assert predictions[1000] == pytest.approx(2 * 1.0 + 1, abs=0.05)


# Where answers go -----------------------------------------------------------------------------


async def test_a_loaded_models_own_output_path_is_where_its_answers_go(
    serve: Serve, folders: dict[str, Path], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    own = models / "own-outputs"
    make_tuned_dir(own)
    with (own / "serving.properties").open("a") as props:
        props.write(f"option.async_output_path={tmp_path / 'own'}\n")
    harness = await serve_async(serve, folders, allowed_model_roots=str(models))
    await harness.wlm.register(url=str(own), name=None, overrides={}, synchronous=True)
    source = folders["inputs"] / "one.json"
    source.write_bytes(b"[[0.5]]")
    client = runtime_client(harness)
    sent = await invoke_async(
        client, EndpointName="own-outputs", InputLocation=source.as_uri(), InferenceId="own"
    )
    assert path_of(sent["OutputLocation"]) == (tmp_path / "own" / "own.out").resolve()
    # With no failure path set anywhere, failures go beside the answers.
    assert path_of(sent["FailureLocation"]) == (tmp_path / "own" / "own-error.out").resolve()
    assert (await ended(harness, "own"))["Status"] == "done"
    assert json.loads((tmp_path / "own" / "own.out").read_bytes())["predictions"] == [
        pytest.approx(2.0, abs=0.05)
    ]


async def test_an_unknown_model_ends_in_a_failure_object(
    serve: Serve, folders: dict[str, Path]
) -> None:
    harness = await serve_async(serve, folders)
    response = await harness.post(
        "/endpoints/no-such-model/async-invocations",
        b"[[0.5]]",
        **{"X-Amzn-SageMaker-Inference-Id": "nowhere"},
    )
    assert response.status == 202
    described = await ended(harness, "nowhere")
    assert described["Status"] == "failed"
    assert "no-such-model" in described["Error"]
    failure = json.loads(path_of(response.headers["X-Amzn-SageMaker-FailureLocation"]).read_bytes())
    assert failure["code"] == 404


async def test_an_answer_that_cannot_be_written_fails_the_request(
    serve: Serve, folders: dict[str, Path], s3: S3Server
) -> None:
    harness = await serve_async(
        serve,
        folders,
        async_output_path="s3://no-such-bucket/answers",
        async_failure_path=f"s3://{BUCKET}/unwritable-failures",
    )
    response = await harness.post(
        "/endpoints/sklearn-3/async-invocations",
        b"[[0.5]]",
        **{"X-Amzn-SageMaker-Inference-Id": "unwritable"},
    )
    assert response.status == 202
    described = await ended(harness, "unwritable")
    assert described["Status"] == "failed"
    assert "s3://no-such-bucket/answers/unwritable.out cannot be written" in described["Error"]
    failure = s3.client().get_object(Bucket=BUCKET, Key="unwritable-failures/unwritable-error.out")
    assert "cannot be written" in json.loads(failure["Body"].read())["message"]


async def test_a_failure_names_no_server_folder(
    serve: Serve, folders: dict[str, Path], store_root: Path
) -> None:
    """A failure is shown as a real-time error is: the server's folders (here the model store,
    where inputs may be read) cut from its message, in the failure object and the state call."""
    harness = await serve_async(serve, folders)
    client = runtime_client(harness)
    missing = store_root / "no-such-input.json"
    response = await invoke_async(
        client, EndpointName="sklearn-5", InputLocation=missing.as_uri(), InferenceId="hidden"
    )
    described = await ended(harness, "hidden")
    failure = json.loads(path_of(response["FailureLocation"]).read_bytes())
    assert failure["code"] == 400
    for shown in (failure["message"], described["Error"]):
        assert "no-such-input.json does not exist" in shown
        assert str(store_root) not in shown


async def test_a_tenants_asynchronous_requests_follow_its_rules(
    serve: Serve, folders: dict[str, Path]
) -> None:
    from tests.integration.test_tenants import MANAGEMENT, TENANTS, runtime

    tenants = folders["state"].parent / "tenants.yaml"
    await asyncio.to_thread(tenants.write_text, TENANTS)
    harness = await serve_async(serve, folders, tenants=str(tenants), management_token=MANAGEMENT)
    acme = runtime(harness, "AKIAACME00000001", "acme-secret")
    response = await invoke_async(
        acme, EndpointName="sklearn-1", Body=b"[[0.5]]", ContentType="application/json"
    )
    inference_id = response["InferenceId"]
    path = f"/async-invocations/{inference_id}"
    assert (await harness.client.get(path)).status == 403  # no signature: SageMaker's refusal
    seen = await harness.client.get(path, headers={"Authorization": "Bearer tok-beta-0001"})
    assert seen.status == 404  # another tenant's request is none it knows of
    own = await ended(harness, inference_id, Authorization="Bearer tok-acme-0001")
    assert own["Status"] == "done"
    for kwargs in (
        {"EndpointName": "sklearn-2", "Body": b"[[0.5]]"},
        {"EndpointName": "sklearn-1", "InputLocation": (folders["inputs"] / "x.csv").as_uri()},
    ):
        with pytest.raises(ClientError) as caught:
            await invoke_async(acme, ContentType="application/json", **kwargs)
        assert caught.value.response["Error"]["Code"] == "AccessDeniedException"
