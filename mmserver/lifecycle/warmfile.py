"""The warm set's file and its rules, as pure functions (:mod:`mmserver.lifecycle.warmset` runs
them): the models loaded, most recently used first, each with its workers and the memory it was
counted for, one model a line; a version of a model with versions under its model's name and
number::

    {"format": 1, "models": [
    {"model": "churn", "version": 2, "workers": 3, "memory_bytes": 6291456, "copy_bytes": 2097152},
    {"model": "iris", "workers": 1, "memory_bytes": 1048576, "copy_bytes": 1048576}
    ]}

A file this server did not write whole is refused whole (:func:`decode`): an allow-list of
members, model names checked as a request's are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver import errors
from mmserver.ops.statefile import write_atomically
from mmserver.store.names import normalize_name, split_version, version_key

#: The file of the warm set, in the server's ``state_dir``.
FILE_NAME = "warm.json"
#: The version of the file's layout.
FORMAT = 1
#: The members of an entry of the file.
_MEMBERS = frozenset({"model", "version", "workers", "memory_bytes", "copy_bytes"})


@dataclass(frozen=True, slots=True)
class WarmModel:
    """One loaded model as the warm set keeps it."""

    #: The model's name, or ``NAME/V`` for version ``V`` of a model with versions.
    key: str
    #: Its workers.
    workers: int
    #: The memory it was counted for (its copies), and one copy's (0: not measured).
    memory_bytes: int = 0
    copy_bytes: int = 0


class WarmFileError(ValueError):
    """The warm set's file is not one this server wrote."""


def ordered(loaded: Sequence[WarmModel], pending: Sequence[WarmModel]) -> list[WarmModel]:
    """The warm set to write: the ``loaded`` models (least recently used first, as the room
    keeps them) most recently used first, then the ``pending`` ones (entries of the file not
    restored yet, in the file's order) that are not loaded."""
    keys = {model.key for model in loaded}
    return [*reversed(loaded), *(model for model in pending if model.key not in keys)]


def signature(models: Iterable[WarmModel]) -> dict[str, int]:
    """What a change of the warm set is: a model loaded or unloaded, or its workers changed
    (not the order of use alone, which every request changes)."""
    return {model.key: model.workers for model in models}


def encode(models: Iterable[WarmModel]) -> str:
    """The file's text for ``models`` (most recently used first): one model a line."""
    lines = []
    for model in models:
        name, version = split_version(model.key)
        row: dict[str, Any] = {"model": name}
        if version is not None:
            row["version"] = version
        row["workers"] = model.workers
        row["memory_bytes"] = model.memory_bytes
        row["copy_bytes"] = model.copy_bytes
        lines.append(json.dumps(row))
    if not lines:
        return f'{{"format": {FORMAT}, "models": []}}\n'
    return f'{{"format": {FORMAT}, "models": [\n' + ",\n".join(lines) + "\n]}\n"


def decode(text: str) -> list[WarmModel]:
    """The models of the file's ``text``, most recently used first; :class:`WarmFileError`
    naming the first fault (the whole file is refused, not the entry)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WarmFileError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise WarmFileError(f'not a warm set: an object with "format": {FORMAT} is expected')
    rows = data.get("models")
    if not isinstance(rows, list):
        raise WarmFileError('"models" is not a list')
    models: list[WarmModel] = []
    seen: set[str] = set()
    for index, row in enumerate(rows, 1):
        model = _entry(index, row)
        if model.key in seen:
            raise WarmFileError(f"entry {index}: model {model.key} is listed twice")
        seen.add(model.key)
        models.append(model)
    return models


def _entry(index: int, row: object) -> WarmModel:
    where = f"entry {index}"
    if not isinstance(row, dict):
        raise WarmFileError(f"{where} is not an object")
    unknown = sorted(set(row) - _MEMBERS)
    if unknown:
        raise WarmFileError(f"{where} has unknown members: {', '.join(map(str, unknown))}")
    name = row.get("model")
    try:
        if not isinstance(name, str) or normalize_name(name) != name:
            raise WarmFileError(f"{where}: {name!r} is not a model name")
    except errors.InvalidModelName:
        raise WarmFileError(f"{where}: {name!r} is not a model name") from None
    version = row.get("version")
    key = name
    if version is not None:
        key = version_key(name, _count(where, "version", version, least=1))
    return WarmModel(
        key,
        _count(where, "workers", row.get("workers"), least=0),
        _count(where, "memory_bytes", row.get("memory_bytes", 0), least=0),
        _count(where, "copy_bytes", row.get("copy_bytes", 0), least=0),
    )


def _count(where: str, member: str, value: object, *, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise WarmFileError(f"{where}: {member} is {value!r}, not a whole number >= {least}")
    return value


def restored_workers(saved: int, min_workers: int, max_workers: int) -> int:
    """The workers a restored model starts with: as many as it had, within its
    ``minWorkers`` and ``maxWorkers`` of now."""
    return max(min_workers, min(saved, max_workers))


def progress_due(done: int, total: int) -> bool:
    """Whether the restore logs its progress after ``done`` of ``total`` models: at each tenth
    of the way (after each model when there are ten or fewer), but not after the last, which
    the line of the end tells."""
    return done < total and done * 10 // total > (done - 1) * 10 // total


def save(path: Path, models: tuple[WarmModel, ...]) -> None:
    """Encode and write ``models`` (in a thread)."""
    write_atomically(path, encode(models))


def read(path: Path) -> list[WarmModel]:
    """The models of the file at ``path`` (in a thread)."""
    return decode(path.read_text(encoding="utf-8"))
