"""How far a model's files are trusted, decided by the operator, never by the model's folder.

Two server options say it:

- ``trusted_types``: importable names (``module.Name``, comma-separated) that every model's
  pickle or skops file may use beside the types models are made of;
- ``trusted_models``: glob patterns of model names whose files are fully trusted: any global in
  their pickles, and a ``model.py`` custom handler. ``*`` trusts every model (a store only its
  operator writes); by default no model is.

A model's :class:`Trust` rides in its :class:`~mmserver.config.model.ModelConfig` (a field no
``serving.properties`` key sets) to the backend process that loads it.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace

from mmserver.errors import ConfigError

#: An importable name: dotted identifiers, at least a module and a name.
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
#: What a model name pattern may hold: a model name's characters and glob's ``*?[]!``.
_PATTERN = re.compile(r"[A-Za-z0-9_.*?\[\]!/-]+")


@dataclass(frozen=True, slots=True)
class Trust:
    """What one model's files may do when they load."""

    #: The model's files are fully trusted: any pickle global, a custom handler.
    full: bool = False
    #: Extra importable names its pickles and skops files may use (``trusted_types``).
    types: frozenset[str] = frozenset()
    #: The ``trusted_models`` patterns, to tell the other models by name (and for messages).
    models: tuple[str, ...] = ()
    #: Why the model is fully trusted (``trusted_models=PATTERN``, a management call), or "".
    because: str = ""
    #: A fully trusted model runs in a backend process of its own (``isolate_trusted``).
    isolated: bool = True

    def of(self, name: str) -> Trust:
        """This trust for the model ``name``: full if a ``trusted_models`` pattern matches its
        name (a version's name is its model's: ``NAME/2`` is ``NAME``)."""
        if self.full:
            return self
        pattern = matching(self.models, name)
        if pattern is not None:
            return replace(self, full=True, because=f"trusted_models={pattern}")
        return self

    def granted(self, because: str) -> Trust:
        """Full trust, given by the operator (``because`` says how)."""
        return replace(self, full=True, because=because)

    @property
    def named(self) -> str:
        """Which models the operator trusts, for a refusal's message."""
        patterns = self.models
        return f"now trusted_models={','.join(patterns)}" if patterns else "now none is trusted"

    @property
    def own_process(self) -> bool:
        """Whether the model's code must run in a backend process no other model shares."""
        return self.full and self.isolated

    @property
    def level(self) -> str:
        """``trusted`` or ``restricted``, as the model's description says it."""
        return "trusted" if self.full else "restricted"


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def model_patterns(option: str, text: str) -> tuple[str, ...]:
    """The glob patterns of model names of ``option``'s comma-separated value (each checked:
    :class:`ConfigError` naming the option and the item it cannot take)."""
    return tuple(
        _checked(
            option,
            text,
            _PATTERN,
            "a model name or a glob pattern of model names (letters, digits, _ . - / and * ? [ ])",
        )
    )


def matching(patterns: tuple[str, ...], name: str) -> str | None:
    """The first of ``patterns`` that matches model ``name`` (a version's name is its model's:
    ``NAME/2`` is ``NAME``), or ``None``."""
    base = name.split("/", 1)[0]
    for pattern in patterns:
        if fnmatch.fnmatchcase(base, pattern) or fnmatch.fnmatchcase(name, pattern):
            return pattern
    return None


def server_trust(trusted_types: str, trusted_models: str, isolated: bool = True) -> Trust:
    """Every model's trust from the server's two options (each checked: :class:`ConfigError`
    naming the option and the value it cannot take)."""
    types = _checked(
        "trusted_types",
        trusted_types,
        _DOTTED,
        "an importable name (module.Name, e.g. fractions.Fraction)",
    )
    models = model_patterns("trusted_models", trusted_models)
    return Trust(types=frozenset(types), models=models, isolated=isolated)


def _checked(option: str, text: str, form: re.Pattern[str], what: str) -> list[str]:
    """The comma-separated items of ``option``'s value, each of ``form`` (else a
    :class:`ConfigError` saying it is not ``what``)."""
    items = split_list(text)
    for item in items:
        if not form.fullmatch(item):
            raise ConfigError(f"option {option}: {item!r} is not {what}")
    return items
