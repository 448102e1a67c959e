"""Model families: one :class:`Family` record each, which every place that knows of a family
reads. Adding a family is one record in :data:`FAMILIES` (and its tests); its files' finder
and its own format's loader are in :mod:`mmserver.execution.formats`.

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

import functools
import logging
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
    lightgbm_categories,
    lightgbm_contributions,
    lightgbm_names,
    lightgbm_native,
    lightgbm_treelite,
    owns_lightgbm,
    owns_xgboost,
    xgboost_contributions,
    xgboost_names,
    xgboost_native,
    xgboost_treelite,
)
from mmserver.execution.boosters import LightGBMBooster as LightGBMBooster
from mmserver.execution.boosters import XGBoostBooster as XGBoostBooster
from mmserver.execution.formats import LIGHTGBM as LIGHTGBM
from mmserver.execution.formats import ONNX as ONNX
from mmserver.execution.formats import (
    ONNXRUNTIME,
    Listing,
    claims_lightgbm,
    claims_skops,
    claims_xgboost,
    find_lightgbm,
    find_onnx,
    find_pickle,
    find_skops,
    find_xgboost,
    head,
    install_hint,
    load_lightgbm,
    load_onnx,
    load_skops,
    load_xgboost,
    onnx_names,
    report,
    report_text,
)
from mmserver.execution.formats import PICKLES as PICKLES
from mmserver.execution.formats import SKLEARN as SKLEARN
from mmserver.execution.formats import SKOPS as SKOPS
from mmserver.execution.formats import XGBOOST as XGBOOST
from mmserver.execution.formats import collecting_warnings as collecting_warnings
from mmserver.execution.formats import reason as reason
from mmserver.execution.formats import wrap_booster as wrap_booster
from mmserver.execution.onnxgraph import OnnxModel
from mmserver.execution.unpickling import restricted_load

log = logging.getLogger(__name__)

MLFLOW = "mlflow"
#: The format of a pickled model's file (whatever its family).
PICKLE = "pickle"


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
    #: The booster's own exact contributions (TreeSHAP) of its margin on a batch:
    #: ``(values[row, output, column], base[row, output])``
    #: (:mod:`mmserver.execution.explainers`).
    contributions: Callable[[Any], Callable[[Any], tuple[Any, Any]]] | None = None
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
        if family.load is None or head(self.path)[:1] == b"\x80":
            return PICKLE
        return family.name


def missing_extra(package: str) -> str:
    """What to install for ``package``, the optional package of a family."""
    extra = next((f.extra for f in FAMILIES if f.package == package and f.extra), package)
    return install_hint(package, extra)


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
    model_dir: Path, config: ModelConfig, name: str | None = None, files: Listing | None = None
) -> ModelFile | None:
    """The model's file: ``option.model_file`` if given, else the first family (in the order
    of :data:`FAMILIES`, or only ``engine``'s) with a file in the folder (``files``: its files,
    if listed already). Errors name the model ``name`` (by default the folder's name)."""
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
    listing = files or Listing(model_dir)
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
        report(path, w)
    if line:
        report_text(path, line)
    return model, trained


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
        find=find_skops,
        claims=claims_skops,
        load=load_skops,
        serves_as=SKLEARN,
    ),
    Family(
        name=SKLEARN,
        engines=("Python", "sklearn"),
        wanted="model.joblib, model.pkl or a single *.joblib/*.pkl",
        find=find_pickle,
        claims=None,
    ),
    Family(
        name=XGBOOST,
        engines=("XGBoost",),
        wanted="xgboost-model, model.json, model.ubj or a single *.ubj or XGBoost *.json",
        find=find_xgboost,
        claims=claims_xgboost,
        package=XGBOOST,
        load=load_xgboost,
        owns=owns_xgboost,
        native=xgboost_native,
        treelite=xgboost_treelite,
        contributions=xgboost_contributions,
        feature_names=xgboost_names,
        sparse_missing=True,
    ),
    Family(
        name=LIGHTGBM,
        engines=("LightGBM",),
        wanted="model.txt or a single LightGBM *.txt",
        find=find_lightgbm,
        claims=claims_lightgbm,
        package=LIGHTGBM,
        load=load_lightgbm,
        owns=owns_lightgbm,
        native=lightgbm_native,
        treelite=lightgbm_treelite,
        contributions=lightgbm_contributions,
        feature_names=lightgbm_names,
        categories=lightgbm_categories,
        sparse_missing=True,
    ),
    Family(
        name=ONNX,
        engines=("OnnxRuntime", "onnx"),
        wanted="model.onnx or a single *.onnx",
        find=find_onnx,
        claims=lambda path: path.suffix == ".onnx",
        package=ONNXRUNTIME,
        extra=ONNX,
        load=load_onnx,
        owns=lambda est: isinstance(est, OnnxModel),
        feature_names=onnx_names,
        kinds=lambda est: est.kinds(),
        tensors=lambda est: est.tensors(),
    ),
)
