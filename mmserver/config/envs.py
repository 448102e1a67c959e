"""The options of per-model environments (:mod:`mmserver.envs`), declared once here and part of
the server's options (:class:`~mmserver.config.server.ServerConfig` derives from
:class:`EnvOptions`: the same flags, ``MMSERVER_*`` variables and ``--config`` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    env_disk_mb: int = _opt(
        0,
        "Disk budget of the environments in MiB; past it the least recently used ones no "
        "loaded model uses are removed; 0 = no limit.",
    )

    def env_path(self, cache_path: Path) -> Path:
        """The environments' folder: ``env_dir``, or ``.mmserver-envs`` beside ``cache_path``."""
        if self.env_dir:
            return Path(self.env_dir).expanduser().resolve()
        return cache_path.parent / ".mmserver-envs"
