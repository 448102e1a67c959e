"""The options of per-model environments (:mod:`mmserver.envs`), declared once here and part of
the server's options (:class:`~mmserver.config.server.ServerConfig` derives from
:class:`EnvOptions`: the same flags, ``MMSERVER_*`` variables and ``--config`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.envs.building import find_uv
from mmserver.errors import ConfigError

#: The choices of ``env_installer``.
INSTALLERS = ("auto", "uv", "pip")


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EnvOptions:
    """Where model environments are built, and their limits."""

    env_dir: str = _opt(
        "",
        "Where the environments of models with a requirements.txt are built (one per distinct "
        "requirement set and Python version); empty = .mmserver-envs beside cache_dir.",
    )
    env_build_timeout_s: float = _opt(
        600.0, "s an environment's build may take; past it the build is stopped and fails."
    )
    env_retry_s: float = _opt(
        300.0,
        "s a requirement set that failed to install is answered with its failure before it "
        "is built again (a changed set or store entry is built at once).",
    )
    max_envs: int = _opt(
        20,
        "Environments kept at most; past it the least recently used one no loaded model uses "
        "is removed; 0 = no limit.",
    )
    env_installer: str = _opt(
        "auto",
        "What builds the environments: auto (uv where it is installed, else venv and pip), "
        "uv or pip; either installs from the package index pip is configured with.",
    )
    env_disk_mb: int = _opt(
        0,
        "Disk budget of the environments in MiB; past it the least recently used ones no "
        "loaded model uses are removed; 0 = no limit.",
    )

    def check_envs(self) -> None:
        """Refuse an ``env_installer`` that is not a choice, or ``uv`` where none is installed."""
        if self.env_installer not in INSTALLERS:
            raise ConfigError(
                f"option env_installer={self.env_installer!r}: must be one of "
                f"{', '.join(INSTALLERS)}"
            )
        if self.env_installer == "uv" and find_uv() is None:
            raise ConfigError("option env_installer=uv: uv is not installed (pip install uv)")

    @property
    def env_uv(self) -> str | None:
        """The ``uv`` executable the environments are built with (``None``: pip)."""
        return None if self.env_installer == "pip" else find_uv()

    def env_path(self, cache_path: Path) -> Path:
        """The environments' folder: ``env_dir``, or ``.mmserver-envs`` beside ``cache_path``."""
        if self.env_dir:
            return Path(self.env_dir).expanduser().resolve()
        return cache_path.parent / ".mmserver-envs"
