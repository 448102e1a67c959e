"""The Open Inference Protocol's server metadata, model metadata and model repository
operations, transport-neutral: the REST handlers (:mod:`mmserver.api.v2`) and the gRPC service
(:mod:`mmserver.api.grpc.service`) both call them, and this module imports nothing of aiohttp."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mmserver import __version__
from mmserver.codecs.v2 import VERSION, datatype_of
from mmserver.errors import InvalidInput, ModelNotFound, ShuttingDown
from mmserver.lifecycle.record import ModelStatus
from mmserver.store.names import normalize_name, split_version
from mmserver.store.properties import boolean

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager
    from mmserver.tenancy.gate import TenantGate
    from mmserver.tenancy.tenants import Tenant


SERVER_NAME = "mmserver"


EXTENSIONS = ("binary_tensor_data", "model_repository")


#: The name the metadata gives the model's input (any name is accepted).
INPUT_NAME = "input-0"


# The repository index's states (Triton's names) for a model's status.
_STATES = {
    ModelStatus.READY: "READY",
    ModelStatus.LOADING: "LOADING",
    ModelStatus.UNLOADING: "UNLOADING",
    ModelStatus.FAILED: "UNAVAILABLE",
    ModelStatus.UNLOADED: "UNAVAILABLE",
}


#: The server's metadata.
SERVER_METADATA: dict[str, Any] = {
    "name": SERVER_NAME,
    "version": __version__,
    "extensions": list(EXTENSIONS),
}


async def not_ready_reason(wlm: WorkLoadManager, name: str) -> str | None:
    """Why model ``name`` is not ready (``None``: it is): it loads on its first request or on a
    repository load. Raises :class:`ModelNotFound` for a model the server does not know, and
    :class:`ShuttingDown` once shutdown has begun."""
    if not wlm.accepting:
        raise ShuttingDown("the server is shutting down; its models take no new requests")
    name = await wlm.versions.resolve(name)
    status = wlm.status(name)
    if status is ModelStatus.READY:
        return None
    await wlm.catalog.describe(name)  # ModelNotFound (404) for a model the server does not know
    reason = wlm.failure(name) if status is ModelStatus.FAILED else None
    return (
        f"model {name} is not ready: it is {status.value.lower()}"
        + (f" ({reason})" if reason else "")
        + f"; it loads on its first inference request or on POST /v2/repository/models/{name}/load"
    )


async def metadata_of(wlm: WorkLoadManager, name: str) -> dict[str, Any]:
    """Model ``name``'s V2 metadata (:func:`describe`), loading it first if needed."""
    key = await wlm.ready(name)
    return await metadata_of_loaded(wlm, key, wlm.signature(key))


async def metadata_of_loaded(
    wlm: WorkLoadManager, key: str, signature: dict[str, Any] | None
) -> dict[str, Any]:
    """The V2 metadata of the loaded model (or version) ``key`` whose load told ``signature``."""
    metadata = describe(key, signature)
    base, version = split_version(key)
    if version is not None:
        rollout = await wlm.versions.rollout_of(base)
        metadata["name"] = base
        metadata["versions"] = [str(v) for v in (rollout.versions if rollout else (version,))]
    return metadata


#: A column's kind (:mod:`mmserver.codecs.schema`) to the datatype of its V2 input.
_COLUMN_DATATYPES = {"number": "FP64", "string": "BYTES", "boolean": "BOOL", "category": "BYTES"}


def describe(name: str, signature: dict[str, Any] | None) -> dict[str, Any]:
    """V2 model metadata from a model's :func:`~mmserver.execution.predictor.signature` (``None``:
    not
    known yet, the model has not been loaded into a backend; no inputs nor outputs then)."""
    metadata: dict[str, Any] = {"name": name, "versions": [VERSION], "platform": ""}
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    if signature is not None:
        metadata["platform"] = signature["platform"]
        columns = signature.get("inputs")
        tensors = signature.get("tensors")
        if tensors:  # the inputs of the model's own graph (an ONNX model)
            inputs.extend(
                {
                    "name": t["name"],
                    "datatype": datatype_of(np.dtype(t["dtype"])),
                    "shape": t["shape"],
                }
                for t in tensors
            )
        elif columns:  # a model fitted on a DataFrame: one input per column (MLServer's pandas)
            inputs.extend(
                {"name": c["name"], "datatype": _COLUMN_DATATYPES[c["kind"]], "shape": [-1]}
                for c in columns
            )
        else:
            width = signature["n_features"] or -1
            inputs.append({"name": INPUT_NAME, "datatype": "FP64", "shape": [-1, width]})
        for output in signature["outputs"]:
            if output["dtype"] is not None:  # a custom handler's output: not known before
                outputs.append(
                    {
                        "name": output["name"],
                        "datatype": datatype_of(np.dtype(output["dtype"])),
                        "shape": output["shape"],
                    }
                )
    metadata["inputs"] = inputs
    metadata["outputs"] = outputs
    return metadata


async def index_of(
    wlm: WorkLoadManager,
    only_ready: bool,
    gate: TenantGate | None = None,
    caller: Tenant | None = None,
) -> list[dict[str, str]]:
    """The repository index: every model of the store and every registered one, with its
    version, state (Triton's names) and the reason for it (a model with versions the server
    has read: a row per version); the loaded ones only when ``only_ready``; on a server with
    tenants, those ``caller`` may see."""
    index = []
    for model in await wlm.list_models():
        if gate is not None and caller is not None and not gate.may_see(caller, model.name):
            continue
        rollout = wlm.versions.rollouts.get(model.name)
        rows = (
            [(model.name, VERSION, model.status)]
            if rollout is None
            else [(rollout.key(v), str(v), wlm.status(rollout.key(v))) for v in rollout.versions]
        )
        for key, version, status in rows:
            if only_ready and status is not ModelStatus.READY:
                continue
            reason = ""
            if status is ModelStatus.FAILED:
                reason = wlm.failure(key) or "the last load failed"
            elif status is ModelStatus.UNLOADED:
                reason = "not loaded"
            elif key == model.name:
                reason = model.skew  # loaded across a version gap: said, as Triton's reasons
            index.append(
                {"name": model.name, "version": version, "state": _STATES[status], "reason": reason}
            )
    return index


async def load(wlm: WorkLoadManager, name: str, parameters: Mapping[str, Any]) -> None:
    """Load model ``name`` now, with the repository call's ``parameters`` (checked: a model's
    configuration and files cannot come with the call). The caller has authorized the call."""
    name = normalize_name(name)
    for key in parameters:
        if key == "config" or key.startswith("file:"):
            raise InvalidInput(
                f"load parameter {key!r} is not supported: a model's configuration is its "
                "serving.properties, and its files come from the model store"
            )
    await wlm.load(name)


async def unload(wlm: WorkLoadManager, name: str, parameters: Mapping[str, Any]) -> None:
    """Unload model ``name``, with the repository call's ``parameters`` (checked); a model of
    the store that is not loaded is left as it is. The caller has authorized the call."""
    name = normalize_name(name)
    bool_param(parameters, "unload_dependents", default=False)  # checked; no model has any
    try:
        await wlm.unload(name)
    except ModelNotFound:
        await wlm.catalog.describe(name)  # ModelNotFound again for a model the server does not know


def bool_param(params: Mapping[str, Any], name: str, *, default: bool) -> bool:
    if name not in params:
        return default
    value = params[name]
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        spelled = boolean(value)
        if spelled is not None:
            return spelled
    raise InvalidInput(f"parameter {name} must be true or false, got {shown_value(value)}")


def shown_value(value: Any, limit: int = 40) -> str:
    """``value`` as an error message shows it: its ``repr``, cut past ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
