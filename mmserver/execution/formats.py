"""Each family's files: how a model folder's file of the family is found and claimed, how its
own format is loaded, and what every load shares (the folder listed once, a file's head, the
optional package's absence said as such, the warnings a load raises collected). The
:class:`~mmserver.execution.families.Family` records of :mod:`mmserver.execution.families`
name these functions. Runs inside the backend processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mmserver.config.trust import Trust
from mmserver.errors import ModelLoadError, UntrustedModel
from mmserver.execution.boosters import LightGBMBooster, XGBoostBooster
from mmserver.execution.onnxgraph import OnnxModel, open_graph
from mmserver.execution.unpickling import allowed, check_reads_no_files, refusal

log = logging.getLogger("mmserver.execution.families")

SKLEARN, XGBOOST, LIGHTGBM, ONNX, SKOPS = "sklearn", "xgboost", "lightgbm", "onnx", "skops"
ONNXRUNTIME = "onnxruntime"
PICKLES = ("model.joblib", "model.pkl")
_HEAD = 4096


def install_hint(package: str, extra: str) -> str:
    """What to install for ``package``, the optional package the ``extra`` installs."""
    return (
        f"the {package} package is not installed; install it with "
        f"pip install 'mmserver[{extra}]' (or pip install {package})"
    )


def reason(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def head(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(_HEAD)
    except OSError:
        return b""


class Listing:
    """The files of a model folder, listed once for a whole load: every family's finder, the
    custom handler, the declared schema and the background sample look in it (one directory
    read, not a file-system call for each file a load looks for)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        #: Whether the folder could be read (``False``: it does not exist, or is no folder).
        self.exists = True
        try:
            with os.scandir(folder) as entries:
                self.names = sorted(e.name for e in entries if e.is_file())
        except OSError:
            self.exists = False
            self.names = []

    def file(self, name: str) -> Path | None:
        """The file ``name`` of the folder, if it has one."""
        return self.folder / name if name in self.names else None

    def has(self, relative: str) -> bool:
        """Whether the folder holds the file at ``relative`` (a name, or a path inside it)."""
        if "/" not in relative:
            return relative in self.names
        return (self.folder / relative).is_file()

    def single(self, suffix: str, claims: Callable[[Path], bool] | None = None) -> Path | None:
        """The folder's only file ending in ``suffix`` (that ``claims`` takes, if given)."""
        found = [self.folder / n for n in self.names if n.endswith(suffix)]
        if claims is not None:
            found = [path for path in found if claims(path)]
        return found[0] if len(found) == 1 else None


def _module_of(estimator: Any) -> str:
    return type(estimator).__module__.split(".")[0]


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


@contextlib.contextmanager
def _loading(path: Path, name: str, package: str, extra: str) -> Iterator[None]:
    """A model of family ``name`` (whose ``package`` the ``extra`` installs) loaded from
    ``path``: its package's absence, a native library it cannot load and a file it cannot read
    each said as such; its warnings reported."""
    a = "an" if name[0] in "aeiou" else "a"
    try:
        __import__(package)
    except ImportError:
        raise ModelLoadError(
            f"{path.name} is {a} {name} model: {install_hint(package, extra)}"
        ) from None
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
        report(path, w)


# ------------------------------------------------------------------------------------------------
# scikit-learn
# ------------------------------------------------------------------------------------------------


def find_pickle(listing: Listing) -> Path | None:
    for name in PICKLES:
        if (path := listing.file(name)) is not None:
            return path
    return listing.single(".joblib") or listing.single(".pkl")


# ------------------------------------------------------------------------------------------------
# skops
# ------------------------------------------------------------------------------------------------


def find_skops(listing: Listing) -> Path | None:
    return listing.file("model.skops") or listing.single(".skops")


def claims_skops(path: Path) -> bool:
    return path.suffix == ".skops"


def load_skops(path: Path, trust: Trust) -> Any:
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
        report(path, w)
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


def is_xgboost_json(path: Path) -> bool:
    return path.suffix == ".json" and b'"learner"' in head(path)


def claims_xgboost(path: Path) -> bool:
    return path.name == "xgboost-model" or path.suffix == ".ubj" or is_xgboost_json(path)


def find_xgboost(listing: Listing) -> Path | None:
    for name in ("xgboost-model", "model.json", "model.ubj"):
        path = listing.file(name)
        if path is not None and (path.suffix != ".json" or is_xgboost_json(path)):
            return path
    return listing.single(".ubj") or listing.single(".json", is_xgboost_json)


def load_xgboost(path: Path, trust: Trust) -> XGBoostBooster:
    with _loading(path, XGBOOST, XGBOOST, XGBOOST):
        import xgboost

        booster = xgboost.Booster()
        # From memory, the format (JSON, UBJSON) is read from the bytes, whatever the file's
        # name.
        booster.load_model(bytearray(path.read_bytes()))
    return XGBoostBooster(booster)


# ------------------------------------------------------------------------------------------------
# ONNX
# ------------------------------------------------------------------------------------------------


def find_onnx(listing: Listing) -> Path | None:
    return listing.file("model.onnx") or listing.single(".onnx")


def load_onnx(path: Path, trust: Trust) -> OnnxModel:
    with _loading(path, ONNX, ONNXRUNTIME, ONNX):
        model = open_graph(path)
    return model


def onnx_names(est: Any) -> list[str] | None:
    return list(est.columns) if est.columns is not None else None


# ------------------------------------------------------------------------------------------------
# LightGBM
# ------------------------------------------------------------------------------------------------


def claims_lightgbm(path: Path) -> bool:
    return head(path).split(b"\n", 1)[0].strip() == b"tree"


def find_lightgbm(listing: Listing) -> Path | None:
    path = listing.file("model.txt")
    if path is not None and claims_lightgbm(path):
        return path
    return listing.single(".txt", claims_lightgbm)


def load_lightgbm(path: Path, trust: Trust) -> LightGBMBooster:
    with _loading(path, LIGHTGBM, LIGHTGBM, LIGHTGBM):
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


def report(path: Path, w: warnings.WarningMessage) -> None:
    report_text(path, f"{w.category.__name__}: {w.message}")


def report_text(path: Path, text: str) -> None:
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(text)
    else:
        log.warning("%s: %s", path, text)
