"""A cluster: N mmserver instances on loopback ports over one model store, and HAProxy in front
on one port, all children of one supervisor process, recorded in a state directory.

State directory (default ``.cache/cluster``): ``cluster.json`` (ports, strategy, and every
process as pid plus start time), ``cluster.pid`` (the supervisor), ``haproxy.cfg``,
``haproxy.log``, ``instance-N.log`` and, for a detached cluster, ``cluster.log``.

Start order: the instances (all at once; each answers ``/ping`` when ready), then HAProxy, which
is ready when its health checks have seen every instance up. Stop order, written once in
:meth:`Cluster.stop`: HAProxy soft-stops (stops listening, lets the requests in flight finish),
then every instance gets SIGTERM and drains its accepted requests; what is still alive after
that is killed by pid, and the state files go.

While it runs, the supervisor restarts an instance whose process has ended (on the same port,
after a back-off of 1 s doubling to 30 s); HAProxy's health checks take it out meanwhile and
bring it back when it answers ``/ping`` again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.commands.cluster.balancer import Balancer, BalancerSpec, Strategy
from mmserver.commands.cluster.instances import Instance, InstanceSpec, stop_instances
from mmserver.commands.procfs import HOST, free_port
from mmserver.commands.procs import ProcessId, descendants, kill_all, wait_gone

log = logging.getLogger("cluster")

STATE_FILE = "cluster.json"
PID_FILE = "cluster.pid"
DRAIN_TIMEOUT_S = 40.0
RESTART_BACKOFF_S = (1.0, 30.0)


@dataclass(frozen=True)
class ClusterSpec:
    instances: int
    strategy: Strategy
    port: int
    instance: InstanceSpec
    state_dir: Path
    stats_port: int = 0  # 0: a free port
    hash_balance_factor: int = 150
    check_inter_ms: int = 500
    restart: bool = True


class Stopped(Exception):
    """A stop was asked for while the cluster was starting."""


class Cluster:
    """Start, supervise and stop one cluster (see the module docstring for the order)."""

    def __init__(self, spec: ClusterSpec, stop_event: threading.Event | None = None) -> None:
        self.spec = spec
        self.state_dir = spec.state_dir
        self.stop_event = stop_event or threading.Event()
        self.instances = [
            Instance(f"i{n}", free_port(), spec.instance, self.state_dir / f"instance-{n}.log")
            for n in range(spec.instances)
        ]
        self.balancer = Balancer(
            BalancerSpec(
                strategy=spec.strategy,
                port=spec.port,
                stats_port=spec.stats_port or free_port(),
                servers=tuple((i.name, HOST, i.port) for i in self.instances),
                hash_balance_factor=spec.hash_balance_factor,
                check_inter_ms=spec.check_inter_ms,
            ),
            self.state_dir / "haproxy.cfg",
            self.state_dir / "haproxy.log",
        )
        self._phase = "starting"
        self._started_at: dict[str, float] = {}
        self._restart_at: dict[str, float] = {}
        self._backoff: dict[str, float] = {}

    # -- state ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        me = ProcessId.of(os.getpid())
        balancer = self.balancer.ident.to_json() if self.balancer.ident else {}
        return {
            "phase": self._phase,
            "strategy": self.spec.strategy.value,
            "url": self.balancer.url,
            "port": self.spec.port,
            "stats_url": f"http://{HOST}:{self.balancer.spec.stats_port}/stats",
            "stats_port": self.balancer.spec.stats_port,
            "model_store": str(self.spec.instance.model_store),
            "supervisor": me.to_json() if me else {},
            "balancer": {
                **balancer,
                "config": str(self.balancer.config_path),
                "log": str(self.balancer.log_path),
            },
            "instances": [i.to_json() for i in self.instances],
        }

    def write_state(self, phase: str) -> None:
        self._phase = phase
        path = self.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        os.replace(tmp, path)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the instances, then HAProxy; raise (having stopped what started) on failure."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        refuse_if_running(self.state_dir)
        (self.state_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        try:
            for instance in self.instances:
                instance.start()
                self._started_at[instance.name] = time.monotonic()
            self.write_state("starting")
            for instance in self.instances:
                self._wait(instance.wait_ready)
            self._check_stop()
            self.balancer.start()
            self.write_state("ready")
        except BaseException:
            self.stop()
            raise
        log.info(
            "cluster ready: %s on %s, %d instance(s) (%s)",
            self.spec.strategy.value,
            self.balancer.url,
            len(self.instances),
            ", ".join(f"{i.name}={i.port}" for i in self.instances),
        )

    def _wait(self, wait: Callable[[], None]) -> None:
        # Readiness waits poll; run them in a thread so a stop request is seen at once.
        done = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                wait()
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        while not done.wait(0.1):
            self._check_stop()
        if failure:
            raise failure[0]

    def _check_stop(self) -> None:
        if self.stop_event.is_set():
            raise Stopped("stopped while starting")

    def supervise(self) -> int:
        """Until a stop is asked for: restart instances that end; 1 if HAProxy ends."""
        while not self.stop_event.wait(0.2):
            code = self.balancer.exited()
            if code is not None:
                log.error("haproxy exited with code %s; see %s", code, self.balancer.log_path)
                return 1
            if self.spec.restart:
                self._restart_ended()
        return 0

    def _restart_ended(self) -> None:
        now = time.monotonic()
        for instance in self.instances:
            code = instance.exited()
            if code is None:
                continue
            name = instance.name
            restart_at = self._restart_at.get(name)
            if restart_at is None:
                # 1 s, doubling while the instance keeps ending within a minute of its start.
                up_for = now - self._started_at.get(name, now)
                previous = self._backoff.get(name, 0.0)
                backoff = (
                    RESTART_BACKOFF_S[0]
                    if up_for > 60 or not previous
                    else min(previous * 2, RESTART_BACKOFF_S[1])
                )
                self._backoff[name] = backoff
                self._restart_at[name] = now + backoff
                log.warning(
                    "instance %s (pid %s) exited with code %s; restarting in %.0f s",
                    name,
                    instance.ident.pid if instance.ident else "?",
                    code,
                    backoff,
                )
            elif now >= restart_at:
                del self._restart_at[name]
                instance.start()
                self._started_at[name] = now
                log.info(
                    "instance %s restarted on port %d (pid %s)",
                    name,
                    instance.port,
                    instance.ident.pid if instance.ident else "?",
                )
                self.write_state(self._phase)

    def stop(self) -> None:
        """HAProxy soft stop, then SIGTERM to every instance (they drain), then kill what is
        left by pid; remove the state files."""
        if (self.state_dir / STATE_FILE).exists():
            self.write_state("stopping")
        self.balancer.stop()
        stop_instances(self.instances, DRAIN_TIMEOUT_S)
        for name in (STATE_FILE, PID_FILE):
            (self.state_dir / name).unlink(missing_ok=True)
        log.info("cluster stopped")


# -- a cluster recorded in a state directory, seen from another process -------------------


def read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data


def supervisor_of(state: dict[str, Any]) -> ProcessId | None:
    data = state.get("supervisor") or {}
    return ProcessId.from_json(data) if "pid" in data else None


def refuse_if_running(state_dir: Path) -> None:
    state = read_state(state_dir)
    supervisor = supervisor_of(state) if state else None
    if supervisor is not None and supervisor.alive() and supervisor.pid != os.getpid():
        raise RuntimeError(
            f"a cluster is already running from {state_dir} (supervisor pid {supervisor.pid}); "
            f"stop it first: mmserver cluster stop --state-dir {state_dir}"
        )


def stop_recorded(state_dir: Path, timeout: float = DRAIN_TIMEOUT_S * 2 + 20) -> str:
    """Stop the cluster recorded in ``state_dir``: SIGTERM to its supervisor, which stops the
    rest in order; if the supervisor is gone, stop the recorded processes directly (HAProxy,
    then the instances), checking each pid's start time first. Returns what was done."""
    state = read_state(state_dir)
    if state is None:
        return f"no cluster recorded in {state_dir}"
    supervisor = supervisor_of(state)
    if supervisor is not None and supervisor.alive():
        supervisor.signal(signal.SIGTERM)
        if not wait_gone([supervisor], timeout):
            return f"stopped the cluster of {state_dir} (supervisor pid {supervisor.pid})"
        supervisor.signal(signal.SIGKILL)
        wait_gone([supervisor], 5.0)
    balancer = state.get("balancer") or {}
    if "pid" in balancer:
        ident = ProcessId.from_json(balancer)
        ident.signal(signal.SIGUSR1)
        kill_all(wait_gone([ident], 10.0))
    roots = [ProcessId.from_json(i) for i in state.get("instances", []) if "pid" in i]
    family = [p for root in roots if root.alive() for p in descendants(root.pid)]
    for root in roots:
        root.signal(signal.SIGTERM)
    kill_all(wait_gone(roots, DRAIN_TIMEOUT_S))
    kill_all(wait_gone(family, 5.0))
    for name in (STATE_FILE, PID_FILE):
        (state_dir / name).unlink(missing_ok=True)
    return f"stopped the processes recorded in {state_dir} (its supervisor was gone)"
