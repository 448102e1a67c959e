"""A cluster: N mmserver instances on loopback ports over one model store, and HAProxy in front
on one port, all children of one supervisor process, recorded in a state directory.

State directory (default ``.cache/cluster``): ``cluster.json`` (ports, strategy, every process
as pid plus start time, and the last rolling restart), ``cluster.pid`` (the supervisor),
``haproxy.cfg``, ``haproxy.sock`` (HAProxy's runtime API), ``haproxy.log``, ``instance-N.log``,
``instance-N/`` (instance N's own ``state_dir``: its warm set, kept from one start to the next)
and, for a detached cluster, ``cluster.log``.

Start order: the instances (all at once; each answers ``/ping`` when ready), then HAProxy, which
is ready when its health checks have seen every instance up. Stop order, written once in
:meth:`Cluster.stop`: HAProxy soft-stops (stops listening, lets the requests in flight finish),
then every instance gets SIGTERM and drains its accepted requests; what is still alive after
that is killed by pid, and the state files go.

While it runs, the supervisor restarts an instance whose process has ended (on the same port,
after a back-off of 1 s doubling to 30 s); HAProxy's health checks take it out meanwhile and
bring it back when it answers ``/ping`` again. On SIGUSR2 it restarts every instance in turn
(:mod:`mmserver.commands.cluster.rolling`).
"""

from __future__ import annotations

import functools
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
from mmserver.commands.cluster.rolling import (
    RESTART_SIGNAL,
    Interrupted,
    Phase,
    RestartStatus,
    RollingRestart,
)
from mmserver.commands.cluster.runtime import MAX_SOCKET_PATH, RuntimeApi
from mmserver.commands.launch import READY_TIMEOUT_S
from mmserver.commands.procfs import HOST, free_port
from mmserver.commands.procs import ProcessId, descendants, kill_all, wait_gone

log = logging.getLogger("cluster")

STATE_FILE = "cluster.json"
PID_FILE = "cluster.pid"
SOCKET_FILE = "haproxy.sock"
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
        ports = [free_port() for _ in range(spec.instances)]
        # Each instance sends the management calls it applies on to the others.
        peers = ",".join(f"{HOST}:{port}" for port in ports)
        self.instances = [
            Instance(
                f"i{n}",
                port,
                spec.instance,
                self.state_dir / f"instance-{n}.log",
                self.state_dir / f"instance-{n}",
                peers=peers,
            )
            for n, port in enumerate(ports)
        ]
        socket_path = admin_socket(self.state_dir)
        self.balancer = Balancer(
            BalancerSpec(
                strategy=spec.strategy,
                port=spec.port,
                stats_port=spec.stats_port or free_port(),
                servers=tuple((i.name, HOST, i.port) for i in self.instances),
                hash_balance_factor=spec.hash_balance_factor,
                check_inter_ms=spec.check_inter_ms,
                admin_socket=str(socket_path),
                refuse_asynchronous=True,
            ),
            self.state_dir / "haproxy.cfg",
            self.state_dir / "haproxy.log",
        )
        self.api = RuntimeApi(socket_path)
        #: Set by SIGUSR2: a rolling restart is asked for (:meth:`supervise` runs it).
        self.restart_requested = threading.Event()
        self.restart = RestartStatus()
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
            "admin_socket": str(self.api.path),
            "restart": self.restart.to_json(),
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
                self._wait(functools.partial(instance.wait_ready, self.ready_timeout))
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

    @property
    def ready_timeout(self) -> float:
        """What an instance gets to answer ready, the models of its warm set loaded again."""
        return READY_TIMEOUT_S + self.spec.instance.warm_ready_timeout

    def _check_stop(self) -> None:
        if self.stop_event.is_set():
            raise Stopped("stopped while starting")

    def supervise(self) -> int:
        """Until a stop is asked for: restart instances that end, and every instance in turn
        when a rolling restart is asked for; 1 if HAProxy ends."""
        while not self.stop_event.wait(0.2):
            code = self.balancer.exited()
            if code is not None:
                log.error("haproxy exited with code %s; see %s", code, self.balancer.log_path)
                return 1
            if self.restart_requested.is_set():
                self.restart_requested.clear()
                self.rolling_restart()
            elif self.spec.restart:
                self._restart_ended()
        return 0

    def rolling_restart(self) -> None:
        """Restart every instance in turn (:mod:`mmserver.commands.cluster.rolling`)."""
        RollingRestart(
            self.instances,
            self.api,
            self.spec.instance.serve(0).program(),
            check=self._check_restart,
            report=lambda: self.write_state(self._phase),
            status=self.restart,
            ready_timeout=self.ready_timeout,
            up_timeout=max(10.0, self.spec.check_inter_ms / 1000 * 20),
            stop_timeout=DRAIN_TIMEOUT_S,
        ).run()
        now = time.monotonic()
        for record in self.restart.instances:
            if record.new_pid is not None:
                self._started_at[record.name] = now
                self._restart_at.pop(record.name, None)

    def _check_restart(self) -> None:
        if self.stop_event.is_set():
            raise Interrupted("a stop was asked for")
        code = self.balancer.exited()
        if code is not None:
            raise Interrupted(f"haproxy exited with code {code}")
        if self.spec.restart:
            # The other instances are still supervised: one that ends meanwhile is started
            # again as ever; the one the restart has in hand (the last it began) is its own.
            records = self.restart.instances
            self._restart_ended(skip=records[-1].name if records else None)

    def _restart_ended(self, skip: str | None = None) -> None:
        now = time.monotonic()
        for instance in self.instances:
            if instance.name == skip:
                continue
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
        for name in (STATE_FILE, PID_FILE, SOCKET_FILE):
            (self.state_dir / name).unlink(missing_ok=True)
        log.info("cluster stopped")


# -- a cluster recorded in a state directory, seen from another process -------------------


def admin_socket(state_dir: Path) -> Path:
    """Where HAProxy's runtime API listens; ``ValueError`` when the path is too long for a
    file socket."""
    path = state_dir / SOCKET_FILE
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"the state directory's path is too long for HAProxy's admin socket {path} "
            f"(at most {MAX_SOCKET_PATH} bytes with the file's name); choose a shorter "
            "--state-dir"
        )
    return path


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
    for name in (STATE_FILE, PID_FILE, SOCKET_FILE):
        (state_dir / name).unlink(missing_ok=True)
    return f"stopped the processes recorded in {state_dir} (its supervisor was gone)"


class NoCluster(Exception):
    """No cluster is running from the state directory, or it cannot take a rolling restart."""


def restart_recorded(
    state_dir: Path, timeout: float, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Ask the supervisor of the cluster recorded in ``state_dir`` for a rolling restart
    (:data:`~mmserver.commands.cluster.rolling.RESTART_SIGNAL`) and wait up to ``timeout`` s
    until one begun after the request has ended; each step is passed to ``progress``. Returns
    the restart's status (``phase`` ``done``, ``failed`` or ``stopped``; its ``steps``, each
    passed to ``progress`` as it is seen); raises
    :class:`NoCluster` when there is no cluster to restart, ``TimeoutError`` when it has not
    ended in time (it goes on), ``RuntimeError`` when the supervisor ends meanwhile."""
    state = read_state(state_dir)
    supervisor = supervisor_of(state) if state else None
    if state is None or supervisor is None or not supervisor.alive():
        raise NoCluster(f"no cluster is running from {state_dir}")
    if state.get("phase") != "ready":
        raise NoCluster(
            f"the cluster of {state_dir} is {state.get('phase')}, not serving; a rolling "
            "restart needs it ready"
        )
    if "restart" not in state:
        raise NoCluster(
            f"the cluster of {state_dir} (supervisor pid {supervisor.pid}) was started by a "
            "version without rolling restarts; stop it and start it again"
        )
    before = int(state["restart"]["seq"])
    supervisor.signal(RESTART_SIGNAL)
    deadline = time.monotonic() + timeout
    seen = 0
    while True:
        state = read_state(state_dir) or state
        restart = state["restart"]
        if int(restart["seq"]) > before:
            for step in restart["steps"][seen:]:
                progress(step)
            seen = len(restart["steps"])
            if restart["phase"] != Phase.RUNNING.value:
                return dict(restart)
        if not supervisor.alive():
            raise RuntimeError(f"the supervisor (pid {supervisor.pid}) ended during the restart")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the rolling restart has not ended after {timeout:.0f} s; it goes on "
                f"(mmserver cluster status --state-dir {state_dir})"
            )
        time.sleep(0.1)
