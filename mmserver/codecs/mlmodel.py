"""MLflow model folders: the ``MLmodel`` file that ``mlflow.sklearn``, ``mlflow.xgboost`` and
``mlflow.lightgbm`` write beside the model, which says where the model's file is (its
*flavour*), the columns it takes (its *signature*) and an example input.

Only the file is read here (YAML, safely: no tags that build objects); nothing of MLflow is
imported, nor needed. :mod:`mmserver.execution.families` loads the flavour's file as its own
family does (a pickle restricted as any other), :func:`mmserver.codecs.schema.declared` takes
the signature's columns, and the model's describe shows the example.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.errors import ModelLoadError

MLMODEL = "MLmodel"
#: The largest input example shown (bytes of its file).
MAX_EXAMPLE_BYTES = 64 << 10
#: The flavours served, by what their MLmodel section names: the key of the model's file, and
#: the loader module of a ``python_function`` flavour that stands for them.
_FLAVOURS = {
    "sklearn": ("pickled_model", "mlflow.sklearn"),
    "xgboost": ("data", "mlflow.xgboost"),
    "lightgbm": ("data", "mlflow.lightgbm"),
}


@dataclass(frozen=True)
class Flavour:
    """Where an MLflow folder's model is: its flavour (``sklearn``, ``xgboost``,
    ``lightgbm``), its file (relative to the folder) and, for ``sklearn``, how it was saved
    (``cloudpickle``, ``pickle`` or ``skops``)."""

    name: str
    file: str
    serialization: str | None = None


def read(path: Path) -> dict[str, Any]:
    """The MLmodel file at ``path`` (parsed once for each version of the file: a load reads it
    for its model's file, its columns and its example). Raises :class:`ModelLoadError` saying
    what is wrong. The mapping is shared: read it, do not change it."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"{MLMODEL} cannot be read: {type(exc).__name__}: {exc}") from None
    return _parsed(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ModelLoadError(f"{MLMODEL} cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{MLMODEL} must be a YAML mapping (MLflow's model format)")
    return data


def flavour(data: dict[str, Any]) -> Flavour:
    """The flavour of an MLmodel that mmserver serves: ``sklearn``, ``xgboost`` or ``lightgbm``,
    or a ``python_function`` flavour whose loader module is one of theirs."""
    flavours = data.get("flavors")
    if not isinstance(flavours, dict):
        raise ModelLoadError(f"{MLMODEL} has no flavors")
    for name, (key, _) in _FLAVOURS.items():
        section = flavours.get(name)
        if isinstance(section, dict) and isinstance(section.get(key), str):
            return Flavour(name, section[key], section.get("serialization_format"))
    pyfunc = flavours.get("python_function")
    if isinstance(pyfunc, dict):
        for name, (_, module) in _FLAVOURS.items():
            path = pyfunc.get("model_path") or pyfunc.get("data")
            if pyfunc.get("loader_module") == module and isinstance(path, str):
                return Flavour(name, path)
    raise ModelLoadError(
        f"{MLMODEL}'s flavours ({', '.join(map(str, flavours)) or 'none'}) are none mmserver "
        f"serves: {', '.join(_FLAVOURS)}, or python_function of one of them"
    )


def signature_columns(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The signature's input columns (``[{"name": ..., "type": ...}]``, the form of
    ``input_schema.json``), or ``None`` when it has none or describes tensors."""
    signature = data.get("signature")
    if not isinstance(signature, dict) or not isinstance(signature.get("inputs"), str):
        return None
    try:
        inputs = json.loads(signature["inputs"])
    except ValueError:
        raise ModelLoadError(f"{MLMODEL}: its signature's inputs are not JSON") from None
    if not isinstance(inputs, list) or not inputs:
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in inputs):
        return None  # a tensor signature, or unnamed columns: the model says its own
    if any(c.get("type") == "tensor" for c in inputs):
        return None
    return [{"name": c["name"], "type": str(c.get("type", "double"))} for c in inputs]


def input_example(folder: Path, data: dict[str, Any]) -> Any | None:
    """The input example saved beside the model (MLflow's ``input_example.json``), as JSON, or
    ``None`` without one (or one too large to show, or a link: it may point at another model's
    files)."""
    info = data.get("saved_input_example_info")
    name = info.get("artifact_path") if isinstance(info, dict) else None
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        return None
    path = folder / name
    try:
        if path.is_symlink() or path.stat().st_size > MAX_EXAMPLE_BYTES:
            return None
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
