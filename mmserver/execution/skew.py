"""Version skew: a pickled model read by another scikit-learn than the one that made it.

scikit-learn writes its version into every estimator's pickled state (``_sklearn_version``) and
warns (``InconsistentVersionWarning``) when another version reads it back. What an estimator's
stored arrays mean can change between minor versions: a RandomForestClassifier pickled by 1.3
and read by 1.4 or later answers "probabilities" such as ``[30.8, 0.0]`` where 1.3 answered
``[1.0, 0.0]``, with no error. So a model whose recorded minor version differs from the
server's is refused by default (the server option ``on_version_skew=refuse``); with ``warn``
it is served as this version reads it, and its versions are shown; with ``env`` it is served
in an environment with the version that made it (:mod:`mmserver.envs`), found from its bytes
before it loads; one whose version could not be found there is refused.

A pickle that cannot be read at all (a module that moved, a class's layout that changed) says
nothing of its version through the warning: its bytes are searched for the recorded version
(:func:`recorded_version`, which runs nothing), so that the error names it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path

from mmserver.config.model import SKEW_CHOICES
from mmserver.errors import VersionSkew

REFUSE, WARN, ENV = SKEW_CHOICES
SKLEARN = "scikit-learn"

#: The key ``_sklearn_version`` as pickle writes it, then what may come between it and its value
#: (the end of protocol 0's text, a MEMOIZE, a PUT or BINPUT), then the value's opcode: its
#: length follows (SHORT_BINUNICODE, BINUNICODE, BINUNICODE8) or a newline ends it (UNICODE).
_RECORDED = re.compile(
    rb"_sklearn_version\n?(?:\x94|q.|r....|p\d+\n)?(\x8c.|X....|\x8d........|V)", re.DOTALL
)
_LENGTH_BYTES = {0x8C: 1, ord("X"): 4, 0x8D: 8}
_VERSION = re.compile(r"\d+\.\d+[0-9A-Za-z.+-]*\Z")
#: How much of a pickle is searched for its version (a tree's arrays come before it).
_SEARCHED_BYTES = 64 << 20


def served_versions() -> dict[str, str]:
    """The versions of the libraries this server reads models with."""
    import sklearn

    return {SKLEARN: sklearn.__version__}


def minor(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a version text (``1.3.2`` → ``(1, 3)``)."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def trained_with(caught: Iterable[warnings.WarningMessage]) -> dict[str, str]:
    """The versions that made the model, from the warnings its unpickling raised (empty: the
    version that reads it, or one that says nothing)."""
    found: dict[str, str] = {}
    for w in caught:
        original = getattr(w.message, "original_sklearn_version", None)
        if isinstance(original, str):
            found[SKLEARN] = original
    return found


def said_once(
    file: str, caught: list[warnings.WarningMessage]
) -> tuple[str, list[warnings.WarningMessage]]:
    """scikit-learn's version warnings among ``caught`` (one per estimator, a pipeline's steps
    each) as one line naming the versions and the estimators (empty when there are none), and
    the other warnings."""
    versions = [w for w in caught if hasattr(w.message, "original_sklearn_version")]
    others = [w for w in caught if w not in versions]
    if not versions:
        return "", others
    first = versions[0].message
    names = dict.fromkeys(str(getattr(w.message, "estimator_name", "?")) for w in versions)
    line = (
        f"{type(first).__name__}: {file} was pickled by {SKLEARN} "
        f"{getattr(first, 'original_sklearn_version', '?')} and is read by "
        f"{getattr(first, 'current_sklearn_version', '?')} ({len(versions)} "
        f"estimator(s): {', '.join(names)})"
    )
    return line, others


def skewed(trained: dict[str, str]) -> dict[str, tuple[str, str]]:
    """``library: (made with, served with)`` for every library whose minor version differs."""
    served = served_versions()
    return {
        library: (version, served[library])
        for library, version in trained.items()
        if library in served and minor(version) != minor(served[library])
    }


def check(file: str, trained: dict[str, str], policy: str) -> None:
    """Refuse (:class:`VersionSkew`) a model made by another minor version when ``policy``
    says so."""
    gaps = skewed(trained)
    if not gaps or policy == WARN:
        return
    library, (made, serving) = next(iter(gaps.items()))
    raise VersionSkew(
        f"{file} was pickled by {library} {made} and this server runs {library} {serving}: "
        f"a model's answers can change between minor versions (a forest's probabilities did "
        f"after 1.3). Save it again with {library} {minor_text(serving)}, or set the server "
        f"option on_version_skew=warn to serve it as {serving} reads it"
    )


def minor_text(version: str) -> str:
    return ".".join(map(str, minor(version)))


def recorded_version(path: Path) -> str | None:
    """The scikit-learn version a pickle (joblib's, compressed or not, or a plain one) records,
    read from its bytes without running any of it; ``None`` when none is found."""
    try:
        from joblib.numpy_pickle_utils import _validate_fileobject_and_memmap

        with (
            open(path, "rb") as raw,
            _validate_fileobject_and_memmap(raw, str(path), None) as (stream, _),
        ):
            if isinstance(stream, str):  # joblib's format before 0.10
                return None
            data = b""
            searched = 0
            while searched < _SEARCHED_BYTES:
                chunk = stream.read(1 << 20)
                if not chunk:
                    break
                searched += len(chunk)
                data = data[-128:] + chunk  # a version split across two chunks is found
                version = _value(data)
                if version is not None:
                    return version
    except Exception:  # an unreadable file: its own error says so
        return None
    return None


def _value(data: bytes) -> str | None:
    """The recorded version in ``data``, if its key and whole value are there."""
    for found in _RECORDED.finditer(data):
        opcode = found.group(1)
        at = found.end()
        size = _LENGTH_BYTES.get(opcode[0])
        if size is None:  # protocol 0: the text runs to the end of the line
            end = data.find(b"\n", at, at + 64)
            raw = data[at:end] if end >= 0 else b""
        else:
            length = int.from_bytes(opcode[1 : 1 + size], "little")
            raw = data[at : at + length] if length <= 64 else b""
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            continue
        if _VERSION.match(text):
            return text
    return None


def unreadable(file: str, path: Path, error: str) -> str:
    """The error of a pickle that cannot be loaded, with the version that made it when that is
    not the server's."""
    made = recorded_version(path)
    served = served_versions()[SKLEARN]
    if made is None or minor(made) == minor(served):
        return f"{file} cannot be loaded: {error}"
    return (
        f"{file} cannot be loaded: {error}. It was pickled by {SKLEARN} {made} and this server "
        f"runs {SKLEARN} {served}; save it again with {SKLEARN} {minor_text(served)}"
    )
