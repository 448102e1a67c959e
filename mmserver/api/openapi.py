"""The API described in OpenAPI 3.1: :func:`document` makes it from the one route table
(:data:`~mmserver.api.protocols.ROUTES`) and one description per operation
(:data:`~mmserver.api.described.OPERATIONS`), so a route cannot be served without being
described (the table is checked whole at import);
:func:`model_document` describes one model's inference calls with what its load told of its input
(columns, kinds, categories, whether missing values are taken), its versions and an example body
made from its MLflow ``input_example`` or the row its load probes predict (zeros), so that a
browser's "Try it out" works on the first click.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from mmserver import __version__
from mmserver.api.described import (
    ERROR_TEXT,
    JSON,
    OPERATIONS,
    PATH_PARAMETERS,
    SCHEMAS,
    answer,
    json_content,
)
from mmserver.api.protocols import DJL, INFER, ROUTES, SAGEMAKER, V2, Protocol, Route, plain_path


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
    answers = {str(code): answer(ERROR_TEXT[code], schema) for code in codes}
    answers["500"] = answer("An error of the server (logged with the request id).", schema)
    return answers


def _operation(route: Route) -> dict[str, Any]:
    described = OPERATIONS[operation_key(route)]
    path_names = re.findall(r"\{(\w+)\}", plain_path(route.path))
    parameters = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "description": PATH_PARAMETERS.get(name, ""),
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
    body = {"required": True, "content": {JSON: {"schema": rows_schema, "example": rows}}}
    v2_body = {
        "required": True,
        "content": json_content("V2InferenceRequest", _v2_example(metadata, rows[0])),
    }
    predictions = answer("The model's answers, one per row.", "Predictions")
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
                    "200": answer("Its outputs.", "V2InferenceResponse"),
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
