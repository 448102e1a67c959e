"""What the OpenAPI document (:mod:`mmserver.api.openapi`) says of each operation of the route
table: the schemas every document shares (:data:`SCHEMAS`), one :class:`Operation` per operation
(:data:`OPERATIONS`; inference once per protocol, ``infer:<protocol>``) and what each error status
means (:data:`ERROR_TEXT`). A new route's operation is described here, or the server does not
import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmserver.api.protocols import DJL, INFER, KSERVE, SAGEMAKER, TARGET_MODEL, V2
from mmserver.codecs.explanations import ENABLE_EXPLANATIONS
from mmserver.config.model import MANAGEMENT_PARAMS

JSON = "application/json"
_CSV = "text/csv"
REF = "#/components/schemas/"

#: The schemas every document shares (``components.schemas``).
SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "description": "Every error answer outside /v2; its message ends with the request id.",
        "required": ["code", "type", "message"],
        "properties": {
            "code": {"type": "integer", "examples": [400]},
            "type": {"type": "string", "examples": ["BadRequestException"]},
            "message": {"type": "string"},
        },
    },
    "V2Error": {
        "type": "object",
        "description": "An error answer of the Open Inference Protocol.",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "Rows": {
        "description": "The model's input: rows of numbers, records of named columns, or the "
        "TensorFlow Serving, MLflow and pandas forms (instances, inputs, dataframe_split, "
        "dataframe_records).",
        "oneOf": [
            {"type": "array", "items": {"type": "array", "items": {}}},
            {"type": "array", "items": {"type": "object"}},
            {"type": "object"},
        ],
        "examples": [[[0.5, 1.0]]],
    },
    "Predictions": {
        "type": "object",
        "required": ["predictions"],
        "properties": {"predictions": {"type": "array", "items": {}}},
        "examples": [{"predictions": [2.0]}],
    },
    "Explanations": {
        "type": "object",
        "required": ["explanations"],
        "properties": {"explanations": {"type": "array", "items": {"type": "object"}}},
        "examples": [
            {
                "explanations": [
                    {
                        "prediction": 2.0,
                        "method": "tree_shap",
                        "exact": True,
                        "explained": "value",
                        "base_value": 1.5,
                        "attributions": {"x0": 0.75, "x1": -0.25},
                    }
                ]
            }
        ],
    },
    "V2Tensor": {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "datatype": {
                "type": "string",
                "enum": [
                    "BOOL",
                    "UINT8",
                    "UINT16",
                    "UINT32",
                    "UINT64",
                    "INT8",
                    "INT16",
                    "INT32",
                    "INT64",
                    "FP16",
                    "FP32",
                    "FP64",
                    "BYTES",
                ],
            },
            "parameters": {"type": "object"},
            "data": {"type": "array", "items": {}},
        },
    },
    "V2InferenceRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": {"$ref": REF + "V2Tensor"}},
            "outputs": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
        },
    },
    "V2InferenceResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": {"$ref": REF + "V2Tensor"}},
        },
    },
    "V2ModelMetadata": {
        "type": "object",
        "required": ["name", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "array", "items": {"type": "object"}},
        },
    },
    "Status": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}},
    },
    "ModelList": {
        "type": "object",
        "required": ["models"],
        "properties": {
            "models": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "modelName": {"type": "string"},
                        "modelUrl": {"type": "string"},
                        "status": {"type": "string"},
                    },
                },
            },
            "nextPageToken": {"type": "string"},
        },
    },
    "Description": {
        "type": "array",
        "description": "DJL Serving's DescribeWorkflowResponse: workflows, each with its "
        "models (configuration, workers, status, and the server's own fields: memory, lane, "
        "cost, input columns, pinned...).",
        "items": {
            "type": "object",
            "properties": {
                "workflowName": {"type": "string"},
                "models": {"type": "array", "items": {"type": "object"}},
            },
        },
    },
    "AsyncAccepted": {
        "type": "object",
        "required": ["InferenceId"],
        "properties": {"InferenceId": {"type": "string"}},
    },
    "AsyncState": {"type": "object", "properties": {"status": {"type": "string"}}},
    "Health": {"type": "object"},
}

PATH_PARAMETERS = {
    "model": "The model's name (on the SageMaker path, `NAME` or `NAME.tar.gz`).",
    "version": "A version of the model (a number).",
    "endpoint": "The SageMaker endpoint's name (any; the model is the target model's).",
    "inference_id": "The InferenceId an asynchronous request was answered with.",
}


def _parameter(
    name: str, kind: str, where: str = "query", required: bool = False, description: str = ""
) -> dict[str, Any]:
    """A query or header parameter of ``kind`` (a JSON Schema type)."""
    parameter: dict[str, Any] = {"name": name, "in": where, "required": required}
    if description:
        parameter["description"] = description
    parameter["schema"] = {"type": kind}
    return parameter


def _content(kind: str, description: str) -> dict[str, Any]:
    """A 200 answer of the media type ``kind`` whose body the document does not describe."""
    return {"200": {"description": description, "content": {kind: {"schema": {}}}}}


#: Management parameters of ``PUT /models/{model}`` and ``POST /models`` (DJL's names).
_MANAGEMENT_QUERY = [_parameter(param, "integer") for param in MANAGEMENT_PARAMS]
_PERCENT = [_parameter("percent", "number", required=True)]


def json_content(schema: str, example: Any = None) -> dict[str, Any]:
    content: dict[str, Any] = {"schema": {"$ref": REF + schema}}
    if example is not None:
        content["example"] = example
    return {JSON: content}


def answer(description: str, schema: str = "", example: Any = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": description}
    if schema:
        answer["content"] = json_content(schema, example)
    return answer


@dataclass(frozen=True)
class Operation:
    """How one operation of the route table is described."""

    summary: str
    tag: str
    description: str = ""
    #: The request's body (an OpenAPI ``requestBody``), or none.
    body: dict[str, Any] | None = None
    #: Answers other than the errors every route has.
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Query and header parameters.
    parameters: list[dict[str, Any]] = field(default_factory=list)
    #: Errors the operation answers with, besides 500.
    errors: tuple[int, ...] = (400, 404, 503)


_ROWS_BODY = {
    "required": True,
    "content": {
        JSON: {"schema": {"$ref": REF + "Rows"}, "example": [[0.5]]},
        _CSV: {"schema": {"type": "string"}, "example": "0.5\n1.0\n"},
    },
}
_PREDICTIONS = {"200": answer("The model's answers, one per row.", "Predictions")}
_TARGET_TEXT = (
    "The model (boto3's TargetModel: NAME or NAME.tar.gz, NAME/2.tar.gz for a version); or the "
    "model_name query parameter."
)
_TARGET = _parameter(TARGET_MODEL, "string", "header", description=_TARGET_TEXT)
_PAGE = [_parameter("limit", "integer"), _parameter("next_page_token", "string")]
_HTML_PAGE = _content("text/html", "A page.")
_OPENAPI = _content(JSON, "OpenAPI 3.1.")
_V2_INFER_BODY = {
    "required": True,
    "content": json_content(
        "V2InferenceRequest",
        {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP64", "data": [0.5]}]},
    ),
}

#: The description of each operation of the route table; inference per protocol
#: (``infer:<protocol>``).
OPERATIONS: dict[str, Operation] = {
    f"{INFER}:{DJL.name}": Operation(
        "Predict (DJL Serving)",
        "inference",
        "Rows as JSON (numbers, records, or the instances/inputs/dataframe forms) or CSV; "
        "one answer per row.",
        _ROWS_BODY,
        _PREDICTIONS,
        errors=(400, 401, 403, 404, 413, 415, 424, 429, 503, 504),
    ),
    f"{INFER}:{SAGEMAKER.name}": Operation(
        "Invoke a model (SageMaker)",
        "inference",
        "SageMaker's InvokeEndpoint; with tenants, signed with AWS Signature Version 4. With "
        f"{ENABLE_EXPLANATIONS} (a JMESPath expression over each record's prediction), "
        "answered as SageMaker Clarify answers, the records it is true of explained.",
        _ROWS_BODY,
        _PREDICTIONS,
        [
            _TARGET,
            _parameter("model_name", "string"),
            _parameter(ENABLE_EXPLANATIONS, "string", "header"),
        ],
        errors=(400, 403, 404, 413, 415, 424, 429, 503, 504),
    ),
    f"{INFER}:{V2.name}": Operation(
        "Infer (Open Inference Protocol)",
        "inference",
        "One input per column for a model fitted on a DataFrame, or one matrix.",
        _V2_INFER_BODY,
        {"200": answer("The model's outputs.", "V2InferenceResponse")},
        errors=(400, 401, 403, 404, 413, 424, 429, 503, 504),
    ),
    f"{INFER}:{KSERVE.name}": Operation(
        "Explain (KServe V1)",
        "inference",
        "Every instance's prediction with its attributions per input column and its base "
        "value: exact for tree ensembles and linear models, Kernel SHAP against the model's "
        "background otherwise.",
        _ROWS_BODY,
        {"200": answer("One explanation per instance.", "Explanations")},
        errors=(400, 401, 403, 404, 413, 415, 424, 429, 503, 504),
    ),
    "invoke_async": Operation(
        "Invoke asynchronously (SageMaker InvokeEndpointAsync)",
        "asynchronous",
        "Journaled before the 202; the answer is written to the output location.",
        _ROWS_BODY,
        {"202": answer("Accepted.", "AsyncAccepted")},
        [
            _parameter(TARGET_MODEL, "string", "header", True, _TARGET_TEXT),
            _parameter("X-Amzn-SageMaker-InputLocation", "string", "header"),
        ],
        errors=(400, 403, 404, 429, 503),
    ),
    "async_status": Operation(
        "State of an asynchronous request",
        "asynchronous",
        answers={"200": answer("Its state and where its answer is.", "AsyncState")},
        errors=(404,),
    ),
    "ping": Operation(
        "Health (DJL Serving, SageMaker)",
        "health",
        answers={"200": answer("Healthy.", "Status", {"status": "Healthy"})},
        errors=(503,),
    ),
    "list_models": Operation(
        "List the models",
        "management",
        "Sorted by name, paged.",
        answers={"200": answer("A page of models.", "ModelList")},
        parameters=_PAGE,
        errors=(400, 401),
    ),
    "register_model": Operation(
        "Register and load a model",
        "management",
        "From a folder or archive under the allowed roots.",
        answers={"200": answer("Registered.", "Status"), "202": answer("Loading.", "Status")},
        parameters=[
            _parameter("url", "string", required=True),
            _parameter("model_name", "string"),
            *_MANAGEMENT_QUERY,
        ],
        errors=(400, 401, 404, 409, 507),
    ),
    "describe_model": Operation(
        "Describe a model",
        "management",
        answers={"200": answer("DJL's description, with the server's own fields.", "Description")},
        errors=(401, 403, 404),
    ),
    "rescale_model": Operation(
        "Change a model's workers and batching, or pin it",
        "management",
        answers={"200": answer("Changed.", "Status")},
        parameters=[
            *_MANAGEMENT_QUERY,
            _parameter("pinned", "boolean"),
            _parameter("synchronous", "boolean"),
        ],
        errors=(400, 401, 404, 507),
    ),
    "unload_model": Operation(
        "Unload a model",
        "management",
        answers={"200": answer("Unloaded.", "Status")},
        errors=(401, 404),
    ),
    "set_default_version": Operation(
        "Make a version the default",
        "management",
        answers={"200": answer("Switched.", "Status")},
        errors=(400, 401, 404, 507),
    ),
    "set_canary_version": Operation(
        "Send a share of the requests to a version",
        "management",
        answers={"200": answer("Set.", "Status")},
        parameters=_PERCENT,
        errors=(400, 401, 404, 507),
    ),
    "set_shadow_version": Operation(
        "Run a share of the requests on a version too, answering from the default",
        "management",
        answers={"200": answer("Set.", "Status")},
        parameters=_PERCENT,
        errors=(400, 401, 404, 507),
    ),
    "peer_rollouts": Operation(
        "The versions' rollouts set through the management API, for a new peer",
        "management",
        answers=_content("application/json", "The contents of rollouts.json."),
        errors=(401,),
    ),
    "metrics": Operation(
        "Prometheus metrics",
        "health",
        answers=_content("text/plain", "The text exposition format."),
        errors=(401,),
    ),
    "server_metadata": Operation(
        "Server metadata (Open Inference Protocol)",
        "health",
        answers={"200": answer("Name, version, extensions.", "Health")},
        errors=(),
    ),
    "live": Operation(
        "Liveness (Open Inference Protocol)",
        "health",
        answers={"200": answer("Live.", "Health", {"live": True})},
        errors=(),
    ),
    "ready": Operation(
        "Readiness (Open Inference Protocol)",
        "health",
        answers={"200": answer("Ready.", "Health", {"ready": True})},
        errors=(503,),
    ),
    "model_ready": Operation(
        "Whether a model is ready (Open Inference Protocol)",
        "health",
        answers={"200": answer("Ready.", "Health")},
        errors=(400, 403, 404),
    ),
    "model_metadata": Operation(
        "A model's inputs and outputs (Open Inference Protocol)",
        "inference",
        "Loads the model if it is not loaded.",
        answers={"200": answer("Its metadata.", "V2ModelMetadata")},
        errors=(400, 403, 404, 503),
    ),
    "repository_index": Operation(
        "The model repository's index",
        "management",
        answers={
            "200": {
                "description": "Every model with its state.",
                "content": {JSON: {"schema": {"type": "array", "items": {"type": "object"}}}},
            }
        },
        errors=(400, 401),
    ),
    "repository_load": Operation(
        "Load a model", "management", answers={"200": answer("Loaded.")}, errors=(400, 401, 404)
    ),
    "repository_unload": Operation(
        "Unload a model",
        "management",
        answers={"200": answer("Unloaded.")},
        errors=(400, 401, 404),
    ),
    "openapi": Operation(
        "This document",
        "pages",
        answers=_OPENAPI,
        errors=(),
    ),
    "docs": Operation(
        "Browsable API documentation",
        "pages",
        answers=_HTML_PAGE,
        errors=(),
    ),
    "docs_asset": Operation(
        "A file of the documentation page",
        "pages",
        answers={"200": {"description": "The file."}},
        errors=(404,),
    ),
    "model_docs": Operation(
        "A model's documentation page, where it can be called",
        "pages",
        answers=_HTML_PAGE,
        errors=(403, 404),
    ),
    "model_openapi": Operation(
        "A model's OpenAPI document: its input, versions and an example",
        "pages",
        answers=_OPENAPI,
        errors=(403, 404, 503),
    ),
    "status": Operation(
        "The server's status page",
        "pages",
        answers=_HTML_PAGE,
        errors=(),  # the page holds no data: /status.json asks for the token
    ),
    "status_data": Operation(
        "What the status page shows",
        "pages",
        answers={"200": answer("Models, backends and the budget.", "Health")},
        parameters=[_parameter("filter", "string"), _parameter("page", "integer")],
        errors=(400, 401),
    ),
}

ERROR_TEXT = {
    400: "The request cannot be taken (what was expected is said).",
    401: "No token the server knows.",
    403: "Not this caller's model.",
    404: "No such model, version or request.",
    409: "A model of that name is registered already.",
    413: "The body is over max_request_size.",
    415: "A Content-Type the route does not take.",
    424: "The model raised while predicting.",
    429: "Over the tenant's rate or max_concurrent (Retry-After).",
    503: "Busy, full queue, no room, or stopping (Retry-After).",
    504: "Not answered within predict_timeout.",
    507: "No room to load the model.",
}
