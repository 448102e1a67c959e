"""Model names: what a store entry may be called, and the name an entry's file gives.

A model is a folder ``NAME/`` or an archive ``NAME.tar.gz`` (or ``NAME.tgz``); ``NAME`` matches
:data:`MODEL_NAME_RE`. A model folder may instead hold numbered versions (``NAME/1/``,
``NAME/2.tar.gz``, ...): each version is known to the server by its key ``NAME/2``
(:func:`normalize_target`), which is also how SageMaker's ``TargetModel`` names it
(``NAME/2.tar.gz``). Names are checked before any file-system or network access.
"""

from __future__ import annotations

import re

from mmserver.errors import InvalidModelName

MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
#: A version number as a store entry and a request spell it: a positive whole number, no
#: leading zero.
VERSION_RE = re.compile(r"[1-9][0-9]{0,8}")
#: What stands for the ``/`` of a version's key in the names of cache folders.
_STEM_SEPARATOR = "@"


def is_model_name(base: str) -> bool:
    """Whether ``base`` is a model name: it matches :data:`MODEL_NAME_RE` and does not itself end
    with ``.tar.gz``/``.tgz`` (else ``NAME.tar.gz`` would name two models: ``NAME`` and itself)."""
    return MODEL_NAME_RE.fullmatch(base) is not None and not base.endswith(ARCHIVE_SUFFIXES)


def normalize_name(name: str) -> str:
    """The model name for ``name``: a trailing ``.tar.gz``/``.tgz`` is dropped, then the result
    must be a model name (:func:`is_model_name`). Checked before any file-system access."""
    if not isinstance(name, str):
        raise InvalidModelName(f"model name must be a string, not {type(name).__name__}")
    base = name
    for suffix in ARCHIVE_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    if not is_model_name(base):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidModelName(
            f"invalid model name {shown!r}: a name is 1 to 128 characters of letters, digits, "
            "'.', '_' and '-', starting with a letter or digit, optionally followed by one "
            ".tar.gz or .tgz"
        )
    return base


def archive_name(filename: str) -> str | None:
    """The model name of an archive file name (``NAME.tar.gz`` or ``NAME.tgz``), or ``None``."""
    for suffix in ARCHIVE_SUFFIXES:
        if filename.endswith(suffix):
            base = filename[: -len(suffix)]
            return base if is_model_name(base) else None
    return None


def normalize_target(name: str) -> str:
    """The model or version key for ``name``: ``NAME`` (:func:`normalize_name`) or, for a
    version, ``NAME/V`` (``NAME/V.tar.gz`` and ``NAME.tar.gz/V`` are the same version). Checked
    before any file-system access."""
    if isinstance(name, str) and "/" in name:
        base, _, version = name.partition("/")
        for suffix in ARCHIVE_SUFFIXES:
            if version.endswith(suffix):
                version = version[: -len(suffix)]
                break
        if VERSION_RE.fullmatch(version):
            return f"{normalize_name(base)}/{version}"
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidModelName(
            f"invalid model name {shown!r}: a model's version is NAME/N, N a positive whole "
            "number (NAME/N.tar.gz names the same version)"
        )
    return normalize_name(name)


def split_version(key: str) -> tuple[str, int | None]:
    """The model name and version of a key :func:`normalize_target` made (``None``: no
    version)."""
    base, _, version = key.partition("/")
    return base, int(version) if version else None


def version_key(name: str, version: int) -> str:
    """The key of version ``version`` of model ``name``."""
    return f"{name}/{version}"


def entry_version(filename: str) -> int | None:
    """The version an entry of a model folder stands for (``2``, ``2.tar.gz``, ``2.tgz``), or
    ``None`` when it is not a version."""
    for suffix in ARCHIVE_SUFFIXES:
        if filename.endswith(suffix):
            filename = filename[: -len(suffix)]
            break
    return int(filename) if VERSION_RE.fullmatch(filename) else None


def file_stem(key: str) -> str:
    """A file name standing for the model or version ``key`` (no ``/``), for cache folders."""
    return key.replace("/", _STEM_SEPARATOR)


def key_of_stem(stem: str) -> str:
    """The key :func:`file_stem` made ``stem`` from."""
    return stem.replace(_STEM_SEPARATOR, "/")
