"""URLs naming models and stores: the ``s3://bucket/prefix`` of an object store, and the model
URLs of the management API (``POST /models?url=...``), which name local paths only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mmserver.errors import ConfigError, Forbidden, InvalidInput, ModelNotFound
from mmserver.store.names import ARCHIVE_SUFFIXES

_OBJECT_URL = re.compile(r"s3://([^/]*)(?:/(.*))?", re.IGNORECASE | re.DOTALL)
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def split_object_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as ``(bucket, prefix)``; the prefix is empty or ends with ``/``.
    Raises :class:`ConfigError`."""
    match = _OBJECT_URL.fullmatch(url.strip())
    if match is None:
        raise ConfigError(f"model store {url!r} is not an s3://bucket/prefix URL")
    bucket, prefix = match.group(1), (match.group(2) or "").rstrip("/")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(f"model store {url!r}: {bucket!r} is not a valid bucket name")
    if "\x00" in prefix:
        raise ConfigError(f"model store {url!r}: the prefix holds a NUL character")
    return bucket, prefix + "/" if prefix else ""


def check_location(text: str) -> None:
    """Check that ``text`` names a place answers can be written to: empty (the default), an
    ``s3://bucket/prefix`` URL, a ``file://`` URL or a local path. Raises :class:`ConfigError`."""
    text = text.strip()
    scheme = _SCHEME.match(text)
    if not text or scheme is None or len(scheme.group(1)) == 1:  # C: is a drive, not a scheme
        return
    kind = scheme.group(1).lower()
    if kind == "s3":
        split_object_url(text)
    elif kind != "file":
        raise ConfigError(f"{text!r}: only a local folder or s3://bucket/prefix is supported")


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")

#: The extensions DJL Serving drops from an archive's name to name its model, in the order it
#: tries them (``ai.djl.repository.FilenameUtils.getNamePart``; only ``.tar.gz`` in any case).
_DJL_EXTENSIONS = (".tar.z", ".tgz", ".zip", ".tar", ".mar", ".gz", ".z")
_NON_WORD = re.compile(r"\W", re.ASCII)


def name_from_url(url: str) -> str:
    """The name DJL Serving gives a model registered from ``url`` without ``model_name``
    (``ModelInfo.inferModelNameFromUrl``): the last segment of the url's path, less its archive
    extension unless the url ends with ``/``, with each character that is not an ASCII letter,
    digit or ``_`` replaced by ``_`` (``my-model.tar.gz`` names ``my_model``)."""
    path = unquote(urlsplit(url.strip()).path)
    directory = path.endswith("/")
    name = path.rstrip("/").rpartition("/")[2] if directory else path.rpartition("/")[2]
    if not directory:
        if name.lower().endswith(".tar.gz"):
            name = name[: -len(".tar.gz")]
        else:
            for extension in _DJL_EXTENSIONS:
                if name.endswith(extension):
                    name = name[: -len(extension)]
                    break
    return _NON_WORD.sub("_", name)


def resolve_model_url(url: str, allowed_roots: Sequence[Path]) -> Path:
    """The local path named by ``url`` (a path or a ``file://`` URL; relative paths are taken
    from the first root), which must be a folder or a ``.tar.gz``/``.tgz`` inside one of
    ``allowed_roots`` once symbolic links are resolved. No other scheme is accepted."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput("model url is empty: give a local path under the allowed model roots")
    if not allowed_roots:
        raise Forbidden("no model roots are allowed on this server")
    url = url.strip()
    scheme = _SCHEME.match(url)
    if scheme is not None:
        if scheme.group(1).lower() != "file":
            raise InvalidInput(
                f"model url {url!r}: scheme {scheme.group(1)!r} is not supported; only local "
                "paths under the allowed model roots are accepted"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidInput(
                f"model url {url!r}: only local paths under the allowed model roots are accepted"
            )
        raw = unquote(parts.path)
    else:
        raw = url
    if "\x00" in raw:
        raise InvalidInput(f"model url {url!r} is not a valid path")
    roots = [Path(r).resolve() for r in allowed_roots]
    path = Path(raw)
    if not path.is_absolute():
        path = roots[0] / path
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        raise Forbidden(
            f"model url {url!r} is outside the allowed model roots "
            f"({', '.join(str(r) for r in roots)}); put the model there or add its directory "
            "to allowed_model_roots"
        )
    if resolved in roots:
        raise InvalidInput(f"model url {url!r} names a model root itself, not a model in it")
    if not resolved.exists():
        raise ModelNotFound(f"model url {url!r}: {resolved} does not exist")
    if resolved.is_dir():
        return resolved
    if resolved.is_file() and resolved.name.endswith(ARCHIVE_SUFFIXES):
        return resolved
    raise InvalidInput(
        f"model url {url!r}: {resolved} must be a directory or a .tar.gz/.tgz archive"
    )
