"""Model handlers: turn a model folder into something that predicts a batch.

This runs inside the backend processes (or their threads): no asyncio, no HTTP. Two handlers:

- the default one loads ``model.joblib`` and calls the estimator method named by
  ``option.method`` (``predict`` unless told otherwise) on what the model takes
  (:mod:`mmserver.codecs.schema`): a float64 matrix, or one DataFrame per batch for a model fitted
  on one;
- a custom one imports the model's ``model.py`` (or ``option.entryPoint``), gets the model from its
  ``load(model_dir, properties)`` and predicts with its ``predict(model, batch)`` (or the function
  named by ``option.handler``, e.g. DJL's ``handle``): ``batch`` is a float64 matrix, a DataFrame
  when the model declares its columns, or, with ``option.raw_input=true``, a list of
  :class:`~mmserver.execution.custom.RawRequest` (each request as it came) to be answered one item
  per request (:mod:`mmserver.execution.custom`).

Failures while loading become :class:`~mmserver.errors.ModelLoadError` with a one-line reason;
exceptions from the model's own predict code propagate unchanged for the caller to wrap.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mmserver.codecs import mlmodel
from mmserver.codecs.explanations import ATTRIBUTIONS
from mmserver.codecs.schema import (
    Column,
    Inputs,
    declared,
    matrix_inputs,
    probe_missing,
)
from mmserver.codecs.tabular import row_table, to_frame
from mmserver.config.model import METHODS, ModelConfig
from mmserver.errors import ModelLoadError, UntrustedModel
from mmserver.execution.candidates import NATIVE, NUMPY, TREELITE
from mmserver.execution.custom import entry_point, load_custom
from mmserver.execution.explainers import plan_explanation
from mmserver.execution.families import (
    SKLEARN,
    XGBOOST,
    family_named,
    find_model_file,
    load_model,
    owner,
    wanted_files,
)
from mmserver.execution.fastpath import own_plan, plan_paths
from mmserver.execution.fitted import feature_names, fitted_columns
from mmserver.execution.formats import Listing
from mmserver.execution.handlers import Batch, Predictor, check_rows, n_features, step
from mmserver.execution.skew import served_versions
from mmserver.execution.tablepath import plan_table_paths

log = logging.getLogger(__name__)


class EstimatorPredictor:
    """The default handler: a model object (an estimator, a pipeline, a booster) and one of its
    methods, run by the fastest verified path for each batch size
    (:mod:`mmserver.execution.fastpath`).

    ``last_path`` names the path the last batch took (for the per-path batch counts). Once the
    paths are chosen, the model object itself is kept only if a chosen path calls it."""

    def __init__(
        self,
        model: Any,
        method: str,
        name: str,
        *,
        family: str = SKLEARN,
        fast_path: bool = True,
        batch_rows: int = 32,
        config: ModelConfig | None = None,
        files: Listing | None = None,
        reload: Callable[[], Any] | None = None,
    ) -> None:
        fn = getattr(model, method, None)
        if not callable(fn):
            available = [m for m in METHODS if callable(getattr(model, m, None))]
            what = getattr(model, "summary", None) or type(model).__name__
            choice = (
                f"option.method must be one of: {', '.join(available)}"
                if available
                else f"it has none of the methods option.method may name ({', '.join(METHODS)})"
            )
            raise ModelLoadError(f"model {name} ({what}) has no {method}; {choice}", model=name)
        self.model: Any = model
        self.method = method
        self.family = family
        #: The format of the file it was loaded from (``pickle``, or the family's own).
        self.file_format = "pickle"
        #: The library versions that made it, where they are not the server's
        #: (``on_version_skew=warn``).
        self.trained_with: dict[str, str] = {}
        #: The input example saved with the model (an MLflow folder's), as JSON.
        self.input_example: Any = None
        self.n_features: int | None = n_features(model)
        final = step(model, -1)
        own_format = family_named(family)
        booster = (
            own_format if own_format.owns is not None else owner(model if final is None else final)
        )
        sparse = booster is not None and booster.sparse_missing
        self.inputs = find_inputs(model, fn, self.n_features, config, files, sparse)
        self.n_features = self.inputs.width or self.n_features
        inputs = self.inputs
        if inputs.frame:
            own: Callable[[Any], Any] = lambda batch: fn(to_frame(batch, inputs))  # noqa: E731
        else:
            own = fn
        self._own = own
        others = [m for m in METHODS if m != method and callable(getattr(model, m, None))]
        self.outputs: tuple[str, ...] = (method, *others)
        self.output_facts = [
            _output_facts(model if final is None else final, m) for m in self.outputs
        ]
        if self.n_features and booster is not None:
            # A booster's fitted attributes do not say its answer's type and shape: one call
            # on a row of plain values does (cheap for a booster).
            self.output_facts = [
                _called_facts(self._method(m), m, self.sample()) or facts
                for m, facts in zip(self.outputs, self.output_facts, strict=True)
            ]
        #: How its predictions are explained (:mod:`mmserver.execution.explainers`); it keeps
        #: what its method needs of the model.
        self.name = name
        self.explanation = plan_explanation(
            model, inputs, config, files, _output(self), self.outputs, _again(self, reload)
        )
        #: The tensors the model takes, when its family says them (an ONNX graph's inputs).
        self.tensors = booster.tensors(model) if booster is not None and booster.tensors else None
        missing = any(c.missing for c in inputs.columns)
        if not fast_path:
            self.plan = own_plan(own, batch_rows, "option.fast_path=false")
        elif self.n_features is None:
            self.plan = own_plan(own, batch_rows, "the model does not say its number of features")
        elif not inputs.dense:
            self.plan = plan_table_paths(model, method, own, inputs, batch_rows) or own_plan(
                own,
                batch_rows,
                "the model takes a DataFrame with columns other than numbers, and its first "
                "steps are not all ones that compile (a ColumnTransformer of OneHotEncoder, "
                "SimpleImputer, StandardScaler, passthrough)",
            )
        else:
            self.plan = plan_paths(
                model,
                method,
                own,
                self.n_features,
                batch_rows,
                frame=(lambda x: to_frame(x, inputs)) if inputs.frame else None,
                missing=missing,
            )
        self._routes = self.plan.routes
        self._finite_only = self.plan.finite_only
        self.last_path = self._routes[0][1]
        if not self.plan.uses <= {TREELITE, NATIVE, NUMPY} or len(self.outputs) > 1:
            return
        if self._finite_only:
            return  # a batch with missing values on such a path goes to the model's own method
        # The chosen paths hold what they need (a converted model, a booster), and the model
        # answers no other output: the model object (the estimator's own copy of its trees)
        # can go, with its own method, which holds it, and the heap it leaves back to the
        # system, so that the load's measured memory is what the model keeps. (A classifier
        # keeps it for its other methods' outputs.) The load's end gives the heap it leaves
        # back (mmserver.backend.child.Models.load).
        if reload is None and self.explanation.build is not None:
            return  # its explanation needs the model, which could not be read again
        self.model = None
        self._own = _dropped

    def _method(self, name: str) -> Callable[[Any], Any]:
        """The model's method ``name`` on a batch as the model takes it."""
        fn = getattr(self.model, name)
        if not self.inputs.frame:
            return fn  # type: ignore[no-any-return]
        inputs = self.inputs
        return lambda batch: fn(to_frame(batch, inputs))

    def predict(self, batch: Batch) -> np.ndarray | list[Any]:
        rows, routes, i = len(batch), self._routes, 0
        while rows > routes[i][0]:  # the last route takes any number of rows
            i += 1
        _, self.last_path, fn = routes[i]
        if (
            self.last_path in self._finite_only
            and isinstance(batch, np.ndarray)
            and np.isnan(batch).any()
        ):
            # This path answers otherwise than the model on missing values (found at load).
            self.last_path, fn = "own", self._own
        return check_rows(fn(batch), batch)  # type: ignore[arg-type]  # (a table: own only)

    def describe(self) -> dict[str, Any]:
        """The family and the predict paths, for the load log and the describe call."""
        return {
            "family": self.family,
            "method": self.method,
            **self.plan.describe(),
            "summary": self.plan.summary(),
            "explanation": self.explanation.describe(),
        }

    def output(self, name: str, batch: Batch) -> Any:
        """The estimator's method ``name`` (one of :attr:`outputs`) on ``batch``; for
        :data:`~mmserver.codecs.explanations.ATTRIBUTIONS`, the batch's attributions."""
        if name == self.method:
            return self.predict(batch)
        if name == ATTRIBUTIONS:
            return self.explanation.explain(batch, self.name)
        return check_rows(self._method(name)(batch), batch)

    def sample(self) -> Batch:
        """One row of plain values, as this model takes it (the load's timing probe)."""
        row = [_plain(c) for c in self.inputs.columns]
        if self.inputs.dense:
            return np.array([row], dtype=np.float64)
        return row_table(self.inputs.columns, row)


def _again(predictor: EstimatorPredictor, reload: Callable[[], Any] | None) -> Callable[[], Any]:
    """The predictor's model object when its explanation is first built: the one it kept, or
    read again from its file. The predictor is held weakly: an explanation it holds must not
    keep it (and its model) alive past its unload until the garbage collector runs."""
    held = weakref.ref(predictor)

    def again() -> Any:
        kept = held()
        if kept is not None and kept.model is not None:
            return kept.model
        if reload is None:
            raise ModelLoadError("the model object was let go and cannot be read again")
        return reload()

    return again


def _output(predictor: EstimatorPredictor) -> Callable[[str, Any], Any]:
    """The predictor's :meth:`~EstimatorPredictor.output`, holding the predictor weakly (see
    :func:`_again`)."""
    held = weakref.ref(predictor)

    def output(name: str, batch: Any) -> Any:
        kept = held()
        if kept is None:
            raise ModelLoadError("the model was unloaded")
        return kept.output(name, batch)

    return output


def _dropped(batch: Batch) -> Any:
    """The own method of a model whose object was dropped: no route leads here."""
    raise AssertionError("the model's own method was dropped after its paths were chosen")


def _plain(column: Column) -> Any:
    """A value of ``column``'s kind the model was fitted on (for the timing probe)."""
    if column.categories:
        return column.categories[0]
    return {"number": 0.0, "string": "", "boolean": False}.get(column.kind)


def refuses_nan(model: Any) -> bool:
    """Whether scikit-learn says its own estimator refuses NaN (its ``allow_nan`` tag, which its
    input checks enforce): then a row of NaN need not be tried. Other estimators are tried."""
    if not type(model).__module__.startswith("sklearn."):
        return False
    try:
        from sklearn.utils import get_tags

        return not get_tags(model).input_tags.allow_nan
    except Exception:  # a scikit-learn without tags, an estimator whose tags fail
        return False


def find_inputs(
    model: Any,
    fn: Callable[[Any], Any],
    width: int | None,
    config: ModelConfig | None,
    files: Listing | None,
    sparse_missing: bool,
) -> Inputs:
    """What the model takes (:mod:`mmserver.codecs.schema`): its declared or fitted columns, and
    where it takes missing values (found by calling ``fn``, its method, unless configured);
    ``files``: its folder's files."""
    names = feature_names(model)
    columns = declared(files.folder, config.properties, files.names) if files and config else None
    if columns is not None and names is not None:
        kinds = {c.name: c for c in columns}
        if set(kinds) != set(names):
            raise ModelLoadError(
                f"the declared columns ({', '.join(kinds)}) are not the model's "
                f"({', '.join(names)})"
            )
        fitted = {c.name: c for c in fitted_columns(model, names)}
        columns = [
            replace(kinds[n], categories=kinds[n].categories or fitted[n].categories) for n in names
        ]
    elif columns is None and names is not None:
        columns = fitted_columns(model, names)
    frame = columns is not None
    if columns is None:
        columns = list(matrix_inputs(width).columns)
    policy = config.missing_values if config is not None else "auto"
    csv_header = bool(config and config.csv_header)
    if policy != "auto" or not columns:
        # A model that does not say its width cannot be probed: missing values only if asked.
        accept = policy == "accept"
        columns = [replace(c, missing=accept) for c in columns]
    elif not frame and refuses_nan(model):
        columns = [replace(c, missing=False) for c in columns]
    else:

        def call(cols: list[Column], row: list[Any]) -> Any:
            if frame:
                return fn(to_frame(row_table(cols, row), Inputs(tuple(cols), frame=True)))
            return fn(np.array([row], dtype=np.float64))

        columns = probe_missing(columns, call, frame)
    missing = all(c.missing for c in columns) if columns else policy == "accept"
    return Inputs(tuple(columns), frame, False, missing, sparse_missing, csv_header)


def signature(predictor: Predictor) -> dict[str, Any]:
    """What clients can know of a model without calling it: ``platform`` (the model's family:
    ``sklearn``, ``xgboost``, ``lightgbm``; ``python`` for a custom handler), ``format`` (its
    file's: ``pickle``, or its family's own format), ``n_features`` (or
    ``None``), and ``outputs``: per output its ``name``, the NumPy ``dtype`` string of its values
    and its ``shape`` (-1 where unknown), from the estimator's fitted attributes at load; a
    custom handler's output is listed by name only (``dtype`` and ``shape`` ``None``)."""
    inputs = predictor.inputs
    facts: dict[str, Any] = {
        "n_features": predictor.n_features,
        "inputs": inputs.describe() if inputs.frame else None,
        "raw": inputs.raw,
    }
    if not isinstance(predictor, EstimatorPredictor):
        outputs = [{"name": name, "dtype": None, "shape": None} for name in predictor.outputs]
        return {"platform": "python", "format": "python", **facts, "outputs": outputs}
    if predictor.tensors is not None:
        facts["tensors"] = predictor.tensors  # the model's graph's own inputs
    if predictor.input_example is not None:
        facts["input_example"] = predictor.input_example
    if predictor.trained_with:
        facts["trained_with"] = predictor.trained_with
        facts["served_with"] = served_versions()
    return {
        "platform": predictor.family,
        "format": predictor.file_format,
        **facts,
        "outputs": predictor.output_facts,
    }


def _output_facts(estimator: Any, method: str) -> dict[str, Any]:
    try:
        return _facts(estimator, method)
    except Exception:  # a fitted attribute of a foreign estimator may raise anything
        return {"name": method, "dtype": None, "shape": None}


def _facts(estimator: Any, method: str) -> dict[str, Any]:
    """The dtype and shape of ``method``'s answer, from fitted attributes (no call)."""
    classes = getattr(estimator, "classes_", None)
    n_classes = len(classes) if isinstance(classes, np.ndarray) and classes.ndim == 1 else None
    dtype, shape = "<f8", [-1, -1]
    if method == "predict":
        if n_classes is not None and classes is not None:
            dtype, shape = classes.dtype.str, [-1]
        else:
            shape = [-1, width] if (width := _regression_width(estimator)) > 1 else [-1]
    elif method == "predict_proba" and n_classes is not None:
        shape = [-1, n_classes]
    elif method == "decision_function" and n_classes is not None:
        shape = [-1] if n_classes == 2 else [-1, n_classes]
    return {"name": method, "dtype": dtype, "shape": shape}


def _called_facts(call: Callable[[Batch], Any], method: str, batch: Batch) -> dict[str, Any] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answer = np.asarray(call(batch))
    except Exception:
        return None
    return {"name": method, "dtype": answer.dtype.str, "shape": [-1, *answer.shape[1:]]}


def _regression_width(estimator: Any) -> int:
    """How many values a regressor predicts per row (1 unless it says more)."""
    outputs = getattr(estimator, "n_outputs_", None)
    if isinstance(outputs, int | np.integer) and not isinstance(outputs, bool):
        return int(outputs)
    coef = getattr(estimator, "coef_", None)
    if isinstance(coef, np.ndarray) and coef.ndim == 2:
        return int(coef.shape[0])
    return 1


#: How far a classifier's probabilities may stray from [0, 1] and their rows' sums from 1.
PROBABILITY_TOLERANCE = 1e-6
#: Rows of random values a classifier taking a matrix is checked on, besides its plain row.
_CHECKED_ROWS = 8


def check_probabilities(predictor: EstimatorPredictor) -> None:
    """Fail the load of a classifier whose ``predict_proba`` does not answer probabilities on
    a row of plain values (and, for one taking a matrix, a few random rows): every value in
    [0, 1] and every row summing to 1 (within :data:`PROBABILITY_TOLERANCE`). A model read by
    another version than the one that made it can answer anything (a forest pickled by
    scikit-learn 1.3 and read by 1.4 or later answers [30.8, 0.0]). A method that fails on
    these rows is left to the load's probe (:meth:`mmserver.backend.child.Models.load`)."""
    if "predict_proba" not in predictor.outputs or predictor.model is None:
        return
    rows = predictor.sample()
    if isinstance(rows, np.ndarray):
        noise = np.random.default_rng(0).normal(0.0, 3.0, (_CHECKED_ROWS, rows.shape[1]))
        rows = np.vstack([rows, noise])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answer = predictor.output("predict_proba", rows)
    except Exception:
        return
    if not isinstance(answer, np.ndarray) or answer.ndim != 2 or answer.dtype.kind != "f":
        return  # not one classifier's table of probabilities (several outputs, labels)
    low, high = float(np.min(answer)), float(np.max(answer))
    sums = answer.sum(axis=1)
    worst = float(np.max(np.abs(sums - 1.0))) if len(sums) else 0.0
    tolerance = PROBABILITY_TOLERANCE
    if np.isfinite(answer).all() and low >= -tolerance and high <= 1 + tolerance:
        if worst <= tolerance:
            return
    first = ", ".join(f"{v:.4g}" for v in answer[0][:4])
    raise ModelLoadError(
        f"its predict_proba does not answer probabilities (values from {low:.4g} "
        f"to {high:.4g}, rows summing to 1 within {worst:.3g}; the first row [{first}]): "
        "a model read by another version of its library than the one that made it can do "
        "this; it is not served"
    )


def load_predictor(model_dir: Path, config: ModelConfig, name: str | None = None) -> Predictor:
    """Load the model in ``model_dir`` with the handler its configuration asks for. Blocking.

    Raises :class:`ModelLoadError` saying why when the model cannot be used, naming the model
    ``name`` (by default the folder's name: an archive's is its unpacked copy's, ``NAME-KEY``).
    """
    model_dir = Path(model_dir)
    if name is None:
        name = model_dir.name
    files = Listing(model_dir)  # every file the load looks for, in one directory read
    if not files.exists:
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    entry = entry_point(files, config, name)
    if entry is not None:
        if not config.trust.full:
            raise UntrustedModel(
                f"model {name}: {entry.name} is a custom handler, code that runs in the server; "
                "it runs only for a model the server's trusted_models option names "
                f"({config.trust.named})",
                model=name,
            )
        return load_custom(model_dir, entry, config, name)
    if "option.handler" in config.properties:
        raise ModelLoadError(
            f"model {name}: option.handler={config.handler!r} needs a handler file, "
            f"but {config.entry_point} does not exist",
            model=name,
        )
    found = find_model_file(model_dir, config, name, files)
    if found is None:
        raise ModelLoadError(
            f"model {name} has no model file ({wanted_files(config.engine)})"
            f", and no {config.entry_point}",
            model=name,
        )
    model, trained = load_model(found, config.trust, config.on_version_skew)
    predictor = EstimatorPredictor(
        model,
        config.method,
        name,
        family=family_named(found.family).serves_as or found.family,
        fast_path=config.fast_path,
        batch_rows=config.batch_size,
        config=config,
        files=files,
        # What an explanation needs of a model its predict paths let go: read again.
        reload=lambda: load_model(found, config.trust, config.on_version_skew)[0],
    )
    predictor.file_format = found.format
    predictor.trained_with = trained
    if found.mlmodel is not None:
        predictor.input_example = mlmodel.input_example(model_dir, mlmodel.read(found.mlmodel))
    check_probabilities(predictor)
    sagemaker = config.sagemaker_xgboost
    if sagemaker is None:  # the SageMaker XGBoost container's own artifact
        sagemaker = found.family == XGBOOST and found.path.name == "xgboost-model"
    if sagemaker:
        predictor.inputs = replace(predictor.inputs, sagemaker_xgboost=True)
    return predictor
