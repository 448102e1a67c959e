"""The frontend's side of a model environment's backend processes: its fork server
(:mod:`mmserver.backend.envfork`, run by the environment's interpreter) and each process it
forks, behind the same interface as a multiprocessing process, so that a
:class:`~mmserver.backend.process.BackendProcess` starts, watches and replaces them as it does
the main environment's (:class:`EnvContext`).

The environment sees mmserver's package through a folder that holds only a link to it
(``PYTHONPATH``): none of the server's own libraries are on its path.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PID = struct.Struct("q")


def package_link(folder: Path) -> Path:
    """``folder``, holding a link named ``mmserver`` to the running server's package: what an
    environment's interpreter is given as its path."""
    package = Path(__file__).resolve().parent.parent
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "mmserver"
    if not (link.is_symlink() and link.resolve() == package):
        link.unlink(missing_ok=True)
        link.symlink_to(package, target_is_directory=True)
    return folder


class EnvForkServer:
    """One environment's fork server, started on first use (blocking calls: the event loop's
    executor runs them, as it runs multiprocessing's)."""

    def __init__(self, name: str, python: Path, path: Path) -> None:
        self.name = name
        self._python = python
        self._path = path
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def _ensure_running(self) -> socket.socket:
        if self._control is not None and self._process is not None:
            if self._process.poll() is None:
                return self._control
            self._control.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PYTHONPATH=str(self._path), PYTHONNOUSERSITE="1")
        code = f"from mmserver.backend.envfork import main; main({theirs.fileno()})"
        self._process = subprocess.Popen(
            [str(self._python), "-c", code],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )
        theirs.close()
        self._control = ours
        return ours

    def spawn(self, args: tuple[int, int, bool, str], child_fd: int) -> tuple[int, int]:
        """Fork a backend process given ``child_fd`` (its end of the pipe): its pid and the
        read end of its status pipe."""
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                control = self._ensure_running()
                socket.send_fds(control, [pickle.dumps(args)], [child_fd, status_w])
            os.close(status_w)
            status_w = -1
            data = _read_exact(status_r, _PID.size)
            if data is None:
                raise OSError(f"the fork server of {self.name} ended before it started a process")
            return _PID.unpack(data)[0], status_r
        except BaseException:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
            raise

    def stop(self) -> None:
        """Close the control socket (the fork server exits) and reap the fork server."""
        with self._lock:
            if self._control is not None:
                self._control.close()
                self._control = None
            process, self._process = self._process, None
        if process is not None:
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _read_exact(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class EnvProcess:
    """A backend process forked by an environment's fork server, as much of
    :class:`multiprocessing.Process` as :class:`~mmserver.backend.process.BackendProcess`
    uses."""

    def __init__(self, server: EnvForkServer, args: tuple[Any, ...], name: str) -> None:
        self._server = server
        conn, *rest = args
        self._conn: multiprocessing.connection.Connection = conn
        self._args: tuple[int, int, bool, str] = (rest[0], rest[1], rest[2], rest[3])
        self.name = name
        self.pid: int | None = None
        self._status = -1
        self._exitcode: int | None = None

    def start(self) -> None:
        self.pid, self._status = self._server.spawn(self._args, self._conn.fileno())

    def _poll(self, timeout: float | None) -> int | None:
        if self._exitcode is None and self._status >= 0:
            ready, _, _ = select.select([self._status], [], [], timeout)
            if ready:
                data = _read_exact(self._status, _PID.size)
                # A fork server that died leaves its processes unreaped: they count as ended.
                self._exitcode = _PID.unpack(data)[0] if data is not None else -signal.SIGKILL
                os.close(self._status)
                self._status = -1
        return self._exitcode

    @property
    def exitcode(self) -> int | None:
        return self._poll(0)

    def is_alive(self) -> bool:
        return self.pid is not None and self._poll(0) is None

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout)

    def kill(self) -> None:
        if self.pid is not None and self._poll(0) is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class EnvContext:
    """What a process slot asks its context for (``Pipe``, ``Process``), for the processes of
    one environment."""

    def __init__(self, server: EnvForkServer) -> None:
        self.server = server

    @staticmethod
    def Pipe(  # multiprocessing's name
        duplex: bool = True,
    ) -> tuple[multiprocessing.connection.Connection, multiprocessing.connection.Connection]:
        return multiprocessing.Pipe(duplex)

    def Process(  # multiprocessing's name
        self,
        target: Callable[..., Any],
        args: tuple[Any, ...],
        name: str,
        daemon: bool = True,
    ) -> EnvProcess:
        """A process running ``target`` (the backend's :func:`child_main`: the fork server runs
        it, whatever is passed) with ``args``."""
        return EnvProcess(self.server, args, name)
