"""Rolling restarts of a running cluster (``mmserver cluster restart`` and ``upgrade``): every
instance in turn, out of the balancer before it stops and back only once it is warm, so that
no request meets a stopping or a cold instance.

The supervisor runs it on SIGUSR2 (:data:`RESTART_SIGNAL`, which ``restart`` sends) in its
supervision loop (:meth:`Cluster.supervise
<mmserver.commands.cluster.cluster.Cluster.supervise>`), still starting again any other instance
that ends meanwhile (at each ``check``); its progress and outcome are the
``restart`` member of ``cluster.json`` (:class:`RestartStatus`), which ``restart`` reads. A
signal during a restart asks for one more after it.

First the installed code is run (``mmserver --version``): if it does not start, nothing is
touched. Then, for each instance in order:

1. out of the balancer: its server's state is set to ``drain`` through HAProxy's runtime API
   (:mod:`mmserver.commands.cluster.runtime`), so HAProxy sends it no new request;
2. drained: until HAProxy holds no request on it (its current sessions 0), for
   :data:`SESSIONS_TIMEOUT_S` at most (what is left is the instance's own drain);
3. stopped: SIGTERM; the server writes its warm set (the models loaded, in its own
   ``state_dir``) and drains its accepted requests; killed after the drain timeout;
4. started again: the same command line on the same port (``python -m mmserver serve`` of the
   supervisor's interpreter, so the code installed now runs: an upgrade);
5. warm: ready once ``/ping`` answers 200, which with ``warm_ready_timeout`` is once the models
   of its warm set are loaded again (or that many seconds have passed);
6. back: its state is set to ``ready``, and the restart waits until HAProxy's health checks see
   it ``UP``, so that the next instance leaves only once this one takes requests.

An instance that does not come back (it exits, or is not ready in time) ends the restart there:
it is put back to ``ready`` (the health checks keep it out while it fails, the supervisor starts
it again if it exits), the instances after it keep their old processes, and the status says
``failed`` and why. A stop asked for meanwhile (SIGTERM) ends it as ``stopped``.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserver.commands.cluster.instances import Instance
from mmserver.commands.cluster.runtime import RuntimeApi, RuntimeApiError, ServerState
from mmserver.commands.launch import http_get

log = logging.getLogger("cluster")

RESTART_SIGNAL = signal.SIGUSR2
#: What HAProxy's requests on a drained instance get to end before it is stopped.
SESSIONS_TIMEOUT_S = 40.0
#: What the installed code gets to print its version.
VERSION_TIMEOUT_S = 60.0
_POLL_S = 0.05


class Phase(enum.Enum):
    NONE = "none"  # no restart asked for yet
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # the cluster was stopped meanwhile


@dataclass
class InstanceRestart:
    """One instance's restart: its processes, versions and loaded models before and after."""

    name: str
    old_pid: int | None
    new_pid: int | None = None
    version_before: str = ""
    version_after: str = ""
    models_before: int | None = None
    models_after: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "old_pid": self.old_pid,
            "new_pid": self.new_pid,
            "version_before": self.version_before,
            "version_after": self.version_after,
            "models_before": self.models_before,
            "models_after": self.models_after,
        }


@dataclass
class RestartStatus:
    """The last rolling restart, as ``cluster.json`` holds it: ``seq`` counts the restarts the
    supervisor has begun; ``steps`` what it has done so far, the last one under way;
    ``message`` how it ended."""

    seq: int = 0
    phase: Phase = Phase.NONE
    steps: list[str] = field(default_factory=list)
    message: str = ""
    installed: str = ""
    started: float = 0.0
    ended: float = 0.0
    instances: list[InstanceRestart] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "phase": self.phase.value,
            "steps": self.steps,
            "message": self.message,
            "installed": self.installed,
            "started": self.started,
            "ended": self.ended,
            "instances": [i.to_json() for i in self.instances],
        }


class Interrupted(Exception):
    """The cluster is stopping (or HAProxy ended): the restart ends where it is."""


class NotBack(Exception):
    """An instance did not come back: it exited, or was not ready in time."""


@dataclass
class RollingRestart:
    """One rolling restart of ``instances`` (see the module docstring). ``program`` runs the
    installed ``mmserver``; ``check`` raises :class:`Interrupted` when the restart must end;
    ``report`` publishes :attr:`status` (called at each step); ``ready_timeout``: what an
    instance gets to be ready, its warm set included; ``up_timeout``: what HAProxy's health
    checks get to see it up."""

    instances: Sequence[Instance]
    api: RuntimeApi
    program: Sequence[str]
    check: Callable[[], None]
    report: Callable[[], None]
    status: RestartStatus
    ready_timeout: float
    up_timeout: float
    stop_timeout: float

    def run(self) -> None:
        """Restart every instance in turn; the outcome is in :attr:`status`."""
        status = self.status
        status.seq += 1
        status.phase = Phase.RUNNING
        status.message = status.installed = ""
        status.started, status.ended = time.time(), 0.0
        status.steps, status.instances = [], []
        try:
            status.installed = self._installed()
            self._step(f"restarting {len(self.instances)} instance(s) onto {status.installed}")
            for instance in self.instances:
                self._restart(instance)
            status.phase = Phase.DONE
            status.message = (
                f"restarted {len(self.instances)} instance(s), one at a time, onto "
                f"{status.installed}"
            )
        except Interrupted as exc:
            status.phase, status.message = Phase.STOPPED, f"stopped: {exc}"
        except (NotBack, RuntimeApiError) as exc:
            status.phase, status.message = Phase.FAILED, str(exc)
        status.ended = time.time()
        (log.info if status.phase is Phase.DONE else log.error)(
            "rolling restart: %s", status.message
        )
        self.report()

    def _installed(self) -> str:
        """The installed mmserver's version (``mmserver X``); :class:`NotBack` if it does not
        run."""
        argv = [*self.program, "--version"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NotBack(
                f"the installed mmserver does not run ({exc}); nothing was restarted"
            ) from None
        if done.returncode != 0:
            raise NotBack(
                f"the installed mmserver does not run ({' '.join(argv)}: exit code "
                f"{done.returncode}); nothing was restarted:\n{done.stderr.strip()[-2000:]}"
            )
        return done.stdout.strip()

    def _restart(self, instance: Instance) -> None:
        name, api = instance.name, self.api
        record = InstanceRestart(name, instance.ident.pid if instance.ident else None)
        self.status.instances.append(record)
        record.version_before = server_version(instance.port)
        record.models_before = models_loaded(instance.port)
        api.set_state(name, ServerState.DRAIN)
        self._step(f"{name}: out of the balancer (drain); its requests in HAProxy end")
        if not self._poll(lambda: int(api.server(name)["scur"] or 0) == 0, SESSIONS_TIMEOUT_S):
            log.warning(
                "instance %s still holds requests after %.0f s; it drains them as it stops",
                name,
                SESSIONS_TIMEOUT_S,
            )
        record.models_before = models_loaded(instance.port) or record.models_before
        self._step(f"{name}: stopping (pid {record.old_pid}); it drains and writes its warm set")
        stopped = instance.stop(self.stop_timeout)
        if stopped.code is None and record.old_pid is not None:
            log.warning("instance %s did not stop within %.0f s: killed", name, self.stop_timeout)
        instance.start()
        record.new_pid = instance.pid
        self._step(f"{name}: started (pid {record.new_pid}); ready once its models are back")
        try:
            if not self._poll(instance.ready, self.ready_timeout, lambda: _failure(instance)):
                raise NotBack(
                    f"instance {name} (pid {record.new_pid}) not ready within "
                    f"{self.ready_timeout:.0f} s; see {instance.log_path}"
                )
            instance.remember_family()
            record.models_after = models_loaded(instance.port)
            record.version_after = server_version(instance.port)
        finally:
            # Back to the health checks' judgement, whatever happened: they keep it out while
            # it fails, and the supervisor starts it again if it exits.
            if not self._interrupted():
                api.set_state(name, ServerState.READY)
        self._step(f"{name}: back in the balancer; HAProxy's health checks see it up")
        if not self._poll(lambda: api.server(name)["status"] == "UP", self.up_timeout):
            raise NotBack(
                f"HAProxy's health checks did not see instance {name} up within "
                f"{self.up_timeout:.0f} s"
            )
        log.info(
            "instance %s restarted: pid %s -> %s, %s model(s) loaded before, %s at ready",
            name,
            record.old_pid,
            record.new_pid,
            record.models_before,
            record.models_after,
        )

    def _step(self, text: str) -> None:
        log.info("rolling restart: %s", text)
        self.status.steps.append(text)
        self.report()

    def _interrupted(self) -> bool:
        try:
            self.check()
        except Interrupted:
            return True
        return False

    def _poll(
        self,
        condition: Callable[[], bool],
        timeout: float,
        failed: Callable[[], str | None] = lambda: None,
    ) -> bool:
        """Whether ``condition`` held within ``timeout`` s; :class:`NotBack` as soon as
        ``failed`` gives a reason; :class:`Interrupted` when the restart must end."""
        deadline = time.monotonic() + timeout
        while not condition():
            self.check()
            reason = failed()
            if reason is not None:
                raise NotBack(reason)
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True


def _failure(instance: Instance) -> str | None:
    reason = instance.failure()
    return None if reason is None else f"instance {instance.name} did not come back: {reason}"


def server_version(port: int) -> str:
    """``mmserver X`` as the instance on ``port`` says it runs (``GET /v2``); "" if unknown."""
    status, body = http_get(port, "/v2")
    try:
        data = json.loads(body) if status == 200 else {}
    except ValueError:
        return ""
    return f"{data.get('name', 'mmserver')} {data['version']}" if "version" in data else ""


_MODELS_LOADED = re.compile(rb"^mmserver_models_loaded (\S+)$", re.MULTILINE)


def models_loaded(port: int) -> int | None:
    """The models the instance on ``port`` has loaded (its ``mmserver_models_loaded``)."""
    status, body = http_get(port, "/metrics")
    found = _MODELS_LOADED.search(body) if status == 200 else None
    return int(float(found.group(1))) if found else None
