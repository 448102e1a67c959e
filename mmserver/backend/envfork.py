"""The fork server of one model environment, run by that environment's interpreter
(``python -c "from mmserver.backend.envfork import main; main(FD)"``, mmserver's package on its
path, not installed).

It imports the libraries the environment has once (scikit-learn and what else of
:data:`PRELOAD` imports there), then forks a backend process (:func:`child_main`) for each
request on its control socket: a request is a pickle of ``(index, nice, idle, lane)`` with two
file descriptors, the process's end of its pipe to the frontend and a status pipe. The status
pipe gets the process's pid (8 bytes) once it is forked, and its exit code (8 bytes, signed:
``-N`` for a signal) once it has ended and been reaped, as multiprocessing's fork server tells
its processes' ends. The fork server exits when the frontend closes the control socket.

Only the standard library, NumPy and what the model's requirements bring may be imported here:
the environment has nothing else.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.connection
import os
import pickle
import select
import signal
import socket
import struct
import sys

#: Imported once here and shared copy-on-write by the environment's backend processes (each
#: skipped where the environment lacks it).
PRELOAD = (
    "mmserver.backend.child",
    "mmserver.execution.predictor",
    "joblib",
    "sklearn",
    "sklearn.ensemble",
    "sklearn.linear_model",
    "sklearn.pipeline",
    "sklearn.preprocessing",
    "sklearn.tree",
    "xgboost",
    "lightgbm",
)

_PID = struct.Struct("q")


def main(control_fd: int) -> None:
    """Serve the control socket ``control_fd`` until the frontend closes it."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle("mmserver: environment fork server")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status: dict[int, int] = {}  # pid -> its status pipe
    while True:
        try:
            ready, _, _ = select.select([control.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(status)
        if control.fileno() not in ready:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 16, 2)
        except OSError:
            message, fds = b"", []
        if not message:
            return
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        child_fd, status_fd = fds
        args = pickle.loads(message)
        pid = os.fork()
        if pid == 0:
            _child(control, (wake_r, wake_w), status_fd, child_fd, args)
        os.close(child_fd)
        status[pid] = status_fd
        _write(status_fd, pid)


def _child(
    control: socket.socket,
    wake: tuple[int, int],
    status_fd: int,
    child_fd: int,
    args: tuple[int, int, bool, str],
) -> None:
    """In the forked process: the backend's message loop; never returns."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        control.close()
        for fd in (*wake, status_fd):
            os.close(fd)
        from mmserver.backend.child import child_main

        child_main(multiprocessing.connection.Connection(child_fd), *args)
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(status: dict[int, int]) -> None:
    """Tell the frontend the exit code of every process that has ended."""
    while status:
        try:
            pid, waited = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status.pop(pid, None)
        if fd is not None:
            _write(fd, os.waitstatus_to_exitcode(waited))
            os.close(fd)


def _write(fd: int, value: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, _PID.pack(value))
