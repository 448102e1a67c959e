"""A server as a child process: ``mmserver serve`` (or HAProxy, MLServer, an HTTP floor) started
by a command, a tool or a test, its output in a log, ready once it answers, stopped so that it
drains, and nothing of it left behind.

- :class:`Serve` — the command line of ``mmserver serve``: ``python -m mmserver`` of this
  interpreter, or another build's ``mmserver`` executable;
- :class:`Child` — one child process, its output appended to (or written over) a log, in its own
  session if asked (a Ctrl-C in the caller's terminal does not reach it) and ended with its
  parent if asked (Linux's parent-death signal); ready once ``GET /ping`` (or another health
  path) on its port answers 200, or failing at once, with the end of its log, if it exits first;
- :func:`stop_all` — the stop of one or several children at once: a signal (SIGTERM, on which
  mmserver drains its accepted requests), SIGKILL for those still running after the timeout,
  then the descendants still alive a grace later (mmserver's fork server and backend
  processes), killed by pid and start time.

Everything here blocks. Asyncio code calls :meth:`Child.start` on its own thread and runs the
waits in a worker thread (``await asyncio.to_thread(child.wait_ready)``): Linux sends the
parent-death signal when the *thread* that started the child ends, so a child started from a
worker thread could be ended when the pool retires that thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mmserver.commands.procfs import HOST
from mmserver.commands.procs import ProcessId, descendants, kill_all, wait_gone

READY_TIMEOUT_S = 120.0
#: What a stop waits for the child to exit after its signal: mmserver's default drain (30 s)
#: and its backends' stop.
STOP_TIMEOUT_S = 40.0
#: What the descendants of a stopped child get to exit on their own (the fork server and the
#: backend processes end once they read the end of their pipes) before they are killed.
GRACE_S = 5.0
#: What a killed child gets to be gone and collected.
KILLED_S = 5.0
TAIL_LINES = 30
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


class NotStarted(RuntimeError):
    """A child that exited before it was ready, or was not ready in time: ``what`` it was,
    ``reason`` (its exit code and log, or the timeout) and the ``tail`` of its log."""

    def __init__(self, what: str, reason: str, tail: str = "") -> None:
        super().__init__(f"{what}: {reason}" + (f"\n{tail}" if tail else ""))
        self.what = what
        self.reason = reason
        self.tail = tail


@dataclass(frozen=True)
class Serve:
    """``mmserver serve`` over ``model_store`` on ``host:port``; ``args`` come last, so they win
    over the options before them. ``exe``: another build's ``mmserver`` executable (the package
    it was installed with runs, whatever the working directory holds); ``None``: ``python -m
    mmserver`` of this interpreter."""

    model_store: Path | str
    port: int
    host: str = HOST
    backend_processes: int | None = None
    cache_dir: Path | str | None = None
    args: tuple[str, ...] = ()
    exe: Path | str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def program(self) -> list[str]:
        """How ``mmserver`` is run: ``exe``, or ``python -m mmserver`` of this interpreter
        (whatever package is installed when it starts)."""
        return [str(self.exe)] if self.exe is not None else [sys.executable, "-m", "mmserver"]

    def argv(self) -> list[str]:
        argv = [*self.program(), "serve", "--model-store", str(self.model_store)]
        argv += ["--host", self.host, "--port", str(self.port)]
        if self.backend_processes is not None:
            argv += ["--backend-processes", str(self.backend_processes)]
        if self.cache_dir is not None:
            argv += ["--cache-dir", str(self.cache_dir)]
        return [*argv, *self.args]

    def env(self) -> dict[str, str | None]:
        """The environment's changes (``None``: removed): output unbuffered, so the log is
        current when it is read; no variable of an option the command line sets (the flag wins
        anyway, and without the variable the log shows one value)."""
        env: dict[str, str | None] = {
            "PYTHONUNBUFFERED": "1",
            "MMSERVER_HOST": None,
            "MMSERVER_PORT": None,
        }
        if self.backend_processes is not None:
            env["MMSERVER_BACKEND_PROCESSES"] = None
        return env


@dataclass(frozen=True)
class Stopped:
    """How a stop ended: the child's exit ``code`` (``None`` when it had to be killed, or never
    ran) and the pids of its descendants that had to be killed after the grace."""

    code: int | None
    killed: list[int]


class Child:
    """One child process: ``command`` (a :class:`Serve`, or any argv) with its output in
    ``log_path`` (appended to, or written over when ``append`` is false), its environment this
    process's with ``env``'s changes (``None``: removed), in ``cwd``. ``new_session``: in a
    session of its own, so a Ctrl-C in the caller's terminal reaches only the caller, which
    stops it in its own order. ``end_with_parent``: on Linux it gets SIGTERM when the thread
    that started it dies (SIGKILL included), so a killed caller leaves no server behind.

    ``port`` (a :class:`Serve`'s by default) and ``health`` say where it answers once ready.
    :meth:`start` may be called again once the process has ended (the same port, the same log).
    """

    def __init__(
        self,
        command: Serve | Sequence[str],
        log_path: Path,
        *,
        label: str | None = None,
        port: int | None = None,
        health: str = "/ping",
        env: Mapping[str, str | None] | None = None,
        cwd: Path | str | None = None,
        new_session: bool = False,
        end_with_parent: bool = False,
        append: bool = True,
    ) -> None:
        if isinstance(command, Serve):
            self.argv = command.argv()
            self.env: dict[str, str | None] = {**command.env(), **(env or {})}
            self.host = command.host
            self.port = command.port if port is None else port
        else:
            self.argv = list(command)
            self.env = dict(env or {})
            self.host = HOST
            self.port = port or 0
        self.log_path = log_path
        #: What the child is, in messages ("instance i0", "haproxy").
        self.label = label or (
            "mmserver" if isinstance(command, Serve) else Path(self.argv[0]).name
        )
        self.health = health
        self.cwd = cwd
        self.new_session = new_session
        self.end_with_parent = end_with_parent
        self.append = append
        self.proc: subprocess.Popen[bytes] | None = None
        self.ident: ProcessId | None = None
        self._log: IO[bytes] | None = None
        self._family: set[ProcessId] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.label} was not started")
        return self.proc.pid

    def start(self) -> None:
        """Start the process; returns at once (:meth:`wait_ready` waits). Call it on a thread
        that lives as long as the child may (see ``end_with_parent``)."""
        if self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab" if self.append else "wb")
        env = None
        if self.env:
            env = dict(os.environ)
            for key, value in self.env.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = value
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env=env,
            start_new_session=self.new_session,
            preexec_fn=_ending_with_parent() if self.end_with_parent else None,
        )
        self.ident = ProcessId.of(self.proc.pid) or ProcessId(self.proc.pid, 0)

    def exited(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def failure(self) -> str | None:
        """Why it is not running, once it has exited (for :func:`wait_until`)."""
        code = self.exited()
        return None if code is None else f"exited with code {code}; see {self.log_path}"

    def log_tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def ready(self) -> bool:
        return http_get(self.port, self.health, host=self.host)[0] == 200

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until ``GET {health}`` answers 200; raise :class:`NotStarted` as soon as the process
        exits, or after ``timeout`` s. Its descendants then are remembered, so that a stop kills
        them even if they outlive it."""
        wait_until(
            self.ready, self.failure, timeout, f"{self.label} on port {self.port}", self.log_tail
        )
        self.remember_family()

    def send_signal(self, signum: int) -> bool:
        """Send ``signum`` if the process still runs; whether it was sent."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signum)
        return True

    def remember_family(self) -> None:
        """Note its current descendants (pid and start time), so that a stop finds them even
        once their parent has gone."""
        if self.proc is not None and self.proc.poll() is None:  # the pid is still its own
            self._family.update(descendants(self.proc.pid))

    def wait_exit(self, timeout: float) -> int:
        """Its exit code, once it has exited on its own within ``timeout`` s; else
        ``TimeoutError``."""
        if self.proc is None:
            raise RuntimeError(f"{self.label} was not started")
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.label} still running after {timeout:g} s") from None

    def stop(
        self,
        timeout: float = STOP_TIMEOUT_S,
        *,
        signum: int = signal.SIGTERM,
        grace_s: float = GRACE_S,
    ) -> Stopped:
        """Stop it as :func:`stop_all` does; nothing to do when it never started."""
        return stop_all([self], timeout, signum=signum, grace_s=grace_s)[0]

    def kill(self) -> Stopped:
        """SIGKILL to it and every descendant at once: no drain, nothing left."""
        return self.stop(0.0, signum=signal.SIGKILL, grace_s=0.0)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(
    children: Iterable[Child],
    timeout: float = STOP_TIMEOUT_S,
    *,
    signum: int = signal.SIGTERM,
    grace_s: float = GRACE_S,
) -> list[Stopped]:
    """``signum`` to every child at once (SIGTERM: each mmserver drains its accepted requests;
    SIGUSR1: HAProxy's soft stop), up to ``timeout`` s for them to exit, SIGKILL for those still
    running; then their descendants (taken before the signal, and any remembered earlier) get
    ``grace_s`` s to end on their own before they are killed by pid. Returns once they are
    gone, with each child's outcome in order; the logs are closed."""
    children = list(children)
    running = [c for c in children if c.proc is not None]
    for child in running:
        child.remember_family()
    for child in running:
        child.send_signal(signum)
    deadline = time.monotonic() + timeout
    while any(c.exited() is None for c in running) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    codes = {id(c): c.exited() for c in running}
    killed = [c for c in running if codes[id(c)] is None]
    for child in killed:
        child.send_signal(signal.SIGKILL)
    for child in killed:
        try:
            child.wait_exit(KILLED_S)
        except TimeoutError:
            pass
    left = wait_gone({p for c in running for p in c._family}, grace_s)
    kill_all(left)
    wait_gone(left, KILLED_S)
    for child in children:
        child.close_log()
    return [
        Stopped(codes.get(id(c)), sorted(p.pid for p in left if p in c._family)) for c in children
    ]


def http_get(port: int, path: str, timeout: float = 2.0, host: str = HOST) -> tuple[int, bytes]:
    """``GET http://host:port/path``: (status, body); status 0 when nothing answered."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def wait_until(
    ready: Callable[[], bool],
    failed: Callable[[], str | None],
    timeout: float,
    what: str,
    tail: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``ready`` every 50 ms until it holds; raise :class:`NotStarted` (with ``tail()``,
    the end of a log) when ``failed`` returns a reason or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while not ready():
        reason = failed()
        if reason is not None:
            raise NotStarted(what, reason, tail())
        if time.monotonic() > deadline:
            raise NotStarted(what, f"not ready within {timeout:.0f} s", tail())
        time.sleep(_POLL_S)


def _ending_with_parent() -> Callable[[], None] | None:
    """What the child runs before its program so that it gets SIGTERM when its parent dies
    (Linux; ``None`` elsewhere). The C library is found here, before the fork: the child may
    only make the call."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return hook
