"""The requirement set a model folder asks for, and whether the server's environment meets it.

A model's set comes from ``requirements.txt`` in its folder, or from an MLflow folder's
``python_env.yaml`` (its ``dependencies``, ``-r requirements.txt`` read from the folder).
Lines are parsed as PEP 508 requirements (``packaging``), comments and blank lines dropped;
options (``-r`` of another file, ``--index-url``...) are refused: the index is the server's.
MLflow's own packages (``mlflow``, ``mlflow-skinny``) are left out: the server reads the
flavour's model file itself and never imports MLflow.

A set is normalized (each requirement's canonical name, extras, specifier and marker, sorted,
each once), so two folders asking for the same versions in another order or spelling share one
environment; its key hashes the set and the Python version (``major.minor``) it is built for.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from mmserver.errors import ModelLoadError

REQUIREMENTS_FILE = "requirements.txt"
PYTHON_ENV_FILE = "python_env.yaml"
#: Requirements a model's set never needs here: the server loads MLflow's flavours itself.
LEFT_OUT = frozenset({"mlflow", "mlflow-skinny"})
#: What every environment has besides the model's set: the backend side of mmserver needs them
#: (joblib 1.6 reads an array of objects through the restricted unpickler's rules).
BASE = ("numpy", "joblib>=1.6")


@dataclass(frozen=True)
class RequirementSet:
    """A normalized requirement set (:func:`normalize`) and the Python it is for."""

    requirements: tuple[str, ...]
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    #: Whether the operator asked for the set (``on_version_skew=env``'s pins), not the model's
    #: files: a set a model's files ask for is installed only for a model the operator trusts.
    operator: bool = field(default=False, compare=False)

    @property
    def key(self) -> str:
        """The environment's id: 16 hex digits of the set's and Python version's hash."""
        text = "\n".join((f"python {self.python}", *self.requirements))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def text(self) -> str:
        """The set as a requirements file."""
        return "".join(f"{line}\n" for line in self.requirements)


def parse(text: str, where: str) -> list[Requirement]:
    """The requirements of a requirements file's ``text``; :class:`ModelLoadError` naming
    ``where`` and the line for one that is not a requirement."""
    found: list[Requirement] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ModelLoadError(
                f"{where}, line {number}: {line!r}: options are not taken (the packages come "
                "from the server's package index); list the requirements themselves"
            )
        try:
            found.append(Requirement(line))
        except InvalidRequirement as exc:
            raise ModelLoadError(f"{where}, line {number}: {line!r}: {exc}") from None
    return found


def normalize(requirements: list[Requirement]) -> tuple[str, ...]:
    """The set, sorted and each once, names canonical, MLflow's own packages left out."""
    lines: dict[str, None] = {}
    for req in requirements:
        name = canonicalize_name(req.name)
        if name in LEFT_OUT:
            continue
        req.name = name
        lines[str(req)] = None
    return tuple(sorted(lines))


def read_folder(folder: Path) -> RequirementSet | None:
    """The set the model folder asks for; ``None`` when it asks for none."""
    path = folder / REQUIREMENTS_FILE
    python_env = folder / PYTHON_ENV_FILE
    found: list[Requirement] = []
    if python_env.is_file():
        found = _python_env(python_env, folder)
    elif path.is_file():
        found = parse(_read(path), REQUIREMENTS_FILE)
    else:
        return None
    normalized = normalize(found)
    return RequirementSet(normalized) if normalized else None


def _python_env(path: Path, folder: Path) -> list[Requirement]:
    import yaml

    try:
        data = yaml.safe_load(_read(path)) or {}
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{PYTHON_ENV_FILE} cannot be read: {exc}") from None
    dependencies = data.get("dependencies") if isinstance(data, dict) else None
    if dependencies is None:
        requirements = folder / REQUIREMENTS_FILE
        return parse(_read(requirements), REQUIREMENTS_FILE) if requirements.is_file() else []
    if not isinstance(dependencies, list):
        raise ModelLoadError(f"{PYTHON_ENV_FILE}: dependencies must be a list")
    found: list[Requirement] = []
    for item in dependencies:
        text = str(item).strip()
        if text.startswith("-r"):
            name = text[2:].strip()
            target = (folder / name).resolve()
            if target.parent != folder.resolve() or not target.is_file():
                raise ModelLoadError(f"{PYTHON_ENV_FILE}: {text!r}: not a file of the folder")
            found += parse(_read(target), name)
        else:
            found += parse(text, PYTHON_ENV_FILE)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path.name} cannot be read: {type(exc).__name__}: {exc}") from None


def unmet(requirements: tuple[str, ...]) -> list[str]:
    """The requirements the server's own environment does not satisfy (its installed
    distributions' versions checked against each specifier; a requirement whose marker does
    not apply here is met)."""
    missing: list[str] = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(line)
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(line)
    return missing


def pinned_for_skew(sklearn_version: str) -> RequirementSet:
    """The set of a pickle made by scikit-learn ``sklearn_version`` that brings no
    requirements of its own (``on_version_skew=env``): that version, and NumPy 1 for a
    scikit-learn built before NumPy 2 (before 1.4.2), whose compiled parts cannot run on it."""
    lines = [f"scikit-learn=={sklearn_version}"]
    try:
        from packaging.version import Version

        if Version(sklearn_version) < Version("1.4.2"):
            lines.append("numpy<2")
    except ValueError:
        pass
    return RequirementSet(normalize([Requirement(line) for line in lines]), operator=True)
