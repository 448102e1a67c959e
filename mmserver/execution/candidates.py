"""The candidate predict paths of a model's method (runs inside the backend processes).

Each builder returns a function of a batch, or nothing when the model is not one it knows;
:mod:`mmserver.execution.fastpath` verifies them against the model's own method before any is used:

- :func:`linear_product`: ``X @ coef_ + intercept_`` for scikit-learn's linear regressors;
- the ``treelite`` path: the model converted by treelite (scikit-learn's forests, extra-trees,
  gradient boosting, histogram gradient boosting and isolation forest; XGBoost and LightGBM
  boosters) and run by its GTIL interpreter on one thread. Conversion happens here, in the
  backend process, at load; nothing is compiled;
- the ``native`` path: an XGBoost or LightGBM booster's own predict without its wrapper;
- the ``numpy`` path: a scikit-learn random forest's or extra-trees' node tables, walked by
  NumPy for every tree and row of a batch at once (:func:`forest_walk`).

A pipeline's last step is looked at, behind the steps before it (a chain of StandardScalers is
computed directly, as its ``transform`` computes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mmserver.execution.boosters import is_a
from mmserver.execution.families import owner, reason

LINEAR, TREELITE, NATIVE, NUMPY = "linear", "treelite", "native", "numpy"

Fn = Callable[[np.ndarray], Any]
#: (name, fn, treelite model or None) of a model's method.
Made = list[tuple[str, Fn, Any]]


def split_pipeline(model: Any) -> tuple[Any, Any]:
    """``(steps before the last, last step)`` of a scikit-learn pipeline; ``(None, model)``
    for anything else."""
    try:
        from sklearn.pipeline import Pipeline
    except ImportError:
        return None, model
    if isinstance(model, Pipeline) and len(model.steps) >= 2:
        last = model.steps[-1][1]
        if last is not None and last != "passthrough":
            return model[:-1], last
    return None, model


def candidates(
    est: Any, method: str, head: Any, rejected: dict[str, str], frame: Fn | None = None
) -> Made:
    """The candidate paths of ``est.<method>`` behind a pipeline's ``head`` (``None``: no steps
    before it); ``frame`` turns a matrix into the DataFrame the head was fitted on."""
    made: Made = []
    if method == "predict":
        product = linear_product(est)
        if product is not None:
            made.append((LINEAR, product, None))
    for name, build in ((NATIVE, _native), (NUMPY, forest_walk), (TREELITE, _treelite)):
        try:
            built = build(est)
        except Exception as exc:
            rejected[name] = f"cannot be built: {reason(exc)}"
            continue
        if built is None:
            continue
        kind, scores, tl_model = built
        fn = _finish(est, method, kind, scores)
        if fn is not None:
            made.append((name, fn, tl_model))
    if head is None:
        return made
    transform = _scalers(head)
    if transform is None:
        step = head.transform
        transform = step if frame is None else (lambda batch: step(frame(batch)))
    return [(name, _after(transform, fn), tm) for name, fn, tm in made]


def _scalers(head: Any) -> Fn | None:
    """``head.transform`` when ``head`` is a chain of StandardScalers, computed as their
    ``transform`` computes it (subtract the mean, divide by the scale) without its per-call
    checks, which cost several times the arithmetic for a small batch."""
    try:
        from sklearn.preprocessing import StandardScaler
    except ImportError:
        return None
    steps = []
    for _, step in head.steps:
        if type(step) is not StandardScaler:
            return None
        steps.append(scaler_arithmetic(step))

    def transform(batch: np.ndarray) -> np.ndarray:
        for step in steps:
            batch = step(batch)
        return batch

    return transform


def scaler_arithmetic(scaler: Any) -> Fn:
    """A fitted StandardScaler's ``transform`` as arithmetic on a copy of the batch: subtract the
    mean, divide by the scale."""
    mean = scaler.mean_ if scaler.with_mean else None
    scale = scaler.scale_ if scaler.with_std else None

    def scaled(batch: np.ndarray) -> np.ndarray:
        out = np.array(batch, dtype=np.float64)
        if mean is not None:
            out -= mean
        if scale is not None:
            out /= scale
        return out

    return scaled


def _after(transform: Fn, fn: Fn) -> Fn:
    return lambda batch: fn(transform(batch))


def _native(est: Any) -> tuple[str, Fn, Any] | None:
    """A booster's own predict without its wrapper (XGBoost's ``inplace_predict``, LightGBM's
    ``Booster.predict``): its family's :attr:`~mmserver.execution.families.Family.native`."""
    family = owner(est)
    if family is None or family.native is None:
        return None
    run = family.native(est)
    return ("value", run, None) if run is not None else None


def _treelite(est: Any) -> tuple[str, Fn, Any] | None:
    """The model converted to treelite, run by GTIL on one thread."""
    kind, source = _treelite_source(est)
    if kind is None:
        return None
    family = owner(est)
    if family is not None and family.treelite is not None:
        tl_model = family.treelite(est)
    else:
        import treelite.sklearn

        tl_model = treelite.sklearn.import_model(est)
    run = _gtil(tl_model, margin=kind == "margin")
    if source == "sklearn-tree":
        # scikit-learn's trees compare the float32 value of a feature with their threshold.
        return kind, lambda batch: run(batch.astype(np.float32)), tl_model
    return kind, run, tl_model


#: Below this many rows, :func:`forest_walk` walks every tree at once (its temporaries are
#: rows x trees); from it, the trees :data:`WALK_TREES` at a time over up to :data:`WALK_ROWS`
#: rows: the nodes of a few trees stay in the CPU's caches while every row goes through them,
#: where a walk of all the trees at once reads nodes from memory (a 300-tree forest of depth
#: 14: ~250 us a row at 2,048 or 16,384 rows, ~120 and ~100 us grouped).
WALK_GROUPED_FROM = 128
WALK_TREES = 16
WALK_ROWS = 4096


def forest_walk(est: Any) -> tuple[str, Fn, None] | None:
    """A scikit-learn random forest or extra-trees ensemble (one output) as flat node tables of
    all its trees, walked by NumPy a level at a time for every (row, tree) pair of a batch.

    Its own predict calls every tree in turn (~60 us each, whatever the rows); GTIL walks each
    tree for each row. On a 300-tree forest of depth 14 this walk takes ~0.1 ms for one row
    (GTIL ~0.12 ms) and ~2.7 ms for 32 rows (GTIL ~9.8 ms). The answer is the trees' own
    arithmetic: the row's float32 values compared with the float64 thresholds (``x <= t`` goes
    left), and the leaves' values summed tree after tree (``cumsum``, the order in which the
    forest adds them) then divided by the number of trees: equal, bit for bit, to the forest's
    ``predict`` and ``predict_proba``.
    """
    try:
        from sklearn import ensemble as e
    except ImportError:
        return None
    if not isinstance(
        est,
        e.RandomForestRegressor
        | e.ExtraTreesRegressor
        | e.RandomForestClassifier
        | e.ExtraTreesClassifier,
    ):
        return None
    if getattr(est, "n_outputs_", None) != 1:
        return None
    classes = getattr(est, "n_classes_", None)
    trees = [tree.tree_ for tree in est.estimators_]
    if not trees:
        return None
    sizes = np.array([t.node_count for t in trees], dtype=np.intp)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    feature = np.concatenate([t.feature for t in trees]).astype(np.intp)
    threshold = np.concatenate([t.threshold for t in trees]).astype(np.float64)
    child = np.empty(2 * int(sizes.sum()), dtype=np.intp)
    for tree, start in zip(trees, starts, strict=True):
        own = np.arange(tree.node_count, dtype=np.intp)
        left, right = tree.children_left, tree.children_right
        at = 2 * start
        # A leaf is its own child either way, so every walk can take the deepest tree's steps.
        child[at : at + 2 * tree.node_count : 2] = np.where(left < 0, own, left) + start
        child[at + 1 : at + 2 * tree.node_count : 2] = np.where(right < 0, own, right) + start
    feature[feature < 0] = 0
    if classes is None:
        values = np.concatenate([t.value[:, 0, 0] for t in trees])
    else:
        values = np.concatenate([t.value[:, 0, : int(classes)] for t in trees])
    roots = starts[np.newaxis, :]
    depths = [int(t.max_depth) for t in trees]
    count = len(trees)
    width = int(est.n_features_in_)

    def leaves(rows: np.ndarray, first: int, last: int) -> np.ndarray:
        """The leaves' values of trees ``first`` to ``last`` (excluded) for ``rows``."""
        x = rows.astype(np.float32).astype(np.float64).ravel()
        base = (np.arange(len(rows), dtype=np.intp) * width)[:, np.newaxis]
        node = np.repeat(roots[:, first:last], len(rows), axis=0)
        for _ in range(max(depths[first:last])):
            node = child[2 * node + (x[base + feature[node]] > threshold[node])]
        return values[node]  # type: ignore[no-any-return]

    def summed(found: np.ndarray) -> np.ndarray:
        """The forest's answer from its trees' leaves: summed tree after tree, as it sums
        them, then divided by their number."""
        return np.cumsum(found, axis=1)[:, -1] / count

    def walk(batch: np.ndarray) -> np.ndarray:
        if batch.ndim != 2 or batch.shape[1] != width:
            raise ValueError(
                f"X has shape {batch.shape}; the forest expects rows of {width} features"
            )
        if len(batch) < WALK_GROUPED_FROM:
            return summed(leaves(batch, 0, count))
        outputs = []
        for first in range(0, len(batch), WALK_ROWS):
            rows = batch[first : first + WALK_ROWS]
            found = np.empty((len(rows), count, *values.shape[1:]), dtype=values.dtype)
            for tree in range(0, count, WALK_TREES):
                found[:, tree : tree + WALK_TREES] = leaves(rows, tree, tree + WALK_TREES)
            outputs.append(summed(found))
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs)

    return "value", walk, None


def _treelite_source(est: Any) -> tuple[str | None, str]:
    family = owner(est)
    if family is not None:
        return ("value", family.name) if family.treelite is not None else (None, "")
    try:
        from sklearn import ensemble as e
    except ImportError:
        return None, ""
    if isinstance(est, e.HistGradientBoostingClassifier | e.GradientBoostingClassifier):
        hist = isinstance(est, e.HistGradientBoostingClassifier)
        return "margin", "sklearn-hist" if hist else "sklearn-tree"
    if isinstance(est, e.HistGradientBoostingRegressor):
        return "value", "sklearn-hist"
    if isinstance(est, e.IsolationForest):
        return "isolation", "sklearn-tree"
    if isinstance(
        est,
        e.RandomForestRegressor
        | e.RandomForestClassifier
        | e.ExtraTreesRegressor
        | e.ExtraTreesClassifier
        | e.GradientBoostingRegressor,
    ):
        return "value", "sklearn-tree"
    return None, ""


def _gtil(tl_model: Any, margin: bool) -> Fn:
    """GTIL's predict on one thread (a backend process is one core's worth of work). Its
    configuration is parsed once, not per call, where this treelite version allows it."""
    import treelite.gtil

    try:
        from treelite.gtil import gtil as module

        config = module.GTILConfig(nthread=1, predict_type="raw" if margin else "default")
        impl = module._predict_impl
        return lambda batch: impl(tl_model, batch, config=config)
    except (ImportError, AttributeError, TypeError):
        predict = treelite.gtil.predict
        return lambda batch: predict(tl_model, batch, nthread=1, pred_margin=margin)


def _finish(est: Any, method: str, kind: str, scores: Fn) -> Fn | None:
    """``method``'s answer from a path's scores: values or class probabilities (``value``),
    raw margins (``margin``: scikit-learn's gradient boosting classifiers) or isolation depth
    ratios (``isolation``); ``None`` where the scores do not give that method."""
    classes = getattr(est, "classes_", None)
    if kind == "isolation":
        offset = float(est.offset_)

        def decision(batch: np.ndarray) -> np.ndarray:
            result: np.ndarray = -np.asarray(scores(batch)).reshape(len(batch)) - offset
            return result

        if method == "decision_function":
            return decision
        if method == "predict":
            return lambda batch: np.where(decision(batch) < 0, -1, 1)
        return None
    if classes is None or not isinstance(classes, np.ndarray) or classes.ndim != 1:
        return scores if kind == "value" and method == "predict" else None
    if kind == "value":

        def proba(batch: np.ndarray) -> np.ndarray:
            out = np.asarray(scores(batch)).reshape(len(batch), -1)
            if out.shape[1] == 1 and len(classes) == 2:
                return np.column_stack((1 - out[:, 0], out[:, 0]))
            return out
    else:
        loss = getattr(est, "_loss", None)
        if loss is None:
            return None
        at_zero = int(not is_a(est, "sklearn", "HistGradientBoostingClassifier"))

        def margins(batch: np.ndarray) -> np.ndarray:
            out = np.asarray(scores(batch)).reshape(len(batch), -1)
            return out.ravel() if out.shape[1] == 1 else out

        if method == "decision_function":
            return margins
        if method == "predict":

            def labels(batch: np.ndarray) -> np.ndarray:
                raw = margins(batch)
                encoded = (
                    ((raw >= 0) if at_zero else (raw > 0)).astype(int)
                    if raw.ndim == 1
                    else np.argmax(raw, axis=1)
                )
                result: np.ndarray = classes.take(encoded)
                return result

            return labels

        def proba(batch: np.ndarray) -> np.ndarray:
            result: np.ndarray = loss.predict_proba(margins(batch))
            return result

    if method == "predict_proba":
        return proba
    if method == "predict":
        return lambda batch: classes.take(np.argmax(proba(batch), axis=1))
    return None


# ------------------------------------------------------------------------------------------------
# Linear regressors
# ------------------------------------------------------------------------------------------------


def linear_product(model: Any) -> Fn | None:
    """``X @ coef_ + intercept_`` for scikit-learn's linear regressors, or ``None``.

    Their ``predict`` checks its input (type, shape, fitted state), then computes that
    product. The checks take ~50 µs, 40 times the product for a small batch, and every batch
    reaching a model has been checked already: a C-contiguous 2-D float64 array, finite, with
    the model's number of columns. So the product is computed directly, for a class that
    inherits ``predict`` unchanged from scikit-learn's ``LinearModel`` and whose coefficients
    are a dense float64 array (the caller verifies its answers).
    """
    try:
        from sklearn.linear_model._base import LinearModel, MultiOutputLinearModel
    except ImportError:  # another layout of scikit-learn: keep its own predict
        return None
    cls = type(model)
    if not (
        isinstance(model, LinearModel)
        and cls.predict in (LinearModel.predict, MultiOutputLinearModel.predict)
        and cls._decision_function is LinearModel._decision_function
    ):
        return None
    coef = getattr(model, "coef_", None)
    intercept = getattr(model, "intercept_", None)
    n_features = getattr(model, "n_features_in_", None)
    if not (isinstance(coef, np.ndarray) and coef.dtype == np.float64 and coef.ndim in (1, 2)):
        return None
    if not isinstance(intercept, float | np.ndarray) or not isinstance(n_features, int):
        return None
    weights = coef if coef.ndim == 1 else coef.T

    def predict(batch: np.ndarray) -> np.ndarray:
        if batch.ndim != 2 or batch.shape[1] != n_features or batch.dtype != np.float64:
            checked: np.ndarray = model.predict(batch)  # the estimator says what is wrong
            return checked
        product: np.ndarray = batch @ weights + intercept
        return product

    return predict
