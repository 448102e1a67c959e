"""The API described in OpenAPI 3.1: :func:`document` makes it from the one route table
(:data:`~mmserver.api.protocols.ROUTES`) and one description per operation (:data:`OPERATIONS`),
so a route cannot be served without being described (the table is checked whole at import);
:func:`model_document` describes one model's inference calls with what its load told of its input
(columns, kinds, categories, whether missing values are taken), its versions and an example body
made from its MLflow ``input_example`` or the row its load probes predict (zeros), so that a
browser's "Try it out" works on the first click.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field
from typing import Any

from mmserver import __version__
from mmserver.api.protocols import (
    DJL,
    INFER,
    ROUTES,
    SAGEMAKER,
    TARGET_MODEL,
    V2,
    Protocol,
    Route,
    plain_path,
)
from mmserver.config.model import MANAGEMENT_PARAMS

_JSON = "application/json"
_CSV = "text/csv"
_REF = "#/components/schemas/"

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
            "inputs": {"type": "array", "items": {"$ref": _REF + "V2Tensor"}},
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
            "outputs": {"type": "array", "items": {"$ref": _REF + "V2Tensor"}},
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

_PATH_PARAMETERS = {
    "model": "The model's name (on the SageMaker path, `NAME` or `NAME.tar.gz`).",
    "version": "A version of the model (a number).",
    "endpoint": "The SageMaker endpoint's name (any; the model is the target model's).",
    "inference_id": "The InferenceId an asynchronous request was answered with.",
}

#: Management parameters of ``PUT /models/{model}`` and ``POST /models`` (DJL's names).
_MANAGEMENT_QUERY = [
    {"name": param, "in": "query", "required": False, "schema": {"type": "integer"}}
    for param in MANAGEMENT_PARAMS
]


def _json(schema: str, example: Any = None) -> dict[str, Any]:
    content: dict[str, Any] = {"schema": {"$ref": _REF + schema}}
    if example is not None:
        content["example"] = example
    return {_JSON: content}


def _answer(description: str, schema: str = "", example: Any = None) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": description}
    if schema:
        answer["content"] = _json(schema, example)
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
        _JSON: {"schema": {"$ref": _REF + "Rows"}, "example": [[0.5]]},
        _CSV: {"schema": {"type": "string"}, "example": "0.5\n1.0\n"},
    },
}
_PREDICTIONS = {"200": _answer("The model's answers, one per row.", "Predictions")}
_TARGET = {
    "name": TARGET_MODEL,
    "in": "header",
    "required": False,
    "description": "The model (boto3's TargetModel: NAME or NAME.tar.gz, NAME/2.tar.gz for a "
    "version); or the model_name query parameter.",
    "schema": {"type": "string"},
}
_MODEL_NAME_QUERY = {
    "name": "model_name",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
}
_PAGE = [
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer"}},
    {"name": "next_page_token", "in": "query", "required": False, "schema": {"type": "string"}},
]
_V2_INFER_BODY = {
    "required": True,
    "content": _json(
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
        "SageMaker's InvokeEndpoint; with tenants, signed with AWS Signature Version 4.",
        _ROWS_BODY,
        _PREDICTIONS,
        [_TARGET, _MODEL_NAME_QUERY],
        errors=(400, 403, 404, 413, 415, 424, 429, 503, 504),
    ),
    f"{INFER}:{V2.name}": Operation(
        "Infer (Open Inference Protocol)",
        "inference",
        "One input per column for a model fitted on a DataFrame, or one matrix.",
        _V2_INFER_BODY,
        {"200": _answer("The model's outputs.", "V2InferenceResponse")},
        errors=(400, 401, 403, 404, 413, 424, 429, 503, 504),
    ),
    "invoke_async": Operation(
        "Invoke asynchronously (SageMaker InvokeEndpointAsync)",
        "asynchronous",
        "Journaled before the 202; the answer is written to the output location.",
        _ROWS_BODY,
        {"202": _answer("Accepted.", "AsyncAccepted")},
        [
            {**_TARGET, "required": True},
            {
                "name": "X-Amzn-SageMaker-InputLocation",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
            },
        ],
        errors=(400, 403, 404, 429, 503),
    ),
    "async_status": Operation(
        "State of an asynchronous request",
        "asynchronous",
        answers={"200": _answer("Its state and where its answer is.", "AsyncState")},
        errors=(404,),
    ),
    "ping": Operation(
        "Health (DJL Serving, SageMaker)",
        "health",
        answers={"200": _answer("Healthy.", "Status", {"status": "Healthy"})},
        errors=(503,),
    ),
    "list_models": Operation(
        "List the models",
        "management",
        "Sorted by name, paged.",
        answers={"200": _answer("A page of models.", "ModelList")},
        parameters=_PAGE,
        errors=(400, 401),
    ),
    "register_model": Operation(
        "Register and load a model",
        "management",
        "From a folder or archive under the allowed roots.",
        answers={"200": _answer("Registered.", "Status"), "202": _answer("Loading.", "Status")},
        parameters=[
            {"name": "url", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "model_name", "in": "query", "required": False, "schema": {"type": "string"}},
            *_MANAGEMENT_QUERY,
        ],
        errors=(400, 401, 404, 409, 507),
    ),
    "describe_model": Operation(
        "Describe a model",
        "management",
        answers={"200": _answer("DJL's description, with the server's own fields.", "Description")},
        errors=(401, 403, 404),
    ),
    "rescale_model": Operation(
        "Change a model's workers and batching, or pin it",
        "management",
        answers={"200": _answer("Changed.", "Status")},
        parameters=[
            *_MANAGEMENT_QUERY,
            {"name": "pinned", "in": "query", "required": False, "schema": {"type": "boolean"}},
            {
                "name": "synchronous",
                "in": "query",
                "required": False,
                "schema": {"type": "boolean"},
            },
        ],
        errors=(400, 401, 404, 507),
    ),
    "unload_model": Operation(
        "Unload a model",
        "management",
        answers={"200": _answer("Unloaded.", "Status")},
        errors=(401, 404),
    ),
    "set_default_version": Operation(
        "Make a version the default",
        "management",
        answers={"200": _answer("Switched.", "Status")},
        errors=(400, 401, 404, 507),
    ),
    "set_canary_version": Operation(
        "Send a share of the requests to a version",
        "management",
        answers={"200": _answer("Set.", "Status")},
        parameters=[
            {"name": "percent", "in": "query", "required": True, "schema": {"type": "number"}}
        ],
        errors=(400, 401, 404, 507),
    ),
    "set_shadow_version": Operation(
        "Run a share of the requests on a version too, answering from the default",
        "management",
        answers={"200": _answer("Set.", "Status")},
        parameters=[
            {"name": "percent", "in": "query", "required": True, "schema": {"type": "number"}}
        ],
        errors=(400, 401, 404, 507),
    ),
    "metrics": Operation(
        "Prometheus metrics",
        "health",
        answers={
            "200": {
                "description": "The text exposition format.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
        errors=(401,),
    ),
    "server_metadata": Operation(
        "Server metadata (Open Inference Protocol)",
        "health",
        answers={"200": _answer("Name, version, extensions.", "Health")},
        errors=(),
    ),
    "live": Operation(
        "Liveness (Open Inference Protocol)",
        "health",
        answers={"200": _answer("Live.", "Health", {"live": True})},
        errors=(),
    ),
    "ready": Operation(
        "Readiness (Open Inference Protocol)",
        "health",
        answers={"200": _answer("Ready.", "Health", {"ready": True})},
        errors=(503,),
    ),
    "model_ready": Operation(
        "Whether a model is ready (Open Inference Protocol)",
        "health",
        answers={"200": _answer("Ready.", "Health")},
        errors=(400, 403, 404),
    ),
    "model_metadata": Operation(
        "A model's inputs and outputs (Open Inference Protocol)",
        "inference",
        "Loads the model if it is not loaded.",
        answers={"200": _answer("Its metadata.", "V2ModelMetadata")},
        errors=(400, 403, 404, 503),
    ),
    "repository_index": Operation(
        "The model repository's index",
        "management",
        answers={
            "200": {
                "description": "Every model with its state.",
                "content": {_JSON: {"schema": {"type": "array", "items": {"type": "object"}}}},
            }
        },
        errors=(400, 401),
    ),
    "repository_load": Operation(
        "Load a model", "management", answers={"200": _answer("Loaded.")}, errors=(400, 401, 404)
    ),
    "repository_unload": Operation(
        "Unload a model",
        "management",
        answers={"200": _answer("Unloaded.")},
        errors=(400, 401, 404),
    ),
    "openapi": Operation(
        "This document",
        "pages",
        answers={"200": {"description": "OpenAPI 3.1.", "content": {_JSON: {"schema": {}}}}},
        errors=(),
    ),
    "docs": Operation(
        "Browsable API documentation",
        "pages",
        answers={"200": {"description": "A page.", "content": {"text/html": {"schema": {}}}}},
        errors=(),
    ),
    "docs_asset": Operation(
        "A file of the documentation page",
        "pages",
        answers={"200": {"description": "The file."}},
        parameters=[],
        errors=(404,),
    ),
    "model_docs": Operation(
        "A model's documentation page, where it can be called",
        "pages",
        answers={"200": {"description": "A page.", "content": {"text/html": {"schema": {}}}}},
        errors=(403, 404),
    ),
    "model_openapi": Operation(
        "A model's OpenAPI document: its input, versions and an example",
        "pages",
        answers={"200": {"description": "OpenAPI 3.1.", "content": {_JSON: {"schema": {}}}}},
        errors=(403, 404, 503),
    ),
    "status": Operation(
        "The server's status page",
        "pages",
        answers={"200": {"description": "A page.", "content": {"text/html": {"schema": {}}}}},
        errors=(401,),
    ),
    "status_data": Operation(
        "What the status page shows",
        "pages",
        answers={"200": _answer("Models, backends and the budget.", "Health")},
        parameters=[
            {"name": "filter", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "page", "in": "query", "required": False, "schema": {"type": "integer"}},
        ],
        errors=(400, 401),
    ),
}

_ERROR_TEXT = {
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


def operation_key(route: Route) -> str:
    """The key of ``route``'s description in :data:`OPERATIONS`."""
    return f"{INFER}:{route.protocol.name}" if route.operation == INFER else route.operation


def _check_table() -> None:
    missing = sorted({operation_key(r) for r in ROUTES} - set(OPERATIONS))
    if missing:
        raise AssertionError(f"routes without a description in OPERATIONS: {missing}")


_check_table()


def _errors(codes: tuple[int, ...], protocol: Protocol) -> dict[str, dict[str, Any]]:
    schema = "V2Error" if protocol is V2 else "Error"
    answers = {str(code): _answer(_ERROR_TEXT[code], schema) for code in codes}
    answers["500"] = _answer("An error of the server (logged with the request id).", schema)
    return answers


def _operation(route: Route) -> dict[str, Any]:
    described = OPERATIONS[operation_key(route)]
    path_names = re.findall(r"\{(\w+)\}", plain_path(route.path))
    parameters = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "description": _PATH_PARAMETERS.get(name, ""),
            "schema": {"type": "string"},
        }
        for name in path_names
    ]
    parameters.extend(copy.deepcopy(described.parameters))
    operation: dict[str, Any] = {
        "operationId": _operation_id(route),
        "summary": described.summary,
        "tags": [described.tag],
        "responses": {
            **copy.deepcopy(described.answers),
            **_errors(described.errors, route.protocol),
        },
    }
    if described.description:
        operation["description"] = described.description
    if parameters:
        operation["parameters"] = parameters
    if described.body is not None:
        operation["requestBody"] = copy.deepcopy(described.body)
    return operation


def _operation_id(route: Route) -> str:
    words = re.sub(r"[{}.]", "", plain_path(route.path)).strip("/").replace("-", "_").split("/")
    return "_".join([route.method.lower(), *[w for w in words if w]]) or route.method.lower()


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route (made once; callers copy what they change)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(plain_path(route.path), {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mmserver",
            "version": __version__,
            "description": "One port, many models: DJL Serving's and SageMaker's inference and "
            "management APIs, the Open Inference Protocol, asynchronous inference, health and "
            "metrics. With tenants, inference needs a tenant's bearer token (or AWS Signature "
            "Version 4 on the SageMaker paths); management calls need the management token off "
            "loopback.",
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
        "tags": [
            {"name": "inference"},
            {"name": "asynchronous"},
            {"name": "management"},
            {"name": "health"},
            {"name": "pages"},
        ],
        "paths": paths,
    }


# ------------------------------------------------------------------------------------------------
# One model
# ------------------------------------------------------------------------------------------------

_KIND_SCHEMAS = {
    "number": {"type": ["number", "null"]},
    "boolean": {"type": ["boolean", "null"]},
    "string": {"type": ["string", "null"]},
    "category": {"type": ["string", "number", "null"]},
}


def _column_schema(column: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = dict(_KIND_SCHEMAS.get(column.get("kind", "number"), {}))
    if not column.get("missing", True):
        schema["type"] = [t for t in schema.get("type", []) if t != "null"]
    categories = column.get("categories")
    if categories is not None:
        schema["examples"] = list(categories)[:20]
    schema["description"] = f"{column.get('kind', 'number')}; " + (
        "missing values taken" if column.get("missing", True) else "a value is required"
    )
    return schema


def _example_value(column: dict[str, Any]) -> Any:
    categories = column.get("categories")
    if categories:
        return categories[0]
    return {"number": 0.0, "boolean": False}.get(column.get("kind", "number"), "")


def example_rows(view: dict[str, Any]) -> list[Any]:
    """One example row of the model: its MLflow ``input_example``'s first record when it has
    one, otherwise the row its load probes predict (zeros; the first category of a category)."""
    columns = view.get("inputs")
    example = view.get("input_example")
    if isinstance(example, dict) and columns:
        split = example.get("columns"), example.get("data")
        if isinstance(split[0], list) and isinstance(split[1], list) and split[1]:
            return [dict(zip(split[0], split[1][0], strict=False))]
    if isinstance(example, list) and example:
        return [example[0]]
    if columns:
        return [{c["name"]: _example_value(c) for c in columns}]
    width = view.get("n_features") or 1
    return [[0.0] * int(width)]


def _v2_example(metadata: dict[str, Any], row: Any) -> dict[str, Any]:
    inputs = metadata.get("inputs") or []
    if isinstance(row, dict) and inputs:
        return {
            "inputs": [
                {
                    "name": i["name"],
                    "shape": [1],
                    "datatype": i["datatype"],
                    "data": [row.get(i["name"])],
                }
                for i in inputs
            ]
        }
    values = row if isinstance(row, list) else [row]
    return {
        "inputs": [
            {"name": "input-0", "shape": [1, len(values)], "datatype": "FP64", "data": values}
        ]
    }


def model_document(name: str, metadata: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document of model ``name``'s inference calls: ``metadata`` is its V2
    metadata, ``view`` what its load told of it (``inputs``: its columns; ``input_example``;
    ``n_features``)."""
    rows = example_rows(view)
    columns = view.get("inputs") or []
    if columns:
        record = {
            "type": "object",
            "properties": {c["name"]: _column_schema(c) for c in columns},
            "required": [c["name"] for c in columns if not c.get("missing", True)],
        }
        rows_schema: dict[str, Any] = {"type": "array", "items": record, "example": rows}
    else:
        width = view.get("n_features")
        row_schema: dict[str, Any] = {"type": "array", "items": {"type": ["number", "null"]}}
        if width:
            row_schema["minItems"] = row_schema["maxItems"] = width
        rows_schema = {"type": "array", "items": row_schema, "example": rows}
    versions = metadata.get("versions") or []
    body = {"required": True, "content": {_JSON: {"schema": rows_schema, "example": rows}}}
    v2_body = {
        "required": True,
        "content": _json("V2InferenceRequest", _v2_example(metadata, rows[0])),
    }
    predictions = _answer("The model's answers, one per row.", "Predictions")
    doc = document()
    paths: dict[str, Any] = {
        f"/predictions/{name}": {
            "post": {
                "operationId": "predict",
                "summary": f"Predict with {name} (DJL Serving)",
                "tags": [name],
                "requestBody": body,
                "responses": {"200": predictions, **_errors((400, 404, 424, 503), DJL)},
            }
        },
        f"/models/{name}/invoke": {
            "post": {
                "operationId": "invoke",
                "summary": f"Invoke {name} (SageMaker)",
                "tags": [name],
                "requestBody": copy.deepcopy(body),
                "responses": {"200": predictions, **_errors((400, 404, 424, 503), SAGEMAKER)},
            }
        },
        f"/v2/models/{name}/infer": {
            "post": {
                "operationId": "infer",
                "summary": f"Infer with {name} (Open Inference Protocol)",
                "tags": [name],
                "requestBody": v2_body,
                "responses": {
                    "200": _answer("Its outputs.", "V2InferenceResponse"),
                    **_errors((400, 404, 424, 503), V2),
                },
            }
        },
    }
    description = (
        f"Platform {metadata.get('platform') or 'unknown'}; versions: "
        f"{', '.join(versions) or '1'}. "
        + (
            "Input columns: " + ", ".join(f"{c['name']} ({c['kind']})" for c in columns) + "."
            if columns
            else f"Input: rows of {view.get('n_features') or 'any number of'} numbers."
        )
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"mmserver: model {name}",
            "version": __version__,
            "description": description,
        },
        "components": {
            "schemas": doc["components"]["schemas"],
            "securitySchemes": doc["components"]["securitySchemes"],
        },
        "security": doc["security"],
        "paths": paths,
    }
