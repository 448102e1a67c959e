"""Configuration: the server's global options, and (from :mod:`mmserver.config.model`) each
model's settings.

Every global option is declared once, as a field of :class:`ServerConfig` with its help text in
the field's metadata; an option that is every model's default (``batch_size``...) is declared
once as a :class:`ModelConfig` field, and its :class:`ServerConfig` field takes its default and
help from there (:func:`~mmserver.config.model.server_option`). The command-line flags
(``--max-workers``), the environment variables (``MMSERVER_MAX_WORKERS``) and the properties-file
keys (``max_workers``) all derive from the :class:`ServerConfig` fields. Precedence, lowest
first: defaults < ``--config FILE`` < environment < flags.

Per model, :func:`load_model_config` reads ``serving.properties`` (DJL's key names and units) over
the global defaults; a management call overrides both through :meth:`ModelConfig.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.config.envs import EnvOptions
from mmserver.config.model import (
    LEAST,
    MAX_BATCH_DELAY_MS,
    METHODS,
    PROPERTIES_FILE,
    RESCALABLE,
    SERVER_DEFAULTS,
    SKEW_CHOICES,
    ModelConfig,
    cpu_count,
    default_cpus,
    load_model_config,
    model_config_from_properties,
    out_of_order,
    server_option,
    short_of,
)
from mmserver.config.peers import parse_peers
from mmserver.config.sources import ENV_PREFIX, read_sources
from mmserver.config.trust import Trust, model_patterns, server_trust
from mmserver.errors import ConfigError
from mmserver.ops import capacity
from mmserver.ops.capacity import Limit
from mmserver.ops.metrics import MODEL_LABEL_CHOICES
from mmserver.store.properties import BOOLEANS, boolean, parse_properties, read_properties
from mmserver.store.urls import check_location, split_object_url

__all__ = [
    "BOOLEANS",
    "ENV_PREFIX",
    "MAX_BATCH_DELAY_MS",
    "METHODS",
    "PROPERTIES_FILE",
    "RESCALABLE",
    "ModelConfig",
    "ServerConfig",
    "boolean",
    "cpu_count",
    "default_cpus",
    "load_model_config",
    "model_config_from_properties",
    "parse_properties",
    "read_properties",
    "resolves_to_loopback",
]

log = logging.getLogger(__name__)


@functools.cache
def resolves_to_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (``False`` when it does
    not resolve). Resolved once per name: the answer decides who may manage the server."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    try:
        return bool(addresses) and all(
            ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses
        )
    except ValueError:
        return False


#: Workers one model may have per backend process (:attr:`ServerConfig.worker_limit`).
WORKERS_PER_BACKEND = 16


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


#: Server options whose least value is above their models' (a model may have maxWorkers=0, a
#: server's default for every model may not).
_SERVER_LEAST = {"max_workers": 1}


@dataclass(frozen=True)
class ServerConfig(EnvOptions):
    """The server's global options. Frozen; validated when built."""

    model_store: str = _opt(
        "./model_store",
        "Directory holding the models (NAME/ or NAME.tar.gz), or s3://bucket/prefix of "
        "NAME.tar.gz objects.",
    )
    host: str = _opt("127.0.0.1", "Address to bind. Any non-loopback address needs a token.")
    port: int = _opt(8080, "Port to bind (inference, management, health and metrics).")
    grpc_port: int = _opt(
        0,
        "Port serving the Open Inference Protocol over gRPC (KServe V2, tritonclient.grpc) on "
        "host; 0 = none. 8081 is KServe's and MLServer's.",
    )
    load_models: str = _opt("NONE", "Models to load at start: ALL, NONE or a comma-separated list.")
    pinned_models: str = _opt(
        "",
        "Glob patterns (comma-separated) of model names loaded at start and never evicted: their "
        "memory is counted first, and a set that does not fit the budget or max_loaded_models "
        "stops the start. PUT /models/NAME?pinned=true pins one more while the server runs.",
    )
    backend_processes: int = _opt(
        cpu_count(),
        "Backend processes running predictions; 0 runs them in threads (development). The "
        "default is the CPUs the container may use: its cgroup CPU quota (cpu.max), capped by "
        "the CPU affinity mask.",
    )
    heavy_processes: int = _opt(
        cpu_count(),
        "Backend processes of the heavy lane, started when a model first needs one: models "
        "whose requests take more than heavy_batch_ms of CPU run there, at a lower CPU "
        "priority, so they cannot slow the others down; 0 = one lane for every model.",
    )
    heavy_batch_ms: float = _opt(
        2.0,
        "CPU ms one request of a model takes (its measured fixed part and rows, at its mean "
        "rows per request) above which the model moves to the heavy lane; it moves back below "
        "half of it.",
    )
    heavy_nice: int = _opt(
        5,
        "Nice value of the heavy lane's processes (1-19; higher yields more to the others). "
        "A weight, not a last place: at 5 a busy heavy process gets about a quarter of a CPU "
        "it shares with one light process, so a heavy model is never starved by light traffic.",
    )
    heavy_sched_idle: bool = _opt(
        False,
        "Run the heavy lane's processes under Linux's SCHED_IDLE instead of at heavy_nice: any "
        "other work runs first, so light traffic that keeps every CPU busy starves the heavy "
        "models (and so does any other program on the machine).",
    )
    heavy_reserved_cpus: int = _opt(
        1,
        "CPUs the heavy lane's processes keep off while light models have work (they get them "
        "back 0.2 to 0.4 s after the light models' last batch); at most all but one of the "
        "CPUs of the server's affinity mask; 0 = none.",
    )
    min_workers: int = server_option("min_workers")
    max_workers: int = server_option("max_workers")
    batch_size: int = server_option("batch_size")
    max_batch_delay: int = server_option("max_batch_delay")
    max_batch_bytes: int = server_option("max_batch_bytes")
    max_idle_time: int = server_option("max_idle_time")
    job_queue_size: int = server_option("job_queue_size")
    max_loaded_models: int = _opt(0, "Most models loaded at once; 0 = no limit but memory.")
    max_memory_mb: int = _opt(
        0,
        "Memory budget for loaded models in MiB; 0 = 80% of the container's memory limit "
        "(cgroup memory.max) less what the server uses, or of the available memory without one.",
    )
    max_request_size: int = _opt(6 * 1024 * 1024, "Largest request body in bytes.")
    predict_timeout: float = server_option("predict_timeout")
    keepalive_timeout: float = _opt(
        75.0,
        "s an idle keep-alive connection stays open; longer than the 60 s idle timeout of "
        "common load balancers, so that the balancer closes first (0 = close after each answer).",
    )
    header_timeout: float = _opt(
        10.0,
        "s a client has to send a request's headers once it has begun (slow clients); the "
        "connection is then answered 408 and closed.",
    )
    body_timeout: float = _opt(
        60.0,
        "s a client has to send a request's body; it is then answered 408 and the "
        "connection closed.",
    )
    send_timeout: float = _opt(
        60.0,
        "s a client has to take an answer larger than the socket's buffer; the connection "
        "is then dropped and the answer freed, so a client that never reads holds no memory.",
    )
    max_connections: int = _opt(
        0,
        "Open HTTP connections at most; a connection past it is answered 503 and closed. "
        "0 = the file-descriptor limit minus 256 (kept for backends, archives and scrapes).",
    )
    management_token: str = _opt("", "Bearer token required by POST/PUT/DELETE on /models.")
    tenants: str = _opt(
        "",
        "YAML file of the tenants: each one's model name patterns, SigV4 access keys and bearer "
        "tokens, rate and requests in flight. Set: every inference and listing call needs a "
        "tenant's credentials or the management token. Read again on SIGHUP and when it "
        "changes; empty = no tenants, every caller serves every model.",
    )
    metrics_token: str = _opt(
        "",
        "Bearer token GET /metrics takes besides the management token when tenants are "
        "configured (a scraper's); without tenants /metrics is open.",
    )
    allowed_model_roots: str = _opt(
        "", "Comma-separated directories POST /models may load from; empty = the model store."
    )
    cache_dir: str = _opt(
        "",
        "Where archives are unpacked; empty = <model_store>/.mmserver-cache, or for an "
        "s3:// store ~/.cache/mmserver/<bucket>/<prefix hash>.",
    )
    store_index_max_age: float = _opt(
        10.0,
        "s the listing of an s3:// store is kept before it is read again (a local store "
        "is read again when its directory changes); a request's lookup is never cached.",
    )
    max_archive_mb: int = _opt(
        1024, "Largest size of one model archive, unpacked (and downloaded), in MiB."
    )
    max_cache_mb: int = _opt(
        0,
        "Disk budget of the cache of an s3:// store in MiB, least recently used models "
        "removed first; 0 = no limit.",
    )
    drain_timeout: float = _opt(30.0, "s SIGTERM waits for accepted requests before stopping.")
    peers: str = _opt(
        "",
        "The other instances behind the same balancer, which a management call applied here is "
        "sent on to: host:port,host:port, or dns:NAME:PORT for every address NAME resolves to "
        "(a headless Service); a new instance takes the versions' rollouts from them. Empty = "
        "none.",
    )
    state_dir: str = _opt(
        "",
        "Folder of the asynchronous inference journal (SQLite in WAL mode) and of the inline "
        "inputs it holds, of the default versions set through the management API "
        "(rollouts.json), and of the warm set (warm.json: the models loaded, loaded again at "
        "the next start); empty = no asynchronous inference (POST .../async-invocations is "
        "answered 404), no warm set, and the default versions are kept in cache_dir.",
    )
    warm_ready_timeout: float = _opt(
        0.0,
        "s the server answers not ready (/ping, /v2/health/ready and gRPC's ServerReady) at "
        "start while it loads its warm set again (with a state_dir), at most; 0 = ready while "
        "it does.",
    )
    async_output_path: str = _opt(
        "",
        "Where asynchronous answers are written (<inference id>.out): a local folder or "
        "s3://bucket/prefix; empty = <state_dir>/outputs. A model's serving.properties may "
        "override it (option.async_output_path).",
    )
    async_failure_path: str = _opt(
        "",
        "Where asynchronous failures are written (<inference id>-error.out): a local folder "
        "or s3://bucket/prefix; empty = async_output_path (option.async_failure_path per "
        "model).",
    )
    async_input_roots: str = _opt(
        "",
        "Comma-separated folders a file:// InputLocation may name, besides allowed_model_roots.",
    )
    async_max_queued: int = _opt(
        10000,
        "Asynchronous requests accepted and not yet ended, at most; past it a new one is "
        "answered 429 with Retry-After.",
    )
    async_notify_url: str = _opt(
        "",
        "URL POSTed a JSON notification when an asynchronous request ends (retried with "
        "backoff); empty = none.",
    )
    async_max_workers: int = server_option("async_max_workers")
    capture_path: str = _opt(
        "",
        "Where sampled requests and answers are written in SageMaker's data capture format "
        "(JSON lines, a file per model, version and hour): a local folder or "
        "s3://bucket/prefix; empty = no capture. A model's option.capture_percent is its share.",
    )
    capture_buffer: int = _opt(
        10000,
        "Captured records waiting to be written, at most; past it a record is dropped and "
        "counted (mmserver_capture_dropped_total), never an answer slowed.",
    )
    trusted_types: str = _opt(
        "",
        "Importable names (module.Name, comma-separated) every model's pickle or skops file may "
        "use beside the types scikit-learn, NumPy, SciPy, pandas, XGBoost and LightGBM models "
        "are made of.",
    )
    trusted_models: str = _opt(
        "",
        "Glob patterns (comma-separated) of model names whose files are fully trusted: any "
        "pickle global and a model.py custom handler, in backend processes of their own. "
        "* trusts every model; none by default.",
    )
    on_version_skew: str = _opt(
        "refuse",
        "What a pickle made by another minor version of scikit-learn than the server's gets: "
        "refuse (its load fails, naming both versions), warn (served as this version reads "
        "it, its versions shown in GET /models/NAME and counted in /metrics) or env (served "
        "in an environment with the version that made it).",
    )
    isolate_trusted: bool = _opt(
        True,
        "Run each model trusted_models names in a backend process of its own (its code then "
        "never shares a process with another model); off: trusted models share the backend "
        "processes, for a store whose every model its operator wrote.",
    )
    insecure_management: bool = _opt(
        False, "Allow an open management API on a non-loopback address without a token."
    )
    metrics_model_label: str = _opt(
        "requests",
        "Which metric families carry the model label, for each loaded model: all (about 65 "
        "series a model), requests (mmserver_requests_total only, one series a status code) "
        "or none; the others count every model together.",
    )
    lean_http: bool = _opt(
        True,
        "Answer plain inference requests (POST on the DJL, SageMaker and Open Inference "
        "Protocol paths, whole in one read) without aiohttp's request objects; off: aiohttp "
        "serves every request.",
    )
    access_log: bool = _opt(False, "Log one line per request (off: it costs on the hot path).")
    log_level: str = _opt("INFO", "Logging level.")
    log_format: str = _opt(
        "text",
        "text (one line a record) or json (one JSON object a line: time, level, logger, "
        "message, and model and request_id where a record has them).",
    )
    unknown_options: str = _opt(
        "refuse",
        "refuse: an option the server does not know in --config, or an MMSERVER_* variable "
        "close to a known option's, stops the start with the closest known name; warn: it is "
        "logged and ignored.",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                if value != value:
                    raise ConfigError(f"option {f.name}={value!r}: must be a number")
                if (why := short_of(value, 0)) is not None:
                    raise ConfigError(f"option {f.name}={value!r}: {why}")
        for name, least in {**LEAST, **_SERVER_LEAST}.items():
            if name in SERVER_DEFAULTS and (why := short_of(getattr(self, name), least)):
                raise ConfigError(f"option {name}={getattr(self, name)!r}: {why}")
        order = out_of_order("min_workers", self.min_workers, "max_workers", self.max_workers)
        if order is not None:
            raise ConfigError(f"option {order}")
        try:
            check_location(self.capture_path)
        except ConfigError as exc:
            raise ConfigError(f"option capture_path: {exc.message}") from None
        if (why := short_of(self.capture_buffer, 1)) is not None:
            raise ConfigError(f"option capture_buffer={self.capture_buffer}: {why}")
        if self.state_dir:
            for name in ("async_output_path", "async_failure_path"):
                try:
                    check_location(getattr(self, name))
                except ConfigError as exc:
                    raise ConfigError(f"option {name}: {exc.message}") from None
        if not 0 < self.heavy_nice < 20:
            raise ConfigError(f"option heavy_nice={self.heavy_nice}: must be between 1 and 19")
        if not 0 < self.port < 65536:
            raise ConfigError(f"option port={self.port}: must be between 1 and 65535")
        if self.grpc_port > 65535 or self.grpc_port == self.port:
            raise ConfigError(
                f"option grpc_port={self.grpc_port}: must be between 1 and 65535 and not port "
                "(0 = no gRPC)"
            )
        model_patterns("pinned_models", self.pinned_models)
        if self.peers.strip():
            parse_peers(self.peers)
        self.check_envs()
        if self.metrics_model_label not in MODEL_LABEL_CHOICES:
            raise ConfigError(
                f"option metrics_model_label={self.metrics_model_label!r}: must be one of "
                f"{', '.join(MODEL_LABEL_CHOICES)}"
            )
        if self.on_version_skew not in SKEW_CHOICES:
            raise ConfigError(
                f"option on_version_skew={self.on_version_skew!r}: must be one of "
                f"{', '.join(SKEW_CHOICES)}"
            )
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ConfigError(f"option log_level={self.log_level!r}: not a logging level")
        for name, choices in (("log_format", LOG_FORMATS), ("unknown_options", UNKNOWN_OPTIONS)):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"option {name}={getattr(self, name)!r}: must be one of {', '.join(choices)}"
                )
        scheme = _URL_SCHEME.match(self.model_store.strip())
        if scheme is not None and scheme.group(1).lower() != "s3":
            raise ConfigError(
                f"option model_store={self.model_store!r}: only a local directory or "
                "s3://bucket/prefix is supported"
            )
        if self.store_url is not None:
            try:
                split_object_url(self.store_url)
            except ConfigError as exc:
                raise ConfigError(f"option model_store: {exc.message}") from None
        self.trust  # noqa: B018  # the trust options are checked where they are read
        too_many = self.check_workers(self.min_workers, self.max_workers)
        if too_many is not None:
            raise ConfigError(f"option {too_many}")
        try:
            self.model_defaults()  # every model starts from these: they must make a valid one
        except ConfigError as exc:
            raise ConfigError(f"option {exc.message}") from None

    # Derived values ---------------------------------------------------------------------------

    @property
    def store_url(self) -> str | None:
        """``model_store`` when it is an ``s3://bucket/prefix`` URL, else ``None``."""
        text = self.model_store.strip()
        return text if text[:5].lower() == "s3://" else None

    @property
    def store_path(self) -> Path:
        """The local store directory (not defined for an ``s3://`` store)."""
        if self.store_url is not None:
            raise ConfigError(f"model store {self.store_url} is not a local directory")
        return Path(self.model_store).expanduser().resolve()

    @property
    def cache_path(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser().resolve()
        if self.store_url is not None:
            bucket, prefix = split_object_url(self.store_url)
            # One folder per store, so that two stores of one machine never share copies.
            key = hashlib.sha256(prefix.encode()).hexdigest()[:16]
            base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
            return Path(base).expanduser().resolve() / "mmserver" / bucket / key
        return self.store_path / ".mmserver-cache"

    @property
    def async_enabled(self) -> bool:
        """Whether the server takes asynchronous requests (it has a ``state_dir``)."""
        return bool(self.state_dir.strip())

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser().resolve()

    @property
    def async_outputs(self) -> str:
        """Where asynchronous answers go: ``async_output_path``, or ``<state_dir>/outputs``."""
        return self.async_output_path.strip() or str(self.state_path / "outputs")

    @property
    def async_failures(self) -> str:
        """Where asynchronous failures go: ``async_failure_path``, or the answers' place."""
        return self.async_failure_path.strip() or self.async_outputs

    @property
    def async_input_paths(self) -> tuple[Path, ...]:
        """The folders a ``file://`` input may be read from."""
        extra = [r.strip() for r in self.async_input_roots.split(",") if r.strip()]
        return (*self.allowed_roots, *(Path(r).expanduser().resolve() for r in extra))

    @property
    def allowed_roots(self) -> tuple[Path, ...]:
        """Where ``POST /models`` may load from; by default the local store, and nothing for an
        ``s3://`` store."""
        roots = [r.strip() for r in self.allowed_model_roots.split(",") if r.strip()]
        if not roots:
            return () if self.store_url is not None else (self.store_path,)
        return tuple(Path(r).expanduser().resolve() for r in roots)

    def memory_budget(self, own_bytes: int) -> Limit:
        """The memory budget for loaded models, in MiB, and where it came from: the option, or
        80 % of the container's memory limit (or of the host's available memory) less
        ``own_bytes``, what the server's processes hold already."""
        if self.max_memory_mb:
            return Limit(self.max_memory_mb, "option max_memory_mb")
        return capacity.memory_budget(own_bytes)

    def backend_processes_source(self) -> str:
        """Where ``backend_processes`` came from, for the log line at start."""
        detected = default_cpus()
        if self.backend_processes == detected.value:
            return detected.source
        return "option backend_processes"

    @property
    def worker_limit(self) -> int:
        """The most workers one model may have: :data:`WORKERS_PER_BACKEND` per backend process
        (at least 64). A process runs one batch at a time, so more workers only wait."""
        slots = self.backend_processes + (self.heavy_processes if self.backend_processes else 0)
        return max(64, WORKERS_PER_BACKEND * max(1, slots))

    def check_workers(self, min_workers: int, max_workers: int) -> str | None:
        """Why ``minWorkers``/``maxWorkers`` pass :attr:`worker_limit` (``None`` when they do
        not)."""
        limit = self.worker_limit
        for key, value in (("minWorkers", min_workers), ("maxWorkers", max_workers)):
            if value > limit:
                return (
                    f"{key}={value} is over the limit of {limit} workers per model "
                    f"({WORKERS_PER_BACKEND} per backend process: a process runs one batch "
                    "at a time, so more workers would only wait)"
                )
        return None

    @property
    def is_loopback(self) -> bool:
        """Whether ``host`` resolves to loopback addresses only (a name is resolved: a name
        that looks local may point elsewhere)."""
        return resolves_to_loopback(self.host)

    def model_defaults(self) -> ModelConfig:
        """Per-model defaults taken from the global options."""
        return ModelConfig(
            **{name: getattr(self, name) for name in SERVER_DEFAULTS},
            trust=self.trust,
            on_version_skew=self.on_version_skew,
        )

    @functools.cached_property
    def pinned(self) -> tuple[str, ...]:
        """The ``pinned_models`` patterns (checked once, at ``__post_init__``)."""
        return model_patterns("pinned_models", self.pinned_models)

    @property
    def trust(self) -> Trust:
        """Every model's trust, before its name is matched (``trusted_types``,
        ``trusted_models``)."""
        return server_trust(self.trusted_types, self.trusted_models, self.isolate_trusted)

    # Building ---------------------------------------------------------------------------------

    @classmethod
    def options(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))

    @classmethod
    def build(
        cls,
        *,
        config_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        flags: Mapping[str, Any] | None = None,
    ) -> ServerConfig:
        """Merge defaults < properties file < ``MMSERVER_*`` environment < flags, and validate."""
        found = read_sources(
            dataclasses.fields(cls),
            config_file=config_file,
            env=env if env is not None else os.environ,
            flags=flags or {},
        )
        config = cls(**found.values)
        for refused, message in found.unknown:
            if refused and config.unknown_options == "refuse":
                raise ConfigError(f"{message} (unknown_options=warn starts anyway)")
            log.warning("%s; ignored", message)
        return config


_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

#: The choices of the ``log_format`` and ``unknown_options`` options.
LOG_FORMATS = ("text", "json")
UNKNOWN_OPTIONS = ("refuse", "warn")
