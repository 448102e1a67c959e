"""HAProxy's runtime API on the cluster's admin socket (``stats socket`` in the global section:
a file socket in the state directory, mode 600, admin level): what a rolling restart takes an
instance out of the balancer and puts it back with.

Each call is one connection and one command; HAProxy answers and closes. A server's
administrative state (``set server instances/iN state ...``):

- ``ready`` — it takes requests (when its health checks pass);
- ``drain`` — it takes no new request; the requests it holds finish; its health checks go on,
  so HAProxy still sees it go down and come back up;
- ``maint`` — as ``drain``, and its health checks stop.
"""

from __future__ import annotations

import enum
import socket
from pathlib import Path

from mmserver.commands.cluster.balancer import BACKEND, backend_rows

#: The longest admin socket path: a file socket's path holds at most 107 bytes, and HAProxy
#: binds ``PATH.PID.tmp`` first, then renames it.
MAX_SOCKET_PATH = 107 - len(".4194304.tmp")
TIMEOUT_S = 5.0


class ServerState(enum.Enum):
    READY = "ready"
    DRAIN = "drain"
    MAINT = "maint"


class RuntimeApiError(RuntimeError):
    """HAProxy refused a command, or its admin socket could not be reached."""


class RuntimeApi:
    """The runtime API of one HAProxy on its admin socket ``path``, for the servers of
    ``backend``."""

    def __init__(self, path: Path, backend: str = BACKEND, timeout: float = TIMEOUT_S) -> None:
        self.path = path
        self.backend = backend
        self.timeout = timeout

    def command(self, line: str) -> str:
        """Send one command; HAProxy's whole answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
                sock.sendall(line.encode() + b"\n")
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            except OSError as exc:
                raise RuntimeApiError(
                    f"HAProxy's runtime API on {self.path}: {line!r} failed: {exc}"
                ) from None
        return b"".join(chunks).decode(errors="replace")

    def set_state(self, server: str, state: ServerState) -> None:
        """Set ``server``'s administrative state; raise with HAProxy's answer if refused."""
        line = f"set server {self.backend}/{server} state {state.value}"
        answer = self.command(line).strip()
        if answer:
            raise RuntimeApiError(f"HAProxy refused {line!r}: {answer}")

    def servers(self) -> dict[str, dict[str, str]]:
        """The backend's servers as ``show stat`` gives them, by name (``status``: ``UP``,
        ``DOWN``, ``DRAIN``, ``MAINT``...; ``scur``: the requests it holds now)."""
        return backend_rows(self.command("show stat"))

    def server(self, name: str) -> dict[str, str]:
        row = self.servers().get(name)
        if row is None:
            raise RuntimeApiError(f"HAProxy has no server {self.backend}/{name}")
        return row
