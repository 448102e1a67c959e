"""Model names: what a store entry may be called, and the name an entry's file gives.

A model is a folder ``NAME/`` or an archive ``NAME.tar.gz`` (or ``NAME.tgz``); ``NAME`` matches
:data:`MODEL_NAME_RE`. Names are checked before any file-system or network access.
"""

from __future__ import annotations

import re

from mmserver.errors import InvalidModelName

MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


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
