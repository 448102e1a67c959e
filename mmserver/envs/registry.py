"""The model environments of a server (:class:`Environments`): one per requirement set the
server's own environment does not meet, built once, shared by every model asking for that set.

An environment is BUILDING, READY or FAILED (:class:`EnvState`, transitions checked). A build
runs as one task on the event loop (its steps are subprocesses: :mod:`mmserver.envs.building`)
that every load asking for the set while it runs awaits, shielded: a client leaving does not
cancel it. A failed build is remembered with the store entry it was built for: loads asking for
the set are answered its failure until ``retry_s`` has passed or another store entry asks. The
folders of finished environments found at start are READY at once (a restart builds nothing).
After each build, environments no loaded model uses are removed, least recently used first,
while more than ``max_envs`` are kept or they take more than ``disk_mb`` of disk.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.envs import building
from mmserver.envs.requirements import RequirementSet, unmet
from mmserver.errors import EnvironmentFailed
from mmserver.ops.metrics import Metrics

log = logging.getLogger(__name__)


class EnvState(enum.Enum):
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


_MOVES = {
    EnvState.BUILDING: {EnvState.READY, EnvState.FAILED},
    EnvState.READY: {EnvState.BUILDING},
    EnvState.FAILED: {EnvState.BUILDING},
}


@dataclass(eq=False)
class Environment:
    """One environment: its set, folder and state, what it installed, who uses it."""

    wanted: RequirementSet
    folder: Path
    state: EnvState = EnvState.BUILDING
    versions: dict[str, str] = field(default_factory=dict)
    tool: str | None = None
    seconds: float | None = None
    error: EnvironmentFailed | None = None
    #: When its last build failed (the registry's clock), and for which store entry.
    failed_at: float = 0.0
    failed_for: object = None
    build: asyncio.Task[None] | None = None
    #: The models loaded in it now.
    users: set[str] = field(default_factory=set)
    last_used: float = 0.0
    disk_bytes: int = 0

    @property
    def key(self) -> str:
        return self.wanted.key

    @property
    def python(self) -> Path:
        return building.interpreter(self.folder)

    def leave(self, model: str) -> None:
        """``model`` no longer runs here (unloaded)."""
        self.users.discard(model)
        self.last_used = time.monotonic()

    def become(self, state: EnvState) -> None:
        if state not in _MOVES[self.state]:
            raise RuntimeError(f"environment {self.key}: {self.state.value} -> {state.value}")
        self.state = state

    def describe(self) -> dict[str, Any]:
        """What ``GET /models/NAME`` shows of it."""
        said: dict[str, Any] = {
            "id": self.key,
            "state": self.state.value,
            "python": self.wanted.python,
            "requirements": list(self.wanted.requirements),
        }
        if self.versions:
            said["versions"] = self.versions
        if self.tool is not None:
            said["builtWith"] = self.tool
        if self.seconds is not None:
            said["buildSeconds"] = round(self.seconds, 3)
        if self.error is not None and self.state is EnvState.FAILED:
            said["error"] = self.error.message
        return said


class Environments:
    """The environments under ``folder`` (see the module docstring). Only the event loop calls
    it; :meth:`scan` is blocking and runs before the server serves."""

    def __init__(
        self,
        folder: Path,
        metrics: Metrics,
        *,
        timeout: float,
        retry_s: float,
        max_envs: int,
        disk_mb: int,
        uv: str | None = None,
    ) -> None:
        self.folder = folder
        self._metrics = metrics
        self._timeout = timeout
        self._retry_s = retry_s
        self._max_envs = max_envs
        self._disk_bytes = disk_mb << 20
        self._clock = time.monotonic
        self._uv = uv
        self.envs: dict[str, Environment] = {}
        #: Whether the server's own environment meets a set, by its key.
        self._met: dict[str, bool] = {}
        #: Called with an environment's id before its folder is removed (its processes stop).
        self.on_remove: Callable[[str], Awaitable[None]] | None = None

    def scan(self) -> int:
        """Take the finished environments under the folder as READY (a restart reuses them)
        and remove unfinished builds; how many were found."""
        if not self.folder.is_dir():
            return 0
        for child in sorted(self.folder.iterdir()):
            if not child.is_dir() or child.name.startswith("."):
                continue
            manifest = building.read_manifest(child)
            if manifest is None or manifest.get("key") != child.name:
                shutil.rmtree(child, ignore_errors=True)
                continue
            wanted = RequirementSet(tuple(manifest["requirements"]), str(manifest["python"]))
            if wanted.key != child.name:
                continue
            env = Environment(wanted, child, EnvState.READY, dict(manifest.get("versions", {})))
            env.tool = manifest.get("tool")
            env.seconds = manifest.get("seconds")
            env.last_used = self._clock()
            env.disk_bytes = building.disk_bytes(child)
            self.envs[env.key] = env
        return len(self.envs)

    async def met(self, wanted: RequirementSet) -> bool:
        """Whether the server's own environment meets ``wanted`` (no environment is built);
        found once per set, in a thread (it reads the installed distributions' metadata)."""
        found = self._met.get(wanted.key)
        if found is None:
            missing = await asyncio.to_thread(unmet, wanted.requirements)
            found = self._met[wanted.key] = not missing
        return found

    def get(self, wanted: RequirementSet, entry: object) -> Environment:
        """The environment of ``wanted`` for a load of store entry ``entry``, its build started
        if it has none (or it failed, and may be tried again). Raises the failure of its last
        build while that is remembered (:class:`EnvironmentFailed`)."""
        env = self.envs.get(wanted.key)
        if env is None:
            env = self.envs[wanted.key] = Environment(wanted, self.folder / wanted.key)
            self._start(env, entry)
        elif env.state is EnvState.FAILED:
            again = entry != env.failed_for or self._clock() - env.failed_at >= self._retry_s
            if not again and env.error is not None:
                raise env.error
            env.become(EnvState.BUILDING)
            self._start(env, entry)
        return env

    async def ready(self, env: Environment, model: str) -> Environment:
        """``env`` once READY (its build awaited, shielded: shared by every load that waits),
        counted as used by ``model`` until :meth:`Environment.leave`. Raises
        :class:`EnvironmentFailed`."""
        if env.build is not None:
            await asyncio.shield(env.build)
        if env.state is not EnvState.READY:
            raise env.error or EnvironmentFailed(f"environment {env.key} could not be built")
        env.users.add(model)
        env.last_used = self._clock()
        return env

    async def stop(self) -> None:
        """Cancel the builds under way (their subprocesses are killed) and wait for them: a
        folder left unfinished is removed and built again at the next start."""
        builds = [env.build for env in self.envs.values() if env.build is not None]
        for build in builds:
            build.cancel()
        await asyncio.gather(*builds, return_exceptions=True)

    def _start(self, env: Environment, entry: object) -> None:
        env.build = asyncio.get_running_loop().create_task(
            self._build(env, entry), name=f"mmserver-env-build-{env.key}"
        )

    async def _build(self, env: Environment, entry: object) -> None:
        """Build ``env``: READY, or FAILED with the error every waiting load is answered."""
        listed = ", ".join(env.wanted.requirements)
        log.info("environment %s: building for %s", env.key, listed)
        try:
            built = await building.build(env.wanted, env.folder, self._timeout, self._uv)
        except Exception as exc:  # the installer's failure, its deadline, or anything else
            env.error = EnvironmentFailed(_failure(env, exc, self._timeout))
            env.failed_at, env.failed_for = self._clock(), entry
            env.become(EnvState.FAILED)
            self._metrics.env_build_failures.inc()
            await asyncio.to_thread(shutil.rmtree, env.folder, True)
            return
        finally:
            env.build = None
        env.versions, env.tool, env.seconds = built.versions, built.tool, built.seconds
        env.error = None
        env.last_used = self._clock()
        env.become(EnvState.READY)
        self._metrics.env_builds.labels(built.tool).inc()
        self._metrics.env_build_seconds.observe(built.seconds)
        env.disk_bytes = await asyncio.to_thread(building.disk_bytes, env.folder)
        log.info(
            "environment %s: built with %s in %.1f s (%.0f MiB)",
            env.key,
            built.tool,
            built.seconds,
            env.disk_bytes / 2**20,
        )
        await self._trim()

    async def _trim(self) -> None:
        """Remove unused environments, least recently used first, past ``max_envs`` or the disk
        budget."""
        while True:
            kept = [e for e in self.envs.values() if e.state is EnvState.READY]
            unused = sorted((e for e in kept if not e.users), key=lambda e: e.last_used)
            over_count = self._max_envs and len(kept) > self._max_envs
            over_disk = self._disk_bytes and sum(e.disk_bytes for e in kept) > self._disk_bytes
            if not unused or not (over_count or over_disk):
                return
            victim = unused[0]
            del self.envs[victim.key]
            why = "max_envs" if over_count else "env_disk_mb"
            log.info("environment %s: removed (unused, past %s)", victim.key, why)
            if self.on_remove is not None:
                await self.on_remove(victim.key)
            await asyncio.to_thread(shutil.rmtree, victim.folder, True)


def _failure(env: Environment, exc: BaseException, timeout: float) -> str:
    """The message of a failed build: the package and the installer's last error line."""
    if isinstance(exc, TimeoutError):
        return (
            f"its environment ({', '.join(env.wanted.requirements)}) was not built within "
            f"env_build_timeout_s={timeout:g} s"
        )
    if isinstance(exc, building.BuildFailed):
        return (
            f"its requirements cannot be installed: {', '.join(exc.packages)}: {exc.line} "
            f"(environment {env.key})"
        )
    return f"its environment {env.key} cannot be built: {type(exc).__name__}: {exc}"
