"""An ONNX graph run by onnxruntime, as the default handler runs an estimator
(:class:`OnnxModel`, the ``onnx`` family of :mod:`mmserver.execution.families`).

Runs inside the backend processes. The graph's inputs say what the model takes:

- one tensor input of numbers (``float_input [N, 4]``, what skl2onnx makes from an array): rows
  of numbers, as every model fitted on an array, converted to the input's type (float32,
  usually);
- one input per column (``age [N, 1]``, ``city [N, 1]``: what skl2onnx makes from a DataFrame
  pipeline), or one input that is not numbers: named columns, as a model fitted on a DataFrame,
  each column's kind from its input's type (strings, booleans, numbers).

``predict`` answers the graph's first output, as ``InferenceSession.run`` gives it;
``predict_proba`` a converted classifier's probabilities (skl2onnx's ``output_probability``),
one row per input row and one column per class, also when the graph zips them into one
``{class: probability}`` map per row (a map's keys are its classes, sorted as scikit-learn's
``classes_``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserver.codecs.schema import BOOLEAN, STRING
from mmserver.errors import ModelLoadError

#: ONNX's tensor element types to NumPy's.
_TYPES: dict[str, np.dtype[Any]] = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in (
        ("float", "float32"),
        ("double", "float64"),
        ("float16", "float16"),
        ("int8", "int8"),
        ("int16", "int16"),
        ("int32", "int32"),
        ("int64", "int64"),
        ("uint8", "uint8"),
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("bool", "bool"),
        ("string", "object"),
    )
}
#: The names converters give a classifier's probabilities output (skl2onnx, onnxmltools).
_PROBABILITIES = ("output_probability", "probabilities", "probability")


@dataclass(frozen=True)
class Tensor:
    """One of the graph's inputs: its name, its NumPy type and its shape (-1: any size)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    def describe(self) -> dict[str, Any]:
        """Its name, dtype string and shape, the batch's dimension -1 (the V2 metadata)."""
        shape = [-1, *self.shape[1:]] if self.shape else [-1]
        return {"name": self.name, "dtype": self.dtype.str, "shape": shape}


class OnnxModel:
    """An ONNX graph in an onnxruntime session (one thread: a backend process is one core's
    worth of work); ``predict`` answers its first output. A batch is a float64 matrix (one
    tensor input) or a DataFrame of the graph's columns (one input per column). Made by
    :func:`onnx_model`."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.inputs = [_tensor(i.name, i.type, i.shape) for i in session.get_inputs()]
        outputs = [(o.name, o.type) for o in session.get_outputs()]
        if not self.inputs or not outputs:
            raise ModelLoadError("the ONNX graph has no input or no output")
        self.outputs = outputs
        #: The column names of a graph with one input per column (``None``: one tensor).
        self.columns: list[str] | None = None
        first = self.inputs[0]
        if len(self.inputs) == 1 and first.dtype.kind in "iuf" and len(first.shape) <= 2:
            # [N, k]: k columns; [N]: one; a shape the graph does not say: any width.
            width = {2: first.shape[-1], 1: 1}.get(len(first.shape), -1)
            self.n_features_in_: int | None = width if width > 0 else None
        else:
            for tensor in self.inputs:
                if len(tensor.shape) not in (1, 2) or tensor.shape[1:] not in ((), (1,)):
                    raise ModelLoadError(
                        f"the ONNX graph's input {tensor.name!r} has shape "
                        f"{_shown(tensor.shape)}; graphs that take rows are served: one input "
                        "of numbers [N, k], or one input per column, each [N] or [N, 1]"
                    )
            self.columns = [t.name for t in self.inputs]
            self.n_features_in_ = len(self.inputs)
        #: What a load's error says of the graph (its outputs, when option.method names a
        #: method the graph cannot answer).
        self.summary = "an ONNX graph with outputs " + ", ".join(
            f"{name}: {kind}" for name, kind in outputs
        )

    def predict(self, batch: Any) -> Any:
        """The graph's first output on ``batch`` (an array, or a list for a sequence)."""
        return self.session.run([self.outputs[0][0]], self._feeds(batch))[0]

    def tensors(self) -> list[dict[str, Any]]:
        """The graph's inputs as the V2 metadata describes them."""
        return [t.describe() for t in self.inputs]

    def kinds(self) -> Iterator[tuple[int, str]]:
        """``(column index, kind)`` of the columns that are not numbers."""
        if self.columns is None:
            return
        for index, tensor in enumerate(self.inputs):
            if tensor.dtype.kind == "O":
                yield index, STRING
            elif tensor.dtype.kind == "b":
                yield index, BOOLEAN

    def _feeds(self, batch: Any) -> dict[str, np.ndarray]:
        if self.columns is None:
            (tensor,) = self.inputs
            values = np.asarray(batch)
            if len(tensor.shape) == 1:
                values = values.reshape(-1)
            return {tensor.name: _typed(values, tensor)}
        feeds = {}
        for j, tensor in enumerate(self.inputs):
            if isinstance(batch, np.ndarray):
                values = batch[:, j]
            else:
                values = batch[tensor.name].to_numpy()
            if len(tensor.shape) == 2:
                values = values.reshape(-1, 1)
            feeds[tensor.name] = _typed(values, tensor)
        return feeds


class OnnxClassifier(OnnxModel):
    """A graph with a classifier's probabilities output: also ``predict_proba``. A row with a
    missing value (NaN) whose probabilities are not numbers has no label either (``predict``
    raises): a converted linear model answers a label for it that means nothing, where the
    scikit-learn model refuses it; a tree ensemble's answer is kept."""

    def __init__(self, session: Any, probabilities: str) -> None:
        super().__init__(session)
        self.probabilities = probabilities

    def predict(self, batch: Any) -> Any:
        feeds = self._feeds(batch)
        if not any(v.dtype.kind == "f" and np.isnan(v).any() for v in feeds.values()):
            return self.session.run([self.outputs[0][0]], feeds)[0]
        label, probabilities = self.session.run([self.outputs[0][0], self.probabilities], feeds)
        if np.isnan(_matrix(probabilities)).any():
            raise ValueError("the graph's probabilities for a row with a missing value are NaN")
        return label

    def predict_proba(self, batch: Any) -> np.ndarray:
        """The probabilities on ``batch``: one row per input row, one column per class."""
        return _matrix(self.session.run([self.probabilities], self._feeds(batch))[0])


def open_graph(path: Path) -> OnnxModel:
    """The graph in ``path`` in an onnxruntime session on one thread (one backend process is
    one core's work; the processes are the parallelism)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx_model(session)


def onnx_model(session: Any) -> OnnxModel:
    """The model of an onnxruntime session: an :class:`OnnxClassifier` when its graph has a
    classifier's probabilities output. Raises :class:`ModelLoadError` for a graph that does
    not take rows."""
    outputs = [(o.name, o.type) for o in session.get_outputs()]
    probabilities = _probabilities(outputs)
    if probabilities is None:
        return OnnxModel(session)
    return OnnxClassifier(session, probabilities)


def _tensor(name: str, kind: str, shape: Any) -> Tensor:
    dtype = _TYPES.get(kind)
    if dtype is None:
        raise ModelLoadError(
            f"the ONNX graph's input {name!r} is a {kind}; inputs that are tensors of numbers, "
            "strings or booleans are served"
        )
    dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in (shape or ()))
    return Tensor(name, dtype, dims)


def _probabilities(outputs: list[tuple[str, str]]) -> str | None:
    """The name of a classifier's probabilities output: a sequence of maps (skl2onnx's
    ZipMap), or an output named as converters name it. ``None``: the graph has none."""
    for name, kind in outputs[1:]:
        if kind.startswith("seq(map("):
            return name
    for name, _ in outputs[1:]:
        if name.lower() in _PROBABILITIES:
            return name
    return None


def _typed(values: np.ndarray, tensor: Tensor) -> np.ndarray:
    """``values`` as the input's type. A missing value (NaN, ``None``) goes only to a float
    input; a number that is not whole, never to an integer one."""
    dtype = tensor.dtype
    if values.dtype.kind == "O" and any(v is None for v in values.ravel().tolist()):
        raise ValueError(f"input {tensor.name!r} takes no missing value")
    if dtype.kind == "O":
        return values.astype(object, copy=False)
    if values.dtype.kind == "O":
        values = values.astype(np.float64 if dtype.kind == "f" else dtype)
    if dtype.kind in "iub" and values.dtype.kind == "f":
        if not np.isfinite(values).all() or not np.array_equal(values, np.trunc(values)):
            raise ValueError(
                f"input {tensor.name!r} takes {'booleans' if dtype.kind == 'b' else 'integers'}; "
                "a value is missing or not whole"
            )
    return values.astype(dtype, copy=False)


def _matrix(answer: Any) -> np.ndarray:
    """Probabilities as one row per input row: a tensor as it is, a list of ``{class:
    probability}`` maps as their values in the order of their sorted classes."""
    if isinstance(answer, np.ndarray):
        return answer
    rows = list(answer)
    if not rows:
        return np.empty((0, 0), dtype=np.float32)
    classes = sorted(rows[0])
    return np.array([[row[c] for c in classes] for row in rows], dtype=np.float32)


def _shown(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("N" if d < 0 else str(d) for d in shape) + "]"
