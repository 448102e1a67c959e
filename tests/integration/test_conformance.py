"""Wire conformance with the peers whose clients users keep: DJL Serving, the SageMaker
multi-model container contract and ``boto3``'s ``sagemaker-runtime`` client.

Each test states one fact of a peer and where the peer's own source says it (repository, file and
class), so a change that drifts from the peer fails here. The DJL sources are those of
deepjavalibrary/djl-serving (``serving/src/main/java/ai/djl/serving/...``, its ``wlm`` module and
its ``ModelServerTest``) and deepjavalibrary/djl (``api/src/main/java/ai/djl/...``); botocore's is
its service model ``botocore/data/sagemaker-runtime/2017-05-13/service-2.json``; Java's is the
Javadoc of ``java.util.Properties.load(Reader)``. Where mmserver departs from a peer on purpose,
``docs/compatibility.md`` says so and why; those departures are tested where the
feature is (test_management, test_errors).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmserver import errors
from mmserver.config.server import ModelConfig, load_model_config, parse_properties
from mmserver.errors import ConfigError
from mmserver.store.urls import name_from_url
from tests.integration.harness import Harness, Serve, describe, error_of
from tests.integration.test_boto3 import raised, runtime_client
from tests.models import make_linear_model

COMPATIBILITY = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
DJL_DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


# ------------------------------------------------------------------------------------------------
# x-request-id on every answer
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/ping", None, 200),
        ("POST", "/predictions/sklearn-0", b"[[0.5]]", 200),
        ("POST", "/invocations?model_name=sklearn-0", b"[[0.5]]", 200),
        ("POST", "/models/sklearn-0/invoke", b"[[0.5]]", 200),
        ("GET", "/models", None, 200),
        ("GET", "/models/sklearn-0", None, 200),
        ("GET", "/metrics", None, 200),
        ("GET", "/v2/health/live", None, 200),
        ("GET", "/v2/health/ready", None, 200),
        ("POST", "/predictions/no-such-model", b"[[0.5]]", 404),
        ("GET", "/no/such/path", None, 404),
    ],
)
async def test_every_answer_has_a_request_id(
    server: Harness, method: str, path: str, body: bytes | None, status: int
) -> None:
    """DJL: ``NettyUtils.sendHttpResponse`` sets ``x-request-id`` (the ``Session``'s id) on every
    response it sends, success or error; ``ModelServerTest.testPing`` asserts it on ``/ping``
    and ``testKServeV2HealthReady``/``testKServeV2HealthLive`` on the V2 health paths."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    response = await server.client.request(method, path, data=body, headers=headers)
    assert response.status == status
    assert response.headers["x-request-id"]


async def test_request_ids_differ_and_a_clients_own_is_echoed(server: Harness) -> None:
    """DJL: ``Session(remoteIp, request)`` takes the request id from the request's header named
    by ``request_id_header_key`` (``ConfigManager.getRequestIdHeaderKey``, default
    ``x-request-id``) and makes a new one (a UUID) only when the request has none."""
    first = await server.client.get("/ping")
    second = await server.client.get("/ping")
    assert first.headers["x-request-id"] != second.headers["x-request-id"]
    mine = await server.post("/predictions/sklearn-0", "[[0.5]]", **{"x-request-id": "trace-42"})
    assert mine.status == 200 and mine.headers["x-request-id"] == "trace-42"
    failed = await server.post("/predictions/nope", "[[0.5]]", **{"x-request-id": "trace-43"})
    assert failed.headers["x-request-id"] == "trace-43"
    assert (await error_of(failed))["message"].endswith("(request id trace-43)")


# ------------------------------------------------------------------------------------------------
# Management status messages
# ------------------------------------------------------------------------------------------------


async def test_register_messages(server: Harness) -> None:
    """DJL: ``ManagementRequestHandler.handleRegisterModel`` answers
    ``Model "NAME" registered.`` (200) when synchronous and ``Model "NAME" registration
    scheduled.`` (202) otherwise; ``ModelServerTest.testRegisterModel`` and
    ``testRegisterModelAsync`` assert both strings."""
    response = await server.client.post(
        "/models", params={"url": "sklearn-13.tar.gz", "model_name": "sync-one"}
    )
    assert (response.status, await response.json()) == (
        200,
        {"status": 'Model "sync-one" registered.'},
    )
    response = await server.client.post(
        "/models",
        params={"url": "sklearn-14.tar.gz", "model_name": "async-one", "synchronous": "false"},
    )
    assert (response.status, await response.json()) == (
        202,
        {"status": 'Model "async-one" registration scheduled.'},
    )


async def scale(server: Harness, name: str, low: int, high: int) -> None:
    """``PUT /models/NAME?min_worker=LOW&max_worker=HIGH``, checking DJL's answer."""
    params = {"min_worker": str(low), "max_worker": str(high)}
    response = await server.client.put(f"/models/{name}", params=params)
    assert response.status == 200
    assert await response.json() == {
        "status": f'Workflow "{name}" worker scaled. New Worker configuration '
        f"min workers:{low} max workers:{high}"
    }


async def test_scale_message(server: Harness) -> None:
    """DJL: ``ManagementRequestHandler.handleScaleWorkflow`` answers ``Workflow "NAME" worker
    scaled. New Worker configuration min workers:MIN max workers:MAX``; asserted by
    ``ModelServerTest.testScaleModel`` (``min_worker=2&max_worker=4``)."""
    await scale(server, "sklearn-15", 1, 2)


async def test_unregister_message(server: Harness) -> None:
    """DJL: ``ManagementRequestHandler.handleUnregisterWorkflow`` answers ``Model or workflow
    "NAME" unregistered`` (no period); ``ModelServerTest.testUnregisterModel`` asserts it."""
    assert (await server.post("/predictions/sklearn-16", "[[0.5]]")).status == 200
    response = await server.client.delete("/models/sklearn-16")
    assert response.status == 200
    assert await response.json() == {"status": 'Model or workflow "sklearn-16" unregistered'}


# ------------------------------------------------------------------------------------------------
# Describe and list
# ------------------------------------------------------------------------------------------------


async def test_describe_is_an_array_of_workflows_holding_models(server: Harness) -> None:
    """DJL: ``ModelManager.describeWorkflow`` answers ``DescribeWorkflowResponse[]``: each has
    ``workflowName``, ``version`` (null for an unversioned model, so Gson leaves it out:
    ``JsonUtils.GSON_PRETTY`` does not serialize nulls) and ``models``, whose
    ``DescribeWorkflowResponse.Model`` fields are ``modelName``, ``modelUrl``, ``batchSize``,
    ``maxBatchDelayMillis``, ``maxIdleSeconds``, ``queueSize``, ``requestInQueue``, ``status``,
    ``loadedAtStartup`` and ``workerGroups`` (``Group``: ``device``, ``minWorkers``,
    ``maxWorkers``, ``workers``; ``Worker``: ``id``, ``startTime``, ``status``). Dates are
    written as ``yyyy-MM-dd'T'HH:mm:ss.SSS'Z'`` (``JsonUtils.builder``).
    ``ModelServerTest.testDescribeModel`` reads ``resp[0].getModels().get(0)``."""
    assert (await server.post("/predictions/sklearn-17", "[[0.5]]")).status == 200
    response = await server.client.get("/models/sklearn-17")
    assert response.status == 200
    body = await response.json()
    assert isinstance(body, list) and len(body) == 1
    [workflow] = body
    assert set(workflow) == {"workflowName", "models"}
    assert workflow["workflowName"] == "sklearn-17"
    [model] = workflow["models"]
    djl_fields = {
        "modelName",
        "modelUrl",
        "batchSize",
        "maxBatchDelayMillis",
        "maxIdleSeconds",
        "queueSize",
        "requestInQueue",
        "status",
        "loadedAtStartup",
        "workerGroups",
    }
    assert djl_fields <= set(model)
    assert model["modelName"] == "sklearn-17"
    assert model["loadedAtStartup"] is False
    [group] = model["workerGroups"]
    assert group["device"] == {"deviceType": "cpu", "deviceId": -1}
    [worker] = group["workers"]
    assert worker["id"] > 0
    assert DJL_DATE.fullmatch(worker["startTime"]), worker["startTime"]


async def test_a_loaded_model_is_healthy(server: Harness) -> None:
    """DJL: ``DescribeWorkflowResponse`` gives a READY model the status ``Healthy`` when its
    workers number at least its groups' ``minWorkers`` (``Unhealthy`` otherwise);
    ``ModelServerTest.testDescribeModel`` asserts ``Healthy``. The list keeps the model's own
    status, ``READY`` (``ManagementRequestHandler.handleListModels``:
    ``wpc.getStatus().toString()``)."""
    assert (await server.post("/predictions/sklearn-18", "[[0.5]]")).status == 200
    assert (await describe(server, "sklearn-18"))["status"] == "Healthy"
    response = await server.client.get(
        "/models", params={"limit": "1", "next_page_token": "sklearn-179"}
    )
    [listed] = (await response.json())["models"]
    assert (listed["modelName"], listed["status"]) == ("sklearn-18", "READY")


async def test_loaded_at_startup(serve: Serve) -> None:
    """DJL: ``DescribeWorkflowResponse`` sets ``loadedAtStartup`` when the model is one of
    ``ModelManager.getStartupWorkflows()`` (the models named at start), false for one registered
    or loaded later (``ModelServerTest.testDescribeModel`` asserts false)."""
    harness = await serve(load_models="sklearn-19")
    assert (await describe(harness, "sklearn-19"))["loadedAtStartup"] is True
    assert (await harness.post("/predictions/sklearn-20", "[[0.5]]")).status == 200
    assert (await describe(harness, "sklearn-20"))["loadedAtStartup"] is False


# ------------------------------------------------------------------------------------------------
# Error types
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "djl_type"),
    [
        ("POST", "/predictions/no-such-model", 404, "ModelNotFoundException"),
        ("GET", "/models/no-such-model", 404, "ModelNotFoundException"),
        ("DELETE", "/models/no-such-model", 404, "ModelNotFoundException"),
        ("GET", "/no/such/path", 404, "ResourceNotFoundException"),
        ("PUT", "/ping", 405, "MethodNotAllowedException"),
        ("POST", "/models", 400, "BadRequestException"),
    ],
)
async def test_error_type_is_djls_exception_name(
    server: Harness, method: str, path: str, status: int, djl_type: str
) -> None:
    """DJL: ``NettyUtils.sendError(ctx, status, t)`` writes ``ErrorResponse(code, type,
    message)`` with ``type = t.getClass().getSimpleName()``: ``ModelNotFoundException`` for an
    unknown model (``ModelServerTest.testRegisterModelNotFound`` asserts that type),
    ``ResourceNotFoundException`` for an unknown path, ``MethodNotAllowedException``,
    ``BadRequestException`` (``Parameter url is required.``)."""
    response = await server.client.request(
        method, path, data=b"[[0.5]]", headers={"Content-Type": "application/json"}
    )
    assert response.status == status
    assert (await error_of(response))["type"] == djl_type


async def test_conflict_is_a_bad_request_exception(server: Harness) -> None:
    """DJL: ``ModelManager.registerWorkflow`` throws ``BadRequestException(409, "Workflow NAME
    is already registered.")``; ``ModelServerTest.testRegisterModelConflict`` asserts 409."""
    params = {"url": "sklearn-21.tar.gz", "model_name": "twice"}
    assert (await server.client.post("/models", params=params)).status == 200
    response = await server.client.post("/models", params=params)
    assert response.status == 409
    assert (await error_of(response))["type"] == "BadRequestException"


def test_every_error_has_a_djl_name_and_the_compatibility_page_shows_the_table() -> None:
    """The mapping from the error tree to DJL's Java exceptions is one table
    (:data:`mmserver.errors.DJL_TYPES`); the table of ``docs/compatibility.md`` says the same.
    DJL's names: ``serving/.../http/*Exception.java``, ``wlm/.../util/Wlm*Exception.java``,
    ``ai.djl.repository.zoo.ModelNotFoundException``, ``ai.djl.engine.EngineException``,
    ``ai.djl.translate.TranslateException``, ``ai.djl.MalformedModelException``."""
    tree = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.MMServerError)
    ]
    page = dict(re.findall(r"^\| `(\w+)` \| \d{3} \| `(\w+)` \|", COMPATIBILITY.read_text(), re.M))
    assert set(page) == {cls.__name__ for cls in tree}
    for cls in tree:
        assert errors.djl_type(cls) == page[cls.__name__], cls.__name__
        assert cls("x").to_dict()["type"] == page[cls.__name__]


# ------------------------------------------------------------------------------------------------
# Register without a name
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("my-model.tar.gz", "my_model"),
        ("file:///models/my-model.tar.gz", "my_model"),
        ("/models/Model.TAR.GZ", "Model"),
        ("/models/m.tgz", "m"),
        ("/models/m.zip", "m"),
        ("/models/m.tar", "m"),
        ("/models/m.mar", "m"),
        ("/models/m.gz", "m"),
        ("/models/m.tar.z", "m"),
        ("/models/m.Tgz", "m_Tgz"),  # only .tar.gz is matched in any case
        ("/models/my.model/", "my_model"),  # a directory keeps what looks like an extension
        ("/models/my.model.tar.gz/", "my_model_tar_gz"),
        ("s3://bucket/prefix/model-7.tar.gz", "model_7"),
        ("file:///models/caf%C3%A9", "caf_"),  # \W is ASCII-only in Java's regex
        ("models/a b+c", "a_b_c"),
    ],
)
def test_name_from_url(url: str, name: str) -> None:
    """DJL: ``ModelInfo.inferModelNameFromUrl`` takes the last segment of the url's path,
    drops its archive extension with ``FilenameUtils.getNamePart`` (``.tar.gz`` in any case;
    ``.tar.z``, ``.tgz``, ``.zip``, ``.tar``, ``.mar``, ``.gz``, ``.z`` as written) unless the
    url ends with ``/``, then ``replaceAll("(\\\\W|^_)", "_")``; ``LoadModelRequest`` calls it
    when ``model_name`` is missing or empty."""
    assert name_from_url(url) == name


async def test_register_without_a_name(server: Harness) -> None:
    """DJL: ``LoadModelRequest(decoder)`` names a model registered without ``model_name`` (or
    with an empty one) by ``ModelInfo.inferModelNameFromUrl(url)``: ``sklearn-22.tar.gz``
    registers ``sklearn_22``, and the folder ``custom-handler/`` registers ``custom_handler``."""
    response = await server.client.post("/models", params={"url": "sklearn-22.tar.gz"})
    assert await response.json() == {"status": 'Model "sklearn_22" registered.'}
    assert (await server.post("/predictions/sklearn_22", "[[0.5]]")).status == 200
    response = await server.client.post(
        "/models", json={"url": "custom-handler/", "model_name": "", "trusted": True}
    )
    assert await response.json() == {"status": 'Model "custom_handler" registered.'}
    assert (await describe(server, "custom_handler"))["modelUrl"] == "custom-handler/"


# ------------------------------------------------------------------------------------------------
# Scaling to no worker
# ------------------------------------------------------------------------------------------------


async def test_scale_to_no_worker_then_back(server: Harness) -> None:
    """DJL: ``PUT /models/NAME?min_worker=0&max_worker=0`` is taken (``WorkerGroup.
    configureWorkers`` accepts any value >= 0); a prediction is then refused by
    ``WorkLoadManager.runJob`` with ``WlmShutdownException("All model workers has been
    shutdown: NAME")``, a ``WlmException`` answered 503 (``ConfigManager.getWlmErrorHttpCode``);
    ``ModelServerTest.testServiceUnavailable`` asserts both."""
    assert (await server.post("/predictions/sklearn-23", "[[0.5]]")).status == 200
    await scale(server, "sklearn-23", 0, 0)
    response = await server.post("/predictions/sklearn-23", "[[0.5]]")
    assert response.status == 503
    body = await error_of(response)
    assert body["type"] == "WlmShutdownException"
    assert "model sklearn-23 has no workers: its maxWorkers is 0" in body["message"]
    model = await describe(server, "sklearn-23")
    assert model["workerGroups"][0]["workers"] == []
    assert model["status"] == "Healthy"  # no worker is below minWorkers 0

    response = await server.client.put("/models/sklearn-23", params={"max_worker": "1"})
    assert response.status == 200
    assert (await server.post("/predictions/sklearn-23", "[[0.5]]")).status == 200


# ------------------------------------------------------------------------------------------------
# boto3's ModelError
# ------------------------------------------------------------------------------------------------


async def test_boto3_model_error_has_the_original_status_and_message(server: Harness) -> None:
    """botocore ``sagemaker-runtime`` service model: the ``ModelError`` shape (424) has the
    members ``Message``, ``OriginalStatusCode`` (an integer), ``OriginalMessage`` and
    ``LogStreamArn``; botocore's rest-json parser reads the modeled members from the error's
    JSON body into the exception's ``response``."""
    client = runtime_client(server)
    exc = await raised(client, TargetModel="raising-handler", Body=b"[[0.5]]")
    assert isinstance(exc, client.exceptions.ModelError)
    assert exc.response["OriginalStatusCode"] == 424
    assert exc.response["OriginalMessage"] == ("ValueError: feature 0 is out of range")
    assert exc.response["Error"]["Message"].startswith(exc.response["OriginalMessage"])


# ------------------------------------------------------------------------------------------------
# serving.properties is java.util.Properties
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Truth = Beauty", {"Truth": "Beauty"}),
        ("  Truth:Beauty", {"Truth": "Beauty"}),
        ("Truth                    :Beauty", {"Truth": "Beauty"}),
        (
            "fruits                           apple, banana, pear, \\\n"
            "                                 cantaloupe, watermelon, \\\n"
            "                                 kiwi, mango",
            {"fruits": "apple, banana, pear, cantaloupe, watermelon, kiwi, mango"},
        ),
        ("cheeses", {"cheeses": ""}),
        ("\\:\\= = x", {":=": "x"}),
        ("key = = value", {"key": "= value"}),
        ("key\fvalue", {"key": "value"}),
        ("key\t  value", {"key": "value"}),
        ("# a comment \\\nkey=value", {"key": "value"}),
        ("! a comment\n   \n\t\nkey=value", {"key": "value"}),
        ("key=value  ", {"key": "value  "}),
        ("key=a\\tb\\nc\\rd\\fe", {"key": "a\tb\nc\rd\fe"}),
        ("key=\\u0041\\u00e9\\u20AC", {"key": "A\u00e9\u20ac"}),
        ("key=\\uD83D\\uDE00", {"key": "\U0001f600"}),
        ("key=back\\\\slash", {"key": "back\\slash"}),
        ("\\#not-a-comment=1", {"#not-a-comment": "1"}),
        ("key=\\#1 and \\!2", {"key": "#1 and !2"}),
        ("key=\\b\\z", {"key": "bz"}),
        ("my\\ key=1", {"my key": "1"}),
        ("key=even\\\\\nnext=1", {"key": "even\\", "next": "1"}),
        ("key=odd\\\\\\\n   more", {"key": "odd\\more"}),
        ("key=four\\\\\\\\\nnext=2", {"key": "four\\\\", "next": "2"}),
        ("key=one\\\n", {"key": "one"}),
        ("a=1\rb=2\r\nc=3\n", {"a": "1", "b": "2", "c": "3"}),
        ("a=1\na=2", {"a": "2"}),
    ],
)
def test_properties_read_as_java_does(text: str, expected: dict[str, str]) -> None:
    """Java: ``java.util.Properties.load(Reader)`` (DJL's ``ModelInfo.loadServingProperties``
    reads ``serving.properties`` with it). Its Javadoc: a key ends at the first unescaped
    ``=``, ``:`` or white space (space, ``\\t``, ``\\f``), then white space and one ``=`` or
    ``:`` are skipped, and the value's leading white space; the value keeps its trailing
    white space; ``#`` and ``!`` start comment lines, which do not continue; a line continues
    when it ends with an odd number of backslashes, and the next line's leading white space is
    dropped; ``\\t``, ``\\n``, ``\\f``, ``\\r``, ``\\uXXXX`` are unescaped and a backslash before
    any other character is dropped (``\\b`` is ``b``); lines end with ``\\n``, ``\\r`` or
    ``\\r\\n``; a later key wins (``Hashtable.put``). Its examples ``Truth = Beauty``,
    ``fruits ...`` and ``cheeses`` are the first rows."""
    assert parse_properties(text) == expected


@pytest.mark.parametrize("text", ["key=\\u12", "key=\\u12G4", "key=\\uXYZW"])
def test_a_malformed_unicode_escape_is_refused(tmp_path: Path, text: str) -> None:
    """Java: ``Properties.load`` throws ``IllegalArgumentException("Malformed \\\\uxxxx
    encoding.")``: the model's configuration cannot be read, so its load fails."""
    (tmp_path / "serving.properties").write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"serving\.properties: malformed \\uXXXX escape"):
        load_model_config(tmp_path, ModelConfig(max_workers=2))


async def test_a_models_properties_are_read_as_java_does(serve: Serve, tmp_path: Path) -> None:
    """The same rules over HTTP: a model whose ``serving.properties`` spells its values with
    escapes, continuations and trailing spaces is described with the values Java reads."""
    store = tmp_path / "store"
    make_linear_model(store / "escaped")
    (store / "escaped" / "serving.properties").write_text(
        "# batch size 4, spelled with a unicode escape\n"
        "batch_size = \\u0034   \n"
        "max_batch_delay : 1\\\n"
        "                  5\n"
        "option.note=a \\# b\n"
    )
    harness = await serve(model_store=str(store))
    response = await harness.post("/predictions/escaped", "[[0.5]]")
    assert response.status == 200, await response.text()
    model = await describe(harness, "escaped")
    assert (model["batchSize"], model["maxBatchDelayMillis"]) == (4, 15)
    pool = harness.wlm.room.loaded.get("escaped")
    assert pool is not None
    assert pool.config.properties["option.note"] == "a # b"
    # "200\\" is not a number: that key is refused when its value is read.
    (store / "escaped" / "serving.properties").write_text("job_queue_size=200\\\\\n")
    assert (await harness.client.delete("/models/escaped")).status == 200
    response = await harness.post("/predictions/escaped", "[[0.5]]")
    assert response.status == 500
    message = (await error_of(response))["message"]
    assert "job_queue_size='200\\\\' is not a valid integer" in message
