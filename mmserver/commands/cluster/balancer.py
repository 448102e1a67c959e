"""The routing strategies, the HAProxy configuration made from ``haproxy.cfg.in``, and the
HAProxy process (in the foreground, a child of the cluster).

Strategies, named as SageMaker's ``RoutingStrategy``:

- ``RANDOM`` — ``balance random(1)``: one uniform draw per request. HAProxy's plain
  ``balance random`` is ``random(2)``, the power of two choices (the less loaded of two
  random servers), which is already a load-aware strategy;
- ``LEAST_OUTSTANDING_REQUESTS`` — ``balance leastconn``. In HTTP mode HAProxy counts a server's
  load as its requests in flight plus those queued for it (one stream per request), not its
  TCP connections: a kept-alive client connection between two requests, or an idle pooled
  connection to a server, counts for nothing. So the default ``http-reuse safe`` is kept;
  ``option http-server-close`` or ``http-reuse never`` would add a connection per request and
  change nothing in the choice;
- ``MODEL_AFFINITY`` — consistent hashing on the request's model (the
  ``X-Amzn-SageMaker-Target-Model`` header, the ``model_name`` query parameter of
  ``/invocations``, or the model in ``/predictions/{model}`` and ``/models/{model}/invoke``;
  ``NAME.tar.gz`` and ``NAME`` are one model) with bounded loads (``hash-balance-factor``): a
  model stays on the one instance that has it loaded until that instance holds more than
  factor % of the average load; then its requests go on to the next instance on the ring.
  Requests naming no model are balanced round robin.
"""

from __future__ import annotations

import csv
import enum
import io
import json
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Template

from mmserver.commands.launch import GRACE_S, Child, Stopped, http_get, wait_until
from mmserver.commands.procfs import HOST
from mmserver.errors import NotFound, Unauthorized

TEMPLATE = Path(__file__).resolve().parent / "haproxy.cfg.in"
BACKEND = "instances"
HARD_STOP_AFTER_S = 40


class Strategy(enum.Enum):
    RANDOM = "RANDOM"
    LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
    MODEL_AFFINITY = "MODEL_AFFINITY"


# Where the model of a request is, in the order mmserver itself reads it; then "NAME.tar.gz"
# and "NAME.tgz" become "NAME", so both spellings of a model go to the same instance.
_SET = "    http-request set-var(txn.model) "
_MODEL_RULES = "".join(
    line + "\n"
    for line in (
        "    acl has_model var(txn.model) -m found",
        _SET + "req.hdr(X-Amzn-SageMaker-Target-Model)",
        _SET + "url_param(model_name) if !has_model { path /invocations }",
        _SET + "path,field(3,/) if { path_beg /predictions/ }",
        _SET + "path,field(3,/) if { path_beg /models/ } { path_end /invoke }",
        _SET + """'var(txn.model),regsub("^(.+)[.](tar[.]gz|tgz)$","\\1")' if has_model""",
    )
)


def balance_block(strategy: Strategy, hash_balance_factor: int) -> str:
    if strategy is Strategy.RANDOM:
        return "    balance random(1)"
    if strategy is Strategy.LEAST_OUTSTANDING_REQUESTS:
        return "    balance leastconn"
    return (
        _MODEL_RULES
        + "    balance hash var(txn.model)\n"
        + "    hash-type consistent\n"
        + f"    hash-balance-factor {hash_balance_factor}"
    )


@dataclass(frozen=True)
class BalancerSpec:
    """One HAProxy: its strategy, where it listens, and the instances behind it."""

    strategy: Strategy
    port: int
    stats_port: int
    servers: tuple[tuple[str, str, int], ...]  # (name, host, port)
    hash_balance_factor: int = 150
    check_inter_ms: int = 500
    bind: str = HOST
    stats_bind: str = HOST
    #: When set, HAProxy itself answers 401 to a management call without
    #: ``Authorization: Bearer <token>`` (:func:`management_rules`).
    management_token: str = ""
    #: When set, HAProxy's runtime API listens on this file socket (mode 600, admin level):
    #: what a rolling restart takes an instance out and puts it back with
    #: (:mod:`mmserver.commands.cluster.runtime`).
    admin_socket: str = ""
    #: When true, HAProxy itself answers 404 to the asynchronous inference paths
    #: (:func:`asynchronous_rules`): instances with a ``state_dir`` each would keep a journal
    #: of their own, and a request's state would be known to one instance only.
    refuse_asynchronous: bool = False


#: The calls anyone may make through a balancer that checks the management token: reads (GET,
#: HEAD), and POST on an inference path whose names are plain (no dot segment, no
#: percent-encoding, so that no spelling of a management path passes for one of these).
_NAME = "[A-Za-z0-9_~-][A-Za-z0-9_.~-]*"
_INFERENCE_PATH = (
    f"^/(predictions/{_NAME}|invocations|endpoints/{_NAME}/invocations|models/{_NAME}/invoke"
    f"|v2/models/{_NAME}(/versions/{_NAME})?/infer|v2/repository/index)$"
)
#: What a management token may hold to be written into the configuration as it is.
TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,256}")


def management_rules(token: str) -> str:
    """Frontend rules answering 401, as mmserver would, every call but a read or an inference
    request that lacks ``Authorization: Bearer <token>``: the instances behind the balancer
    decide by their own (loopback) address, and would take management calls from anyone."""
    if not token:
        return ""
    if not TOKEN.fullmatch(token):
        raise ValueError(
            "the management token must be 1-256 characters of A-Z a-z 0-9 . _ ~ + / = -"
        )
    body = json.dumps(
        Unauthorized(
            "this management call needs the header 'Authorization: Bearer <management token>'"
        ).to_dict()
    )
    quoted = _quoted(body)
    return (
        "    # Management calls need the token here: the instances decide by their own address.\n"
        "    acl open_call method GET HEAD\n"
        f"    acl open_call path_reg {_INFERENCE_PATH}\n"
        f'    acl has_token req.hdr(authorization) -m str "Bearer {token}"\n'
        "    http-request return status 401 content-type application/json "
        f'string "{quoted}" if !open_call !has_token\n'
    )


#: The paths of asynchronous inference, ``InvokeEndpointAsync`` and a request's state, matched
#: on the decoded path, whatever the slashes.
_ASYNC_PATH = "^/+(endpoints/+[^/]+/+async-invocations|async-invocations(/[^/]*)?)/*$"


def asynchronous_rules(refuse: bool) -> str:
    """A frontend rule answering 404, as a server without a ``state_dir`` would, on the
    asynchronous inference paths."""
    if not refuse:
        return ""
    body = json.dumps(
        NotFound(
            "asynchronous inference is not served through mmserver cluster: each instance "
            "would keep a journal of its own; serve it with mmserver serve and a state_dir"
        ).to_dict()
    )
    return (
        "    # Asynchronous inference needs one journal; each instance keeps its own state_dir.\n"
        f"    http-request return status 404 content-type application/json "
        f'string "{_quoted(body)}" if {{ path,url_dec -m reg {_ASYNC_PATH} }}\n'
    )


def _quoted(text: str) -> str:
    """``text`` inside double quotes of HAProxy's configuration."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render(spec: BalancerSpec) -> str:
    """The configuration text for ``spec``; servers get ids 1..N in order, so every balancer
    given the same list hashes a model to the same server."""
    servers = "\n".join(
        f"    server {name} {host}:{port} id {i}"
        for i, (name, host, port) in enumerate(spec.servers, 1)
    )
    return Template(TEMPLATE.read_text()).substitute(
        strategy=spec.strategy.value,
        count=len(spec.servers),
        hard_stop_after=f"{HARD_STOP_AFTER_S}s",
        admin_socket=(
            f"    # The runtime API, for rolling restarts (mmserver cluster restart).\n"
            f"    stats socket {spec.admin_socket} mode 600 level admin\n"
            if spec.admin_socket
            else ""
        ),
        asynchronous=asynchronous_rules(spec.refuse_asynchronous),
        bind=spec.bind,
        port=spec.port,
        management=management_rules(spec.management_token),
        balance=balance_block(spec.strategy, spec.hash_balance_factor),
        inter_ms=spec.check_inter_ms,
        fastinter_ms=max(100, spec.check_inter_ms // 2),
        servers=servers,
        stats_bind=spec.stats_bind,
        stats_port=spec.stats_port,
    )


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).is_file()), None
    )
    if found is None:
        raise RuntimeError(
            "haproxy is not installed (Debian: apt-get install haproxy; scripts/cluster "
            "installs it when apt-get is there)"
        )
    return found


def check_config(path: Path) -> None:
    """``haproxy -c``: raise with HAProxy's message when the file is not valid."""
    result = subprocess.run(
        [haproxy_binary(), "-c", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"invalid HAProxy configuration {path}:\n{result.stderr.strip()}")


def server_stats(stats_port: int) -> dict[str, dict[str, str]]:
    """The stats page's CSV rows of the backend's servers, by server name (``status`` is
    ``UP``, ``DOWN``, ``UP 1/2``...; ``scur`` requests in flight; ``stot`` requests so far)."""
    status, body = http_get(stats_port, "/stats;csv")
    if status != 200:
        return {}
    return backend_rows(body.decode())


def backend_rows(text: str) -> dict[str, dict[str, str]]:
    """The rows of the backend's servers in HAProxy's CSV statistics (the stats page's
    ``;csv``, the runtime API's ``show stat``), by server name."""
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {
        row["svname"]: row
        for row in rows
        if row["pxname"] == BACKEND and row["svname"] not in ("FRONTEND", "BACKEND")
    }


class Balancer(Child):
    """``haproxy -f CONFIG -db``: HAProxy in the foreground, a child process in its own
    session; its messages (server state changes, failed requests) go to ``log_path``."""

    def __init__(self, spec: BalancerSpec, config_path: Path, log_path: Path) -> None:
        super().__init__(
            ["haproxy", "-f", str(config_path), "-db"],
            log_path,
            label="haproxy",
            port=spec.port,
            new_session=True,
        )
        self.spec = spec
        self.config_path = config_path

    def start(self, timeout: float = 30.0) -> None:
        """Write and check the configuration, start HAProxy, and wait until it answers
        ``/ping`` and its health checks have seen every instance up."""
        self.config_path.write_text(render(self.spec))
        check_config(self.config_path)
        self.argv[0] = haproxy_binary()
        super().start()

        def ready() -> bool:
            stats = server_stats(self.spec.stats_port)
            return (
                len(stats) == len(self.spec.servers)
                and all(row["status"] == "UP" and row["check_status"] for row in stats.values())
                and http_get(self.spec.port, "/ping")[0] == 200
            )

        wait_until(ready, self.failure, timeout, f"haproxy on port {self.spec.port}", self.log_tail)

    def stop(
        self,
        timeout: float = HARD_STOP_AFTER_S + 5,
        *,
        signum: int = signal.SIGUSR1,
        grace_s: float = GRACE_S,
    ) -> Stopped:
        """Soft stop (SIGUSR1): stop listening, let the requests in flight finish, exit."""
        return super().stop(timeout, signum=signum, grace_s=grace_s)
