"""A model's own handler: its folder's ``model.py`` (or ``option.entryPoint``), imported in the
backend process, which gets the model from its ``load(model_dir, properties)`` and predicts with
its ``predict(model, batch)`` (or the function ``option.handler`` names)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from mmserver.codecs.answers import encode_json, response_type, typed_answer
from mmserver.codecs.explanations import ATTRIBUTIONS, is_explained
from mmserver.codecs.schema import Inputs, declared, matrix_inputs
from mmserver.codecs.tabular import to_frame
from mmserver.config.model import ModelConfig
from mmserver.errors import InvalidInput, ModelError, ModelLoadError
from mmserver.execution.families import find_model_file, inside, load_model, reason
from mmserver.execution.formats import Listing
from mmserver.execution.handlers import Batch, Predictor, check_rows, n_features

# sys.path and sys.modules belong to the whole process: imports of two models' handlers in two
# threads must not interleave their sys.path edits.
_IMPORT_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class RawRequest:
    """A request as it came, for a custom handler with ``option.raw_input=true``: the body,
    its ``Content-Type`` (``""`` when none was sent) and whether the client asked for CSV."""

    body: bytes
    content_type: str
    wants_csv: bool | None


class CustomPredictor:
    """A handler from the model's own ``model.py``: ``predict(model, batch) -> rows``; with
    ``option.raw_input=true``, ``predict(model, requests) -> answers`` on
    :class:`RawRequest` items, one answer per request: ``bytes`` (sent as they are, typed as
    the request's ``Accept`` asked, JSON or CSV), a ``(bytes, content type)`` pair, or any object
    JSON can hold (sent as JSON)."""

    outputs: tuple[str, ...] = ("predict",)

    def __init__(
        self,
        model: Any,
        fn: Callable[[Any, Any], Any],
        config: ModelConfig | None = None,
        model_dir: Path | None = None,
    ) -> None:
        self.model = model
        self.n_features: int | None = n_features(model) if model is not None else None
        self._fn = fn
        if config is not None and config.raw_input:
            self.inputs = Inputs(raw=True)
            return
        columns = declared(model_dir, config.properties) if model_dir and config else None
        # Not probed: the handler gets missing values only when its configuration says so.
        refuse = config is None or config.missing_values != "accept"
        if columns:
            self.inputs = Inputs(
                tuple(replace(c, missing=not refuse) for c in columns),
                frame=True,
                csv_header=bool(config and config.csv_header),
            )
            self.n_features = len(columns)
        else:
            self.inputs = replace(
                matrix_inputs(self.n_features, missing=not refuse),
                csv_header=bool(config and config.csv_header),
            )
            if not self.n_features:
                self.inputs = replace(self.inputs, missing=not refuse)

    def predict(self, batch: Batch) -> np.ndarray | list[Any]:
        if self.inputs.frame:
            return check_rows(self._fn(self.model, to_frame(batch, self.inputs)), batch)
        return check_rows(self._fn(self.model, batch), batch)

    def output(self, name: str, batch: Batch) -> np.ndarray | list[Any]:
        if name == ATTRIBUTIONS:
            raise InvalidInput("a model served by a custom handler has no explanation")
        return self.predict(batch)

    def answer_raw(
        self, requests: Sequence[tuple[bytes, str, bool | None]]
    ) -> list[bytes | tuple[str, str]]:
        """Each request's answer from the handler, encoded (``option.raw_input``); an Open
        Inference Protocol request is refused: its answer is a tensor, not the handler's."""
        out: list[bytes | tuple[str, str]] = [
            (
                "InvalidInput",
                "this model's handler takes requests as they came (option.raw_input): call it "
                "on its DJL or SageMaker path, not the Open Inference Protocol",
            )
        ] * len(requests)
        for i, (_, kind, _) in enumerate(requests):
            if is_explained(kind):
                out[i] = ("InvalidInput", "a model served by a custom handler has no explanation")
        taken = [
            i
            for i, (_, kind, _) in enumerate(requests)
            if not kind.startswith("v2") and not is_explained(kind)
        ]
        if not taken:
            return out
        raw = [RawRequest(*requests[i]) for i in taken]
        answers = check_rows(self._fn(self.model, raw), raw)
        for i, answer in zip(taken, answers, strict=True):
            try:
                out[i] = _raw_answer(answer, requests[i][2])
            except ModelError as exc:  # this request's answer only
                out[i] = (type(exc).__name__, exc.message)
        return out


def _raw_answer(answer: Any, csv: bool | None) -> bytes:
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], str):
        body, content_type = answer
        if not isinstance(body, bytes | bytearray | str):
            raise ModelError("a handler's (body, content type) answer needs bytes or text")
        data = body.encode() if isinstance(body, str) else bytes(body)
        return typed_answer(data, content_type)
    if isinstance(answer, bytes | bytearray):
        return typed_answer(bytes(answer), response_type(csv))
    return encode_json(answer)


def entry_point(files: Listing, config: ModelConfig, name: str) -> Path | None:
    """The custom handler's file (``option.entryPoint``), if the model folder (listed in
    ``files``) has one."""
    path = inside(files.folder, config.entry_point, "option.entryPoint", name)
    if files.has(config.entry_point):
        return path
    if "option.entryPoint" in config.properties:
        raise ModelLoadError(
            f"model {name}: option.entryPoint={config.entry_point!r} does not exist",
            model=name,
        )
    return None


@contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a handler imports its sibling modules."""
    entry = str(folder)
    with _IMPORT_LOCK:
        sys.path.insert(0, entry)
        try:
            yield
        finally:
            try:
                sys.path.remove(entry)
            except ValueError:
                pass


def _import_handler(model_dir: Path, entry: Path) -> ModuleType:
    # One module name per model folder: two models' model.py never share a module, and loading
    # the same folder again replaces the old module instead of piling up new ones.
    digest = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:16]
    module_name = f"mmserver_handler_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, entry)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{entry} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look their module up by name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        if not isinstance(exc, Exception):
            raise
        raise ModelLoadError(f"{entry.name} failed to import: {reason(exc)}") from None
    return module


def load_custom(model_dir: Path, entry: Path, config: ModelConfig, name: str) -> Predictor:
    with _on_sys_path(model_dir):
        module = _import_handler(model_dir, entry)
        try:
            return _make_custom(model_dir, entry, config, module, name)
        except BaseException:
            sys.modules.pop(module.__name__, None)
            raise


def _make_custom(
    model_dir: Path, entry: Path, config: ModelConfig, module: ModuleType, name: str
) -> Predictor:
    fn = getattr(module, config.handler, None)
    if not callable(fn):
        raise ModelLoadError(
            f"model {name}: {entry.name} defines no function "
            f"{config.handler!r} (option.handler); it should define "
            f"{config.handler}(model, batch) -> rows",
            model=name,
        )
    loader = getattr(module, "load", None)
    if loader is not None and not callable(loader):
        raise ModelLoadError(f"model {name}: {entry.name}: 'load' is not a function", model=name)
    if loader is not None:
        try:
            model = loader(model_dir, dict(config.properties))
        except Exception as exc:
            raise ModelLoadError(
                f"model {name}: {entry.name} load() failed: {reason(exc)}",
                model=name,
            ) from None
    else:
        found = find_model_file(model_dir, config, name)
        model = (
            load_model(found, config.trust, config.on_version_skew)[0]
            if found is not None
            else None
        )
    return CustomPredictor(model, fn, config, model_dir)
