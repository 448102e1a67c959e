"""A model's explanation: which method it gets, chosen at load, and its explainer, built at its
first explained batch (a model never explained pays nothing but the choice).

The methods, the first that applies:

- ``tree_shap`` (exact): TreeSHAP, path-dependent. An XGBoost or LightGBM booster (bare or in
  its scikit-learn wrapper) gives its own contributions (``pred_contribs``, ``pred_contrib``) of
  its margin; scikit-learn's forests, extra trees, decision trees and (binary or regression)
  gradient boosting get ``shap``'s TreeExplainer over their tree arrays (the ``explain`` extra):
  a forest classifier's class probabilities, a forest regressor's value, gradient boosting's
  margin;
- ``linear`` (exact): a linear model's coefficient times the distance of each column from its
  training mean: known when the steps before it end in a ``StandardScaler`` (mean 0), otherwise
  the background's mean; a classifier's margin (``decision_function``), a regressor's value;
- ``kernel_shap`` (approximate): Kernel SHAP against the background sample, at most
  ``option.explain_samples`` coalitions per row, of the model's probabilities (a classifier) or
  value; a model that takes a matrix of numbers only;
- ``none``: an answer of 400 saying what is missing.

The background is ``explain_background.csv`` beside the model (``option.explain_background``
names another file in the model's folder): rows as the model takes them, with a header line
of column names for a model whose columns have names. For a pipeline the exact methods run on
its last step's columns and are summed back to the input columns (:mod:`columnmap`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserver.codecs.explanations import KERNEL, LINEAR, TREE, Attributions
from mmserver.codecs.requests import decode_as
from mmserver.codecs.schema import Inputs
from mmserver.codecs.tabular import to_frame
from mmserver.config.model import ModelConfig
from mmserver.errors import InvalidInput, ModelLoadError
from mmserver.execution.columnmap import column_map, standardized
from mmserver.execution.families import inside, owner
from mmserver.execution.formats import Listing

NONE = "none"
BACKGROUND = "explain_background.csv"
#: The most background rows Kernel SHAP compares with (more are thinned evenly).
KERNEL_BACKGROUND_ROWS = 100
#: scikit-learn's tree ensembles shap's TreeExplainer reads.
_SKLEARN_TREES = frozenset(
    {
        "RandomForestRegressor",
        "RandomForestClassifier",
        "ExtraTreesRegressor",
        "ExtraTreesClassifier",
        "DecisionTreeRegressor",
        "DecisionTreeClassifier",
        "GradientBoostingRegressor",
        "GradientBoostingClassifier",
        "HistGradientBoostingRegressor",
        "HistGradientBoostingClassifier",
    }
)
#: Of those, the ones whose trees give a margin, explained only for one output.
_MARGIN_TREES = frozenset({"GradientBoostingClassifier", "HistGradientBoostingClassifier"})

#: Contributions of a batch of a last step's columns: ``(values[row, output, column],
#: base[row, output])``.
Contributions = Callable[[Any], tuple[np.ndarray, np.ndarray]]


@dataclass
class Explanation:
    """A model's explanation method and, once built, its explainer (:meth:`explain`)."""

    method: str
    exact: bool = False
    samples: int | None = None
    #: For ``none``: what the model lacks.
    missing: str | None = None
    build: Callable[[], Callable[[Any], Attributions]] | None = None
    _explainer: Callable[[Any], Attributions] | None = None

    def describe(self) -> dict[str, Any]:
        """The method as ``GET /models/NAME`` shows it."""
        said: dict[str, Any] = {"method": self.method, "exact": self.exact}
        if self.samples is not None:
            said["samples"] = self.samples
        if self.missing is not None:
            said["missing"] = self.missing
        return said

    def explain(self, batch: Any, model: str) -> Attributions:
        """The batch's attributions; :class:`InvalidInput` naming what is missing for a model
        that has none."""
        if self.build is None:
            raise InvalidInput(f"model {model} cannot be explained: {self.missing}")
        if self._explainer is None:
            self._explainer = self.build()
        return self._explainer(batch)


def plan_explanation(
    model: Any,
    inputs: Inputs,
    config: ModelConfig | None,
    files: Listing | None,
    output: Callable[[str, Any], Any],
    outputs: tuple[str, ...],
    source: Callable[[], Any] | None = None,
) -> Explanation:
    """The method ``model`` (taking ``inputs``; its folder's ``files``) gets. ``output(name,
    batch)`` answers one of its ``outputs`` (for Kernel SHAP). ``source()`` gives the model
    object again when its first explanation is built (read again from its file: the predict
    paths may have let it go); without it, a method that needs the model keeps it."""
    if config is not None and not config.explain:
        return Explanation(NONE, missing="option.explain=false")
    background = read_background(files, config, inputs)
    steps = list(getattr(model, "steps", []))
    final = _final(model)
    front = [s for _, s in steps[:-1]]
    names = list(inputs.names)
    mapped = column_map(front, names) if names else None
    kinds = tuple(_feature_type(c.kind) for c in inputs.columns)
    missing = (
        "it has no exact method (a tree ensemble, or a linear model whose training mean is "
        f"known) and no background sample ({BACKGROUND} beside the model, or "
        "option.explain_background)"
    )
    if mapped is not None:
        shaped = _Shaped(model, front, final, inputs, mapped, kinds)
        family = owner(final)
        if family is not None and family.contributions is not None:
            contributions = family.contributions
            return shaped.exact(TREE, lambda: contributions(final), "margin", _classes(final))
        kind = type(final).__name__
        if kind in _SKLEARN_TREES and _single_margin(final):
            if importlib.util.find_spec("shap") is None:
                missing = (
                    "its TreeSHAP needs shap, which is not installed (pip install "
                    "'mmserver[explain]')"
                )
            else:
                # Built from the model read again, so that a model never explained holds
                # only what its predict paths keep.
                again = source or (lambda: model)
                return shaped.exact(
                    TREE, lambda: _shap_trees(_final(again())), *_tree_output(final)
                )
        elif _is_linear(final):
            mean = None
            if background is not None:
                mean = np.asarray(shaped.last_columns(background), dtype=np.float64).mean(axis=0)
            elif standardized(front):
                mean = np.zeros(mapped.shape[0])
            if mean is not None:
                classifier = hasattr(final, "classes_")
                explained = "margin" if classifier else "value"
                return shaped.exact(
                    LINEAR, lambda: _linear(final, mean), explained, _classes(final)
                )
    missing = (
        "it has no exact method (a tree ensemble, or a linear model whose training mean is "
        f"known) and no background sample ({BACKGROUND} beside the model, or "
        "option.explain_background)"
    )
    if background is not None:
        if not inputs.dense:
            return Explanation(NONE, missing="Kernel SHAP takes models of number columns only")
        method = "predict_proba" if "predict_proba" in outputs else outputs[0]
        samples = config.explain_samples if config is not None else 256
        classes = _classes(final) if method == "predict_proba" else None
        return Explanation(
            KERNEL,
            samples=samples,
            build=lambda: _kernel(
                lambda x: output(method, x), background, samples, inputs, classes, kinds
            ),
        )
    return Explanation(NONE, missing=missing)


class _Shaped:
    """The exact methods' common work: the pipeline's steps before its last on a batch, and
    the last step's contributions summed back to the input columns."""

    def __init__(
        self,
        model: Any,
        front: list[Any],
        final: Any,
        inputs: Inputs,
        mapped: np.ndarray,
        kinds: tuple[str, ...],
    ) -> None:
        self.front = model[:-1] if front else None
        self.inputs = inputs
        self.mapped = mapped
        self.kinds = kinds

    def last_columns(self, batch: Any) -> Any:
        """The batch as the pipeline's last step sees it."""
        taken = to_frame(batch, self.inputs) if self.inputs.frame else batch
        if self.front is None:
            return taken
        out = self.front.transform(taken)
        return out.toarray() if hasattr(out, "toarray") else out

    def exact(
        self,
        method: str,
        make: Callable[[], Contributions],
        explained: str,
        outputs: tuple[str, ...] | None,
    ) -> Explanation:
        def build() -> Callable[[Any], Attributions]:
            contributions = make()
            names = self.inputs.names

            def explain(batch: Any) -> Attributions:
                values, base = contributions(self.last_columns(batch))
                several = outputs if outputs is not None and values.shape[1] > 1 else None
                return Attributions(
                    names, several, explained, method, True, values @ self.mapped, base, self.kinds
                )

            return explain

        return Explanation(method, exact=True, build=build)


def _feature_type(kind: str) -> str:
    return "numerical" if kind == "number" else "categorical"


def _classes(estimator: Any) -> tuple[str, ...] | None:
    classes = getattr(estimator, "classes_", None)
    if classes is None:
        return None
    return tuple(str(c) for c in np.asarray(classes).tolist())


def _single_margin(final: Any) -> bool:
    """Whether shap reads it: gradient boosting classifiers of two classes only."""
    if type(final).__name__ not in _MARGIN_TREES:
        return True
    return len(getattr(final, "classes_", ())) == 2


def _tree_output(final: Any) -> tuple[str, tuple[str, ...] | None]:
    kind = type(final).__name__
    if kind in _MARGIN_TREES:
        return "margin", None
    if hasattr(final, "classes_"):
        return "probability", _classes(final)
    return "value", None


def _is_linear(final: Any) -> bool:
    return type(final).__module__.startswith("sklearn.linear_model") and hasattr(final, "coef_")


def _final(model: Any) -> Any:
    """A pipeline's last step, or the model itself."""
    steps = getattr(model, "steps", None)
    return steps[-1][1] if steps else model


def _shap_trees(final: Any) -> Contributions:
    import shap

    explainer = shap.TreeExplainer(final, feature_perturbation="tree_path_dependent")
    expected = np.atleast_1d(np.asarray(explainer.expected_value, dtype=np.float64))

    def contributions(columns: Any) -> tuple[np.ndarray, np.ndarray]:
        values = np.asarray(explainer.shap_values(columns, check_additivity=False))
        values = values[:, None, :] if values.ndim == 2 else values.transpose(0, 2, 1)
        return values, np.broadcast_to(expected, (len(values), len(expected)))

    return contributions


def _linear(final: Any, mean: np.ndarray) -> Contributions:
    coef = np.atleast_2d(np.asarray(final.coef_, dtype=np.float64))
    intercept = np.atleast_1d(np.asarray(final.intercept_, dtype=np.float64))
    base = coef @ mean + intercept

    def contributions(columns: Any) -> tuple[np.ndarray, np.ndarray]:
        centred = np.asarray(columns, dtype=np.float64) - mean
        values = centred[:, None, :] * coef[None, :, :]
        return values, np.broadcast_to(base, (len(values), len(base)))

    return contributions


def _kernel(
    fn: Callable[[Any], Any],
    background: Any,
    samples: int,
    inputs: Inputs,
    classes: tuple[str, ...] | None,
    kinds: tuple[str, ...],
) -> Callable[[Any], Attributions]:
    import shap

    rows = np.asarray(background, dtype=np.float64)
    if len(rows) > KERNEL_BACKGROUND_ROWS:
        rows = rows[np.linspace(0, len(rows) - 1, KERNEL_BACKGROUND_ROWS).astype(int)]
    explainer = shap.KernelExplainer(lambda x: np.asarray(fn(np.asarray(x)), float), rows)
    expected = np.atleast_1d(np.asarray(explainer.expected_value, dtype=np.float64))
    names = inputs.names or tuple(f"x{j}" for j in range(rows.shape[1]))

    def explain(batch: Any) -> Attributions:
        values = np.asarray(explainer.shap_values(np.asarray(batch), nsamples=samples, silent=True))
        values = values[:, None, :] if values.ndim == 2 else values.transpose(0, 2, 1)
        several = classes if values.shape[1] > 1 else None
        explained = "probability" if classes is not None else "value"
        base = np.broadcast_to(expected, (len(values), len(expected)))
        return Attributions(names, several, explained, KERNEL, False, values, base, kinds)

    return explain


def read_background(
    files: Listing | None, config: ModelConfig | None, inputs: Inputs
) -> Any | None:
    """The background sample's rows (in the model folder's ``files``), as the model takes them;
    ``None`` without one."""
    if files is None:
        return None
    model_dir = files.folder
    named = config.explain_background if config is not None else None
    if named:
        path = inside(model_dir, named, "option.explain_background", model_dir.name)
        if not files.has(named):
            raise ModelLoadError(f"option.explain_background={named!r} does not exist")
    else:
        found = files.file(BACKGROUND)
        if found is None:
            return None
        path = found
    kind = "text/csv; header=present" if inputs.frame else "text/csv"
    try:
        return decode_as(path.read_bytes(), kind, inputs, f"{path.name}")
    except InvalidInput as exc:
        raise ModelLoadError(f"{path.name} is not a background sample: {exc.message}") from None
