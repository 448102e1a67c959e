"""Model families: one :class:`Family` record each, which every place that knows of a family
reads. Adding a family is one record in :data:`FAMILIES` (and its tests).

Runs inside the backend processes. The families, told apart by their files unless ``engine``
(or ``option.model_file``) in ``serving.properties`` says:

- ``skops`` (``engine=skops``): scikit-learn's secure format, ``model.skops`` or a single
  ``*.skops``, loaded with skops (the types it trusts, those a pickle may use and
  ``trusted_types``); its estimators are served as the ``sklearn`` family's;
- ``sklearn`` (``engine=Python`` or ``sklearn``): a pickle, ``model.joblib``, ``model.pkl`` or a
  single ``*.joblib``/``*.pkl``, loaded with joblib through the restricted unpickler
  (:mod:`mmserver.execution.unpickling`) unless ``trusted_models`` names the model. It may hold
  any estimator or pipeline, including XGBoost's and LightGBM's scikit-learn wrappers, or a bare
  booster;
- ``xgboost`` (``engine=XGBoost``): XGBoost's own format, ``xgboost-model`` (the file of the
  SageMaker XGBoost container's ``model.tar.gz``: JSON, UBJSON or a pickle), ``model.json`` /
  ``model.ubj``, or a single ``*.ubj`` or XGBoost ``*.json``;
- ``lightgbm`` (``engine=LightGBM``): LightGBM's text format, ``model.txt`` or a single ``*.txt``
  that starts with LightGBM's ``tree`` header;
- ``onnx`` (``engine=OnnxRuntime``, DJL's spelling, or ``onnx``): an ONNX graph, ``model.onnx``
  or a single ``*.onnx``, run by onnxruntime (:mod:`mmserver.execution.onnxgraph`).

A bare booster is wrapped in :class:`~mmserver.execution.boosters.XGBoostBooster` or
:class:`~mmserver.execution.boosters.LightGBMBooster`, whose ``predict`` is the library's own.
XGBoost, LightGBM and onnxruntime are optional extras: a model that needs one that is not
installed fails its load with a message saying what to install.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import joblib

from mmserver.codecs import mlmodel
from mmserver.config.model import ModelConfig
from mmserver.config.trust import Trust
from mmserver.errors import ConfigError, ModelLoadError, UntrustedModel
from mmserver.execution import skew
from mmserver.execution.boosters import (
    Fn,
    LightGBMBooster,
    XGBoostBooster,
    lightgbm_categories,
    lightgbm_names,
    lightgbm_native,
    lightgbm_treelite,
    owns_lightgbm,
    owns_xgboost,
    xgboost_names,
    xgboost_native,
    xgboost_treelite,
)
from mmserver.execution.onnxgraph import OnnxModel, open_graph
from mmserver.execution.unpickling import (
    allowed,
    check_reads_no_files,
    refusal,
    restricted_load,
)

log = logging.getLogger(__name__)

SKLEARN, XGBOOST, LIGHTGBM, ONNX, SKOPS = "sklearn", "xgboost", "lightgbm", "onnx", "skops"
MLFLOW = "mlflow"
PICKLES = ("model.joblib", "model.pkl")
#: The format of a pickled model's file (whatever its family).
PICKLE = "pickle"
_HEAD = 4096


@dataclass(frozen=True)
class Family:
    """One model family: how its models are found, loaded and run, in one record.

    The file work (:attr:`find`, :attr:`claims`, :attr:`wanted`) chooses a model's family, the
    loading (:attr:`load`, :attr:`package`) makes its model object, and the rest says what its
    boosters give the predict paths (:mod:`mmserver.execution.candidates`) and what they know of
    the columns they were fitted on (:mod:`mmserver.execution.fitted`)."""

    #: Its name, as :class:`ModelFile` and the model's signature (``platform``) say it.
    name: str
    #: The ``engine`` values of ``serving.properties`` that choose it, as the docs spell them
    #: (compared in lower case).
    engines: tuple[str, ...]
    #: The files that hold its models, as a model folder without one is told.
    wanted: str
    #: Its model file in a model folder (listed once for every family); ``None``: none there.
    find: Callable[[Listing], Path | None]
    #: Whether a file named by ``option.model_file`` is one of its (the first family that
    #: claims it reads it); ``None``: every file that no other family claims.
    claims: Callable[[Path], bool] | None
    #: The optional package it needs (also the top-level module of its objects); ``None``:
    #: none.
    package: str | None = None
    #: mmserver's extra that installs it, when not named as the package.
    extra: str | None = None
    #: Its own format's loader, given the model's trust; ``None``: the file is a pickle, loaded
    #: with joblib (restricted: :mod:`mmserver.execution.unpickling`).
    load: Callable[[Path, Trust], Any] | None = None
    #: Whether an estimator is one of its boosters (bare, wrapped, or the library's
    #: scikit-learn wrapper).
    owns: Callable[[Any], bool] | None = None
    #: The booster's own predict on a batch, without its wrapper's checks (``None``: the
    #: estimator's predict is that already).
    native: Callable[[Any], Fn | None] | None = None
    #: The booster converted to a treelite model.
    treelite: Callable[[Any], Any] | None = None
    #: The column names the booster keeps (generic ones are no names).
    feature_names: Callable[[Any], list[str] | None] | None = None
    #: ``(input index, categories)`` of the booster's categorical columns.
    categories: Callable[[Any, int], Iterator[tuple[int, tuple[Any, ...]]]] | None = None
    #: ``(input index, kind)`` of the booster's columns that are not numbers (strings,
    #: booleans: :mod:`mmserver.codecs.schema`'s kinds).
    kinds: Callable[[Any], Iterator[tuple[int, str]]] | None = None
    #: The tensors the booster takes (name, NumPy dtype string, shape with -1 for any size),
    #: for the V2 metadata; ``None``: the columns say.
    tensors: Callable[[Any], list[dict[str, Any]]] | None = None
    #: An index a libsvm row leaves out is a missing value to its boosters (XGBoost's and
    #: LightGBM's reading), not 0.
    sparse_missing: bool = False
    #: The family its loaded models are served as, when its files hold another family's
    #: objects (a skops file holds scikit-learn estimators); ``None``: itself.
    serves_as: str | None = None
    #: The model file its file names, for a family whose file only says where another
    #: family's is (an MLflow folder's ``MLmodel``); ``None``: its file is the model's.
    resolve: Callable[[Path], ModelFile] | None = None


@dataclass(frozen=True)
class ModelFile:
    """The file holding a model and the family that reads it."""

    family: str
    path: Path
    #: The MLflow ``MLmodel`` file that named it, for a model saved by MLflow.
    mlmodel: Path | None = None

    @functools.cached_property
    def format(self) -> str:
        """The file's format: ``pickle``, or the family's own (its name). Read once."""
        family = family_named(self.family)
        if family.load is None or _head(self.path)[:1] == b"\x80":
            return PICKLE
        return family.name


def reason(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def missing_extra(package: str) -> str:
    """What to install for ``package``, the optional package of a family."""
    extra = next((f.extra for f in FAMILIES if f.package == package and f.extra), package)
    return (
        f"the {package} package is not installed; install it with "
        f"pip install 'mmserver[{extra}]' (or pip install {package})"
    )


def engine_families(engine: str | None, where: str = "") -> tuple[Family, ...]:
    """The families a model's ``engine`` lets its file be read as, in the order they are tried
    (every family for none). Raises :class:`ConfigError` (prefixed with ``where``, the file
    that set it) for an engine no family spells."""
    if engine is None:
        return FAMILIES
    wanted = engine.strip().lower()
    for family in FAMILIES:
        if wanted in (e.lower() for e in family.engines):
            return (family,)
    spellings = ", ".join(e for family in FAMILIES for e in family.engines)
    raise ConfigError(f"{where}: " * bool(where) + f"engine={engine!r} must be one of {spellings}")


def wanted_files(engine: str | None) -> str:
    """The files that would hold a model whose ``engine`` is this (``None``: any family's)."""
    return "; ".join(family.wanted for family in engine_families(engine))


def owner(estimator: Any) -> Family | None:
    """The family whose booster ``estimator`` is (bare, wrapped or in its scikit-learn
    wrapper); ``None`` for any other estimator."""
    for family in FAMILIES:
        if family.owns is not None and family.owns(estimator):
            return family
    return None


def find_model_file(
    model_dir: Path, config: ModelConfig, name: str | None = None
) -> ModelFile | None:
    """The model's file: ``option.model_file`` if given, else the first family (in the order
    of :data:`FAMILIES`, or only ``engine``'s) with a file in the folder. Errors name the
    model ``name`` (by default the folder's name)."""
    name = model_dir.name if name is None else name
    wanted = engine_families(config.engine)
    if config.model_file is not None:
        path = inside(model_dir, config.model_file, "option.model_file", name)
        if not path.is_file():
            raise ModelLoadError(
                f"model {name}: option.model_file={config.model_file!r} does not exist",
                model=name,
            )
        if config.engine is None:
            claimed = [f for f in FAMILIES if f.claims is not None and f.claims(path)]
            wanted = (*claimed, *(f for f in FAMILIES if f.claims is None))
        family = wanted[0]
        return family.resolve(path) if family.resolve else ModelFile(family.name, path)
    listing = Listing(model_dir)
    for family in wanted:
        candidate = family.find(listing)
        if candidate is not None:
            if family.resolve is not None:
                return family.resolve(candidate)
            return ModelFile(family.name, candidate)
    return None


def inside(model_dir: Path, relative: str, key: str, name: str) -> Path:
    """``model_dir / relative``, refused unless it stays inside the folder (``key`` is the
    property that named it; ``name`` the model)."""
    parts = Path(relative)
    if parts.is_absolute() or ".." in parts.parts or not parts.parts:
        raise ModelLoadError(
            f"model {name}: {key}={relative!r} must be a file inside the model folder",
            model=name,
        )
    return model_dir / parts


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(_HEAD)
    except OSError:
        return b""


class Listing:
    """The files of a model folder, listed once for every family's finder (a load looks for
    several families' files: one directory read, not one per family)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        try:
            with os.scandir(folder) as entries:
                self.names = sorted(e.name for e in entries if e.is_file())
        except OSError:
            self.names = []

    def file(self, name: str) -> Path | None:
        """The file ``name`` of the folder, if it has one."""
        return self.folder / name if name in self.names else None

    def single(self, suffix: str, claims: Callable[[Path], bool] | None = None) -> Path | None:
        """The folder's only file ending in ``suffix`` (that ``claims`` takes, if given)."""
        found = [self.folder / n for n in self.names if n.endswith(suffix)]
        if claims is not None:
            found = [path for path in found if claims(path)]
        return found[0] if len(found) == 1 else None


def _module_of(estimator: Any) -> str:
    return type(estimator).__module__.split(".")[0]


def load_model(
    found: ModelFile, trust: Trust, on_skew: str = skew.REFUSE
) -> tuple[Any, dict[str, str]]:
    """The model object in ``found`` (an estimator, or a booster wrapped so that its
    ``predict`` is the library's own; an ONNX graph in its session), and the library versions
    that made it when they are not the server's. A pickle is rebuilt only from what ``trust``
    allows (:mod:`mmserver.execution.unpickling`); one made by another minor version of
    scikit-learn is refused when ``on_skew`` says so (:mod:`mmserver.execution.skew`). Raises
    :class:`ModelLoadError` saying why not."""
    family = family_named(found.family)
    if found.format != PICKLE:
        assert family.load is not None
        return family.load(found.path, trust), {}
    model, trained = load_pickle(found.path, trust, on_skew)
    return wrap_booster(model), trained


def family_named(name: str) -> Family:
    """The family called ``name``."""
    return next(family for family in FAMILIES if family.name == name)


def wrap_booster(model: Any) -> Any:
    """A bare XGBoost or LightGBM booster wrapped (unpickled ones too); a scikit-learn wrapper
    of one set to predict on one thread (see :class:`XGBoostBooster`); anything else as is."""
    module = _module_of(model)
    if type(model).__name__ == "Booster":
        if module == XGBOOST:
            return XGBoostBooster(model)
        if module == LIGHTGBM:
            return LightGBMBooster(model)
    if module in (XGBOOST, LIGHTGBM) and hasattr(model, "set_params"):
        # A wrapper keeps the thread count it was trained with (XGBoost's 0 is every core).
        try:
            model.set_params(n_jobs=1)
            if module == XGBOOST:
                model.get_booster().set_param({"nthread": 1})
        except Exception as exc:  # a wrapper of another version: its own threads, but served
            log.warning("%s model: could not set one thread: %s", module, reason(exc))
    return model


def load_pickle(path: Path, trust: Trust, on_skew: str = skew.REFUSE) -> tuple[Any, dict[str, str]]:
    """The object in the pickle at ``path``, restricted (:func:`restricted_load`) unless the
    model is fully trusted, and the versions that made it when they are not the server's
    (refused by ``on_skew``, :func:`mmserver.execution.skew.check`)."""
    # A model pickled by another library version warns; that is the operator's to see in the
    # log, not an exception in the backend.
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = joblib.load(path) if trust.full else restricted_load(path, trust)
    except UntrustedModel:
        raise
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package in (f.package for f in FAMILIES if f.package):
            raise ModelLoadError(
                f"{path.name} holds a {package} model: {missing_extra(package)}"
            ) from None
        raise ModelLoadError(skew.unreadable(path.name, path, reason(exc))) from None
    except Exception as exc:
        raise ModelLoadError(skew.unreadable(path.name, path, reason(exc))) from None
    trained = skew.trained_with(caught)
    skew.check(path.name, trained, on_skew)
    line, others = skew.said_once(path.name, caught)  # one line, not one per estimator
    for w in others:
        _report(path, w)
    if line:
        _report_text(path, line)
    return model, trained


@contextlib.contextmanager
def _loading(path: Path, name: str) -> Iterator[None]:
    """A model of family ``name`` loaded from ``path``: its package's absence, a native library
    it cannot load and a file it cannot read each said as such; its warnings reported."""
    package = family_named(name).package or name
    a = "an" if name[0] in "aeiou" else "a"
    try:
        __import__(package)
    except ImportError:
        raise ModelLoadError(f"{path.name} is {a} {name} model: {missing_extra(package)}") from None
    except OSError as exc:  # its native library needs one the system lacks (libgomp, say)
        raise ModelLoadError(
            f"{path.name} is {a} {name} model, and {package} cannot load its native library: "
            f"{reason(exc)}"
        ) from None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path.name}: {exc.message}") from None
    except Exception as exc:
        raise ModelLoadError(
            f"{path.name} cannot be loaded as {a} {name} model: {reason(exc)}"
        ) from None
    for w in caught:
        _report(path, w)


# ------------------------------------------------------------------------------------------------
# scikit-learn
# ------------------------------------------------------------------------------------------------


def _find_pickle(listing: Listing) -> Path | None:
    for name in PICKLES:
        if (path := listing.file(name)) is not None:
            return path
    return listing.single(".joblib") or listing.single(".pkl")


# ------------------------------------------------------------------------------------------------
# MLflow model folders
# ------------------------------------------------------------------------------------------------


def _find_mlflow(listing: Listing) -> Path | None:
    return listing.file(mlmodel.MLMODEL)


def _resolve_mlflow(path: Path) -> ModelFile:
    """The model file an MLflow folder's ``MLmodel`` names, read by its flavour's family (a
    pickle restricted as any other; a skops file as skops)."""
    flavour = mlmodel.flavour(mlmodel.read(path))
    folder = path.parent
    file = inside(folder, flavour.file, f"{mlmodel.MLMODEL}'s {flavour.name} flavour", folder.name)
    if not file.is_file():
        raise ModelLoadError(
            f"{mlmodel.MLMODEL}'s {flavour.name} flavour names {flavour.file}, which is not in "
            "the model folder"
        )
    if flavour.name == SKLEARN:
        return ModelFile(SKOPS if flavour.serialization == SKOPS else SKLEARN, file, path)
    return ModelFile(flavour.name, file, path)


# ------------------------------------------------------------------------------------------------
# skops
# ------------------------------------------------------------------------------------------------


def _find_skops(listing: Listing) -> Path | None:
    return listing.file("model.skops") or listing.single(".skops")


def _claims_skops(path: Path) -> bool:
    return path.suffix == ".skops"


def _load_skops(path: Path, trust: Trust) -> Any:
    """A skops file's estimator: the types skops trusts, those a pickle may use
    (:func:`~mmserver.execution.unpickling.allowed`) and ``trusted_types``; all for a fully
    trusted model. Any other type fails the load, named."""
    import skops.io

    try:
        data = path.read_bytes()  # read once: its types checked, then loaded
        found = skops.io.get_untrusted_types(data=data)
    except Exception as exc:
        raise ModelLoadError(f"{path.name} cannot be read as a skops file: {reason(exc)}") from None
    refused = [] if trust.full else [t for t in found if not _skops_allowed(t, trust)]
    if refused:
        raise UntrustedModel(refusal(path.name, ", ".join(refused)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = skops.io.loads(data, trusted=found)
    except Exception as exc:
        raise ModelLoadError(f"{path.name} cannot be loaded: {reason(exc)}") from None
    for w in caught:
        _report(path, w)
    if not trust.full:
        check_reads_no_files(model, path.name)
    return wrap_booster(model)


def _skops_allowed(dotted: str, trust: Trust) -> bool:
    if dotted in trust.types:
        return True
    module, _, name = dotted.rpartition(".")
    try:
        return bool(module) and allowed(module, name) is not None
    except (ImportError, AttributeError):
        return False


# ------------------------------------------------------------------------------------------------
# XGBoost
# ------------------------------------------------------------------------------------------------


def _is_xgboost_json(path: Path) -> bool:
    return path.suffix == ".json" and b'"learner"' in _head(path)


def _claims_xgboost(path: Path) -> bool:
    return path.name == "xgboost-model" or path.suffix == ".ubj" or _is_xgboost_json(path)


def _find_xgboost(listing: Listing) -> Path | None:
    for name in ("xgboost-model", "model.json", "model.ubj"):
        path = listing.file(name)
        if path is not None and (path.suffix != ".json" or _is_xgboost_json(path)):
            return path
    return listing.single(".ubj") or listing.single(".json", _is_xgboost_json)


def _load_xgboost(path: Path, trust: Trust) -> XGBoostBooster:
    with _loading(path, XGBOOST):
        import xgboost

        booster = xgboost.Booster()
        # From memory, the format (JSON, UBJSON) is read from the bytes, whatever the file's
        # name.
        booster.load_model(bytearray(path.read_bytes()))
    return XGBoostBooster(booster)


# ------------------------------------------------------------------------------------------------
# ONNX
# ------------------------------------------------------------------------------------------------


def _find_onnx(listing: Listing) -> Path | None:
    return listing.file("model.onnx") or listing.single(".onnx")


def _load_onnx(path: Path, trust: Trust) -> OnnxModel:
    with _loading(path, ONNX):
        model = open_graph(path)
    return model


def _onnx_names(est: Any) -> list[str] | None:
    return list(est.columns) if est.columns is not None else None


# ------------------------------------------------------------------------------------------------
# LightGBM
# ------------------------------------------------------------------------------------------------


def _claims_lightgbm(path: Path) -> bool:
    return _head(path).split(b"\n", 1)[0].strip() == b"tree"


def _find_lightgbm(listing: Listing) -> Path | None:
    path = listing.file("model.txt")
    if path is not None and _claims_lightgbm(path):
        return path
    return listing.single(".txt", _claims_lightgbm)


def _load_lightgbm(path: Path, trust: Trust) -> LightGBMBooster:
    with _loading(path, LIGHTGBM):
        import lightgbm

        booster = lightgbm.Booster(model_file=str(path))
    return LightGBMBooster(booster)


#: The warnings of the load under way in this thread, when its caller collects them
#: (:func:`collecting_warnings`); otherwise each is logged.
_COLLECTED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "mmserver_load_warnings", default=None
)


@contextlib.contextmanager
def collecting_warnings() -> Iterator[list[str]]:
    """Collect the warnings a model file raises while it loads (``Category: message``), instead
    of logging each: the backend sends them to the frontend with the load's answer."""
    collected: list[str] = []
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


def _report(path: Path, w: warnings.WarningMessage) -> None:
    _report_text(path, f"{w.category.__name__}: {w.message}")


def _report_text(path: Path, text: str) -> None:
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(text)
    else:
        log.warning("%s: %s", path, text)


#: Every family, in the order a model folder is searched for their files.
FAMILIES: tuple[Family, ...] = (
    Family(
        name=MLFLOW,
        engines=("MLflow",),
        wanted="an MLflow model (MLmodel) of the sklearn, xgboost or lightgbm flavour",
        find=_find_mlflow,
        claims=lambda path: path.name == mlmodel.MLMODEL,
        resolve=_resolve_mlflow,
    ),
    Family(
        name=SKOPS,
        engines=("skops",),
        wanted="model.skops or a single *.skops",
        find=_find_skops,
        claims=_claims_skops,
        load=_load_skops,
        serves_as=SKLEARN,
    ),
    Family(
        name=SKLEARN,
        engines=("Python", "sklearn"),
        wanted="model.joblib, model.pkl or a single *.joblib/*.pkl",
        find=_find_pickle,
        claims=None,
    ),
    Family(
        name=XGBOOST,
        engines=("XGBoost",),
        wanted="xgboost-model, model.json, model.ubj or a single *.ubj or XGBoost *.json",
        find=_find_xgboost,
        claims=_claims_xgboost,
        package=XGBOOST,
        load=_load_xgboost,
        owns=owns_xgboost,
        native=xgboost_native,
        treelite=xgboost_treelite,
        feature_names=xgboost_names,
        sparse_missing=True,
    ),
    Family(
        name=LIGHTGBM,
        engines=("LightGBM",),
        wanted="model.txt or a single LightGBM *.txt",
        find=_find_lightgbm,
        claims=_claims_lightgbm,
        package=LIGHTGBM,
        load=_load_lightgbm,
        owns=owns_lightgbm,
        native=lightgbm_native,
        treelite=lightgbm_treelite,
        feature_names=lightgbm_names,
        categories=lightgbm_categories,
        sparse_missing=True,
    ),
    Family(
        name=ONNX,
        engines=("OnnxRuntime", "onnx"),
        wanted="model.onnx or a single *.onnx",
        find=_find_onnx,
        claims=lambda path: path.suffix == ".onnx",
        package="onnxruntime",
        extra=ONNX,
        load=_load_onnx,
        owns=lambda est: isinstance(est, OnnxModel),
        feature_names=_onnx_names,
        kinds=lambda est: est.kinds(),
        tensors=lambda est: est.tensors(),
    ),
)
