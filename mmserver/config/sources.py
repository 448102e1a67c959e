"""Where the server's options come from, lowest first: their defaults, ``--config FILE`` (a
properties file), the ``MMSERVER_*`` environment, the command-line flags.

:func:`read_sources` reads the three and converts each value to its option's type;
:meth:`ServerConfig.build <mmserver.config.server.ServerConfig.build>` makes the configuration
from what it found, which validates it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.errors import ConfigError
from mmserver.store.properties import boolean, read_properties

#: The prefix of the environment variables that set options (``MMSERVER_MAX_WORKERS``).
ENV_PREFIX = "MMSERVER_"


@dataclass
class Found:
    """The options' values found, and what was not an option: (refused unless
    ``unknown_options=warn``, the message)."""

    values: dict[str, Any] = field(default_factory=dict)
    unknown: list[tuple[bool, str]] = field(default_factory=list)


def read_sources(
    fields: Iterable[dataclasses.Field[Any]],
    *,
    config_file: str | os.PathLike[str] | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any],
) -> Found:
    """The values of ``fields`` set by the file, the environment and the flags, each over the
    one before."""
    known = {f.name: f for f in fields}
    found = Found()
    if config_file is not None:
        path = Path(config_file)
        for key, raw in read_properties(path).items():
            if key not in known:
                close = _closest(key, known)
                found.unknown.append((True, f"config {path}: unknown option {key!r}{close}"))
                continue
            found.values[key] = _convert(known[key], raw, f"config file {path}, key {key}")
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in known:
            found.values[name] = _convert(known[name], raw, f"environment {key}")
        else:
            # Other programs may have MMSERVER_* variables of their own: only one that is close
            # to an option's name is taken for a mistake.
            close = _closest(name, known, ENV_PREFIX)
            found.unknown.append((bool(close), f"environment {key}: not an option{close}"))
    for name, value in flags.items():
        if value is None:
            continue
        if name not in known:
            raise ConfigError(f"unknown option {name!r}")
        found.values[name] = (
            _convert(known[name], value, f"option --{name.replace('_', '-')}")
            if isinstance(value, str)
            else value
        )
    return found


def _closest(name: str, names: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean X?"`` for the option whose name is closest to ``name`` (spelled with
    ``prefix`` and in upper case for an environment variable), or ``""`` when none is close."""
    match = difflib.get_close_matches(name.lower(), list(names), n=1, cutoff=0.75)
    if not match:
        return ""
    spelled = prefix + match[0].upper() if prefix else match[0]
    return f"; did you mean {spelled}?"


def _convert(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    kind: type[Any] = type(f.default)
    text = raw.strip()
    try:
        if kind is bool:
            if not text:
                return False  # an empty value (MMSERVER_X=) is false
            value = boolean(text)
            if value is None:
                raise ValueError(text)
            return value
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: value {raw!r} is not a valid {kind.__name__}") from None
    return text
