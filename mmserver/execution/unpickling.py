"""Restricted unpickling: a model's pickle rebuilds data, never runs code of its choosing.

A pickle names the globals it needs (a class, or a function that rebuilds an object) and the
unpickler imports them. :class:`RestrictedUnpickler`, joblib's own unpickler with one more rule,
returns only the globals models are made of:

- the classes of scikit-learn, NumPy, SciPy, pandas, XGBoost and LightGBM, outside the modules
  that read or write files, evaluate expressions or test (:data:`_CLOSED_MODULES`), and the
  classes of those that read files when called (:data:`_NOT_CALLED`) are only rebuilt, never
  called;
- NumPy's universal functions (``numpy.log1p`` in a FunctionTransformer): arithmetic only;
- the functions that rebuild those objects (:data:`REBUILDERS`: ``numpy``'s ``_reconstruct``,
  pandas' ``_new_Index``, Cython's ``__pyx_unpickle_*`` of those packages...);
- the plain data types of the standard library (:data:`_PLAIN`);
- what the operator's ``trusted_types`` adds.

Anything else (``posix.system``, ``builtins.eval``, ``numpy.load``, ``fractions.Fraction``) fails
the load with :class:`~mmserver.errors.UntrustedModel` naming it, before it is imported or
called. A model that ``trusted_models`` names loads with joblib as it is.

joblib 1.6 reads an array of objects with a second unpickler that keeps the first's
``find_class``: the rule holds inside those arrays too.
"""

from __future__ import annotations

import _compat_pickle
import copyreg
import functools
import importlib
import pickle
import sys
from pathlib import Path
from typing import Any

from joblib.numpy_pickle import NumpyUnpickler
from joblib.numpy_pickle_utils import _validate_fileobject_and_memmap

from mmserver.config.trust import Trust
from mmserver.errors import UntrustedModel

#: The packages whose classes a model may be made of.
PACKAGES = frozenset({"sklearn", "numpy", "scipy", "pandas", "xgboost", "lightgbm"})

#: Modules of those packages whose classes read or write files, evaluate expressions, run
#: processes or test: none of them is a model's part.
_CLOSED_MODULES = (
    "numpy.lib.npyio",
    "numpy.lib._npyio_impl",
    "numpy.lib._datasource",
    "numpy.lib.format",
    "numpy.lib._format_impl",
    "numpy.core.memmap",
    "numpy._core.memmap",
    "numpy.testing",
    "numpy.f2py",
    "numpy.distutils",
    "numpy.ctypeslib",
    "numpy._pytesttester",
    "scipy.io",
    "scipy._lib._testutils",
    "scipy.datasets",
    "pandas.io",
    "pandas.core.computation",
    "pandas.testing",
    "pandas._testing",
    "pandas.util._tester",
    "pandas.plotting",
    "sklearn.datasets",
    "sklearn.utils._testing",
    "sklearn.utils._show_versions",
    "sklearn.externals",
    "xgboost.tracker",
    "xgboost.collective",
    "xgboost.dask",
    "xgboost.spark",
    "xgboost.testing",
    "xgboost.callback",
    "xgboost.plotting",
    "lightgbm.dask",
    "lightgbm.callback",
    "lightgbm.plotting",
)

#: Packages whose classes a pickle may rebuild (``__new__`` and their state) but not call: their
#: boosters and matrices, called, read the file their arguments name.
_NOT_CALLED = frozenset({"xgboost", "lightgbm"})

#: Classes of those packages that read or write files, whatever module they say they are of.
_CLOSED_CLASSES = frozenset({"numpy.memmap", "numpy.DataSource", "numpy.lib.npyio.DataSource"})

#: Functions that rebuild the objects of those packages from their pickled state.
REBUILDERS = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.core.numeric._frombuffer",
        "numpy._core.numeric._frombuffer",
        "numpy.random._pickle.__randomstate_ctor",
        "numpy.random._pickle.__generator_ctor",
        "numpy.random._pickle.__bit_generator_ctor",
        "numpy.ma.core._mareconstruct",
        "pandas.core.indexes.base._new_Index",
        "pandas.core.indexes.datetimes._new_DatetimeIndex",
        "pandas.core.indexes.period._new_PeriodIndex",
        "pandas.core.internals.blocks.new_block",
        "pandas.core.internals.blocks.maybe_coerce_values",
        "pandas._libs.internals._unpickle_block",
        "pandas._libs.tslibs.timestamps._unpickle_timestamp",
        "pandas._libs.tslibs.timedeltas._timedelta_unpickle",
        "pandas._libs.tslibs.nattype.__nat_unpickle",
        "pandas._libs.tslibs.offsets._unpickle",
        "pandas.core.arrays.sparse.array._unpickle_sparse",
        "pandas._libs.sparse.__pyx_unpickle_IntIndex",
        "pandas._libs.sparse.__pyx_unpickle_BlockIndex",
        "joblib.numpy_pickle.NumpyArrayWrapper",
        "copyreg._reconstructor",
        "_codecs.encode",
    }
)

#: Functions of those packages that models keep as parts (a histogram gradient boosting's
#: categorical preprocessing calls ``check_array``): they compute, and touch nothing else.
_PARTS = frozenset({"sklearn.utils.validation.check_array"})

#: The standard library's plain data types.
_PLAIN = frozenset(
    {
        "builtins.object",
        "builtins.set",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.range",
        "builtins.complex",
        "builtins.bytearray",
        "builtins.int",
        "builtins.float",
        "builtins.bool",
        "builtins.str",
        "builtins.bytes",
        "builtins.list",
        "builtins.tuple",
        "builtins.dict",
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.Counter",
        "datetime.datetime",
        "datetime.date",
        "datetime.time",
        "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal",
        "functools.partial",
    }
)

#: copyreg's rebuilder of objects pickled by protocols 0 and 1 (not in its typed interface).
_RECONSTRUCTOR: Any = copyreg.__dict__["_reconstructor"]

#: numpy 1.x pickles a universal function as ``_ufunc_reconstruct(module, name)``, which would
#: return any module's attribute: it is given one that returns universal functions only.
_UFUNC_REBUILDERS = frozenset({"numpy.core._ufunc_reconstruct", "numpy._core._ufunc_reconstruct"})


def restricted_load(path: Path, trust: Trust) -> Any:
    """The object in the joblib (or plain) pickle at ``path``, rebuilt only from what ``trust``
    allows (:class:`~mmserver.errors.UntrustedModel` naming the first global it does not)."""
    filename = str(path)
    with open(filename, "rb") as raw:
        with _validate_fileobject_and_memmap(raw, filename, None) as (fobj, _):
            if isinstance(fobj, str):  # joblib's format before 0.10: files beside the pickle
                raise UntrustedModel(
                    f"{path.name} was written by joblib before 0.10 (arrays in files of their "
                    "own), which mmserver loads only for a model trusted_models names; save it "
                    "again with a current joblib"
                )
            unpickler = RestrictedUnpickler(filename, fobj, True, trust=trust, file=path.name)
            model = unpickler.load()
    if unpickler.vectorizers:
        check_reads_no_files(model, path.name)
    return model


class RestrictedUnpickler(NumpyUnpickler):  # type: ignore[misc]  # joblib is untyped
    """joblib's unpickler whose ``find_class`` returns only what :func:`allowed` allows, and
    which calls no class that reads files (:data:`_NOT_CALLED`)."""

    dispatch = NumpyUnpickler.dispatch.copy()

    def __init__(self, *args: Any, trust: Trust, file: str) -> None:
        super().__init__(*args)
        self._trust = trust
        self._file = file
        #: Whether a text vectorizer's class was rebuilt (:func:`check_reads_no_files`).
        self.vectorizers = False

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # Python 2's names, as pickle maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        found = allowed(module, name, self._trust.types)
        if found is None:
            raise UntrustedModel(refusal(self._file, f"{module}.{name}"))
        if found is _ufuncs_only:
            return functools.partial(_ufuncs_only, file=self._file)
        if found is _RECONSTRUCTOR:
            return self._reconstructor
        if isinstance(found, type) and hasattr(found, "build_analyzer"):
            self.vectorizers = True
        return found

    def _reconstructor(self, cls: Any, base: Any, state: Any) -> Any:
        """``copyreg._reconstructor``, which calls ``base`` on ``state`` (a class of
        :data:`_NOT_CALLED` may not be)."""
        if base is not object:
            self._check_call(base)
        return _RECONSTRUCTOR(cls, base, state)

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        self._check_call(func)
        stack[-1] = func(*args)

    dispatch[pickle.REDUCE[0]] = load_reduce

    def _instantiate(self, klass: Any, args: Any) -> None:  # protocol 0 and 1's INST and OBJ
        self._check_call(klass)
        super()._instantiate(klass, args)

    def _check_call(self, func: Any) -> None:
        if self._trust.full or not isinstance(func, type):
            return
        if func.__module__.partition(".")[0] in _NOT_CALLED and _qualified(func) not in (
            self._trust.types
        ):
            raise UntrustedModel(
                f"{self._file} calls {_qualified(func)}, which may read a file its arguments "
                "name; a model's pickle may only rebuild one from its saved state"
            )


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_reads_no_files(model: Any, file: str) -> None:
    """:class:`~mmserver.errors.UntrustedModel` if a restricted model would read files its
    requests name: a text vectorizer saved with ``input="filename"`` (or ``"file"``) opens each
    document as a path. Library code, doing what the file's parameters say."""
    try:
        parts = [model, *model.get_params(deep=True).values()]
    except Exception:  # not an estimator, or one whose parameters cannot be read
        parts = [model]
    for part in parts:
        reads = getattr(part, "input", None)
        if reads in ("filename", "file") and callable(getattr(part, "build_analyzer", None)):
            raise UntrustedModel(
                f"{file} holds a {type(part).__name__} with input={reads!r}, which opens the "
                "files its requests name; it loads only for a model trusted_models names"
            )


def refusal(file: str, names: str) -> str:
    """What a load refused for ``names`` (importable names, comma-separated) says: the names,
    and how to trust them."""
    return (
        f"{file} needs {names}, which a model's file may not load: a pickle or skops file "
        "may rebuild the objects scikit-learn, NumPy, SciPy, pandas, XGBoost and LightGBM "
        "models are made of, not run other code. If you trust it, add it to the server's "
        f"trusted_types option (trusted_types={names.replace(', ', ',')}), or trust this "
        "model's files with trusted_models=NAME"
    )


def allowed(module: str, name: str, extra: frozenset[str] = frozenset()) -> Any:
    """The global ``module.name`` if a model's pickle may use it, else ``None``; nothing is
    imported unless the name is one that may be. What is decided of a name is kept; the name
    is imported again each time (from ``sys.modules``: a package gone is said as such)."""
    if f"{module}.{name}" in extra:
        return _import(module, name)
    kind = _kind(module, name)
    if kind is None:
        return None
    if kind == _UFUNC_REBUILDER:
        return _ufuncs_only
    return _import(module, name)


#: What :func:`_kind` says of numpy 1.x's ``_ufunc_reconstruct``.
_UFUNC_REBUILDER = "ufunc rebuilder"


@functools.cache
def _kind(module: str, name: str) -> str | None:
    """Why a model's pickle may use ``module.name`` (``None``: it may not)."""
    dotted = f"{module}.{name}"
    if dotted in REBUILDERS or dotted in _PLAIN or dotted in _PARTS:
        return "listed"
    if dotted in _UFUNC_REBUILDERS:
        return _UFUNC_REBUILDER
    top = module.partition(".")[0]
    if top not in PACKAGES or _closed(module):
        return None
    if "." not in name and (name.startswith("__pyx_unpickle_") or name == "newObj"):
        return "rebuilder"  # Cython's rebuilders: a class's __new__, and its state
    found = _import(module, name)
    import numpy as np

    if isinstance(found, type):
        origin = getattr(found, "__module__", "") or ""
        if (
            origin.partition(".")[0] in PACKAGES
            and not _closed(origin)
            and dotted not in _CLOSED_CLASSES
            and _qualified(found) not in _CLOSED_CLASSES
            and not issubclass(found, np.memmap)
        ):
            return "class"
        return None
    return "ufunc" if isinstance(found, np.ufunc) else None


def _closed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _CLOSED_MODULES)


def _import(module: str, name: str) -> Any:
    # An imported module is taken from sys.modules (import_module costs as much as the rest
    # of a global's lookup); a module not imported yet, or gone (None), is imported.
    found: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def _ufuncs_only(module: str, name: str, file: str = "the pickle") -> Any:
    import numpy as np

    found = allowed(module, name)
    if not isinstance(found, np.ufunc):
        raise UntrustedModel(refusal(file, f"{module}.{name}"))
    return found
