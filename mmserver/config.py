"""Configuration: the server's global options and each model's ``serving.properties``.

Every global option is declared once, as a field of :class:`ServerConfig` with its help text in
the field's metadata. The command-line flags (``--max-workers``), the environment variables
(``MMSERVER_MAX_WORKERS``) and the properties-file keys (``max_workers``) all derive from that one
declaration. Precedence, lowest first: defaults < ``--config FILE`` < environment < flags.

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
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import javaproperties

from mmserver import capacity
from mmserver.capacity import Limit
from mmserver.errors import ConfigError, InvalidInput
from mmserver.metrics import MODEL_LABEL_CHOICES
from mmserver.store import split_object_url

log = logging.getLogger(__name__)

ENV_PREFIX = "MMSERVER_"
PROPERTIES_FILE = "serving.properties"


@functools.cache
def default_cpus() -> Limit:
    """The CPUs the server is sized by when not told: the container's CPU quota, capped by the
    affinity mask (:func:`mmserver.capacity.cpus`), read once."""
    return capacity.cpus()


def cpu_count() -> int:
    return default_cpus().value


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


@dataclass(frozen=True)
class ServerConfig:
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
    backend_processes: int = _opt(
        cpu_count(),
        "Backend processes running predictions; 0 runs them in threads (development). The "
        "default is the CPUs the container may use: its cgroup CPU quota (cpu.max), capped by "
        "the CPU affinity mask.",
    )
    heavy_processes: int = _opt(
        cpu_count(),
        "Backend processes of the heavy lane, started when a model first needs one: models "
        "whose batches take more than heavy_batch_ms run there, at a lower CPU priority, so "
        "they cannot slow the others down; 0 = one lane for every model.",
    )
    heavy_batch_ms: float = _opt(
        2.0,
        "CPU ms per batch (moving average) above which a model moves to the heavy lane; it "
        "moves back below half of it.",
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
    min_workers: int = _opt(1, "Default minWorkers of a model (0 = scale to zero).")
    max_workers: int = _opt(cpu_count(), "Default maxWorkers of a model.")
    batch_size: int = _opt(
        32, "Default most jobs per predict call (a worker takes what is queued, up to this)."
    )
    max_batch_delay: int = _opt(
        0,
        "Default ms a worker waits to fill a batch; 0 = never wait, take what is queued. At "
        "most 10000 (MAX_BATCH_DELAY_MS), for every model.",
    )
    max_batch_bytes: int = _opt(
        6 * 1024 * 1024,
        "Default most request bytes in one batch (serving.properties max_batch_bytes): many "
        "large requests are not one batch that outlasts predict_timeout; a request larger than "
        "this is a batch of its own.",
    )
    max_idle_time: int = _opt(60, "Default s before a worker above minWorkers retires.")
    job_queue_size: int = _opt(1000, "Default capacity of a model's request queue.")
    max_loaded_models: int = _opt(0, "Most models loaded at once; 0 = no limit but memory.")
    max_memory_mb: int = _opt(
        0,
        "Memory budget for loaded models in MiB; 0 = 80% of the container's memory limit "
        "(cgroup memory.max) less what the server uses, or of the available memory without one.",
    )
    max_request_size: int = _opt(6 * 1024 * 1024, "Largest request body in bytes.")
    predict_timeout: float = _opt(60.0, "Default s a request may take before it is answered 504.")
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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                if value != value:
                    raise ConfigError(f"option {f.name}={value!r}: must be a number")
                if value < 0:
                    raise ConfigError(f"option {f.name}={value!r}: must not be negative")
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"option min_workers={self.min_workers} is greater than "
                f"max_workers={self.max_workers}"
            )
        if self.batch_size < 1 or self.job_queue_size < 1 or self.max_workers < 1:
            raise ConfigError("options batch_size, job_queue_size and max_workers must be >= 1")
        if not 0 < self.heavy_nice < 20:
            raise ConfigError(f"option heavy_nice={self.heavy_nice}: must be between 1 and 19")
        if not 0 < self.port < 65536:
            raise ConfigError(f"option port={self.port}: must be between 1 and 65535")
        if self.grpc_port > 65535 or self.grpc_port == self.port:
            raise ConfigError(
                f"option grpc_port={self.grpc_port}: must be between 1 and 65535 and not port "
                "(0 = no gRPC)"
            )
        if self.metrics_model_label not in MODEL_LABEL_CHOICES:
            raise ConfigError(
                f"option metrics_model_label={self.metrics_model_label!r}: must be one of "
                f"{', '.join(MODEL_LABEL_CHOICES)}"
            )
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ConfigError(f"option log_level={self.log_level!r}: not a logging level")
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
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            batch_size=self.batch_size,
            max_batch_delay=self.max_batch_delay,
            max_batch_bytes=self.max_batch_bytes,
            max_idle_time=self.max_idle_time,
            job_queue_size=self.job_queue_size,
            predict_timeout=self.predict_timeout,
        )

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
        values: dict[str, Any] = {}
        known = {f.name: f for f in dataclasses.fields(cls)}
        if config_file is not None:
            path = Path(config_file)
            for key, raw in read_properties(path).items():
                if key not in known:
                    log.warning("config %s: unknown key %r ignored", path, key)
                    continue
                values[key] = _convert(known[key], raw, f"config file {path}, key {key}")
        for key, raw in (env if env is not None else os.environ).items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name in known:
                values[name] = _convert(known[name], raw, f"environment {key}")
        for name, value in (flags or {}).items():
            if value is None:
                continue
            if name not in known:
                raise ConfigError(f"unknown option {name!r}")
            values[name] = (
                _convert(known[name], value, f"option --{name.replace('_', '-')}")
                if isinstance(value, str)
                else value
            )
        return cls(**values)


_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

#: The spellings of true and false (lower case) in the environment, on the command line, in
#: serving.properties and in the management API's parameters.
BOOLEANS: Mapping[str, bool] = {
    "true": True,
    "false": False,
    "1": True,
    "0": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
}


def boolean(text: str) -> bool | None:
    """``text`` as true or false (:data:`BOOLEANS`, in any case, white space around it
    ignored), or ``None`` when it spells neither."""
    return BOOLEANS.get(text.strip().lower())


def _convert(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    kind: type[Any] = type(f.default)
    text = raw.strip()
    try:
        if kind is bool:
            if not text:
                return False  # an empty value (MMSERVER_X=) is false
            value = boolean(text)
            if value is None:
                raise ValueError(text)
            return value
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: value {raw!r} is not a valid {kind.__name__}") from None
    return text


# ------------------------------------------------------------------------------------------------
# Java-properties files
# ------------------------------------------------------------------------------------------------


def parse_properties(text: str) -> dict[str, str]:
    """Parse Java-properties text as ``java.util.Properties.load`` does: ``key=value``,
    ``key: value`` or ``key value``; ``#``/``!`` comment lines; a line ending in an odd number of
    backslashes continues on the next; the escapes ``\\t``, ``\\n``, ``\\f``, ``\\r``,
    ``\\uXXXX`` and backslash before any other character (``\\#``, ``\\=``, ``\\\\``...).
    A value keeps its trailing white space, as in Java (the server strips it when it reads a
    number or a name). Later keys win. A malformed ``\\uXXXX`` raises :class:`ConfigError`."""
    try:
        return javaproperties.loads(text)
    except javaproperties.InvalidUEscapeError as exc:
        raise ConfigError(f"malformed \\uXXXX escape {exc.escape!r}") from None


def read_properties(path: Path) -> dict[str, str]:
    """The properties of the file ``path``, read as UTF-8, or as ISO-8859-1 (what
    ``Properties.load(InputStream)`` reads) when it is not valid UTF-8."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("iso-8859-1")
    try:
        return parse_properties(text)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc.message}") from None


# ------------------------------------------------------------------------------------------------
# Per-model configuration (serving.properties)
# ------------------------------------------------------------------------------------------------

METHODS = ("predict", "predict_proba", "decision_function", "transform")
MISSING_POLICIES = ("auto", "accept", "refuse")
#: ``engine`` values (lower case): ``python`` and ``sklearn`` load a pickled model, the others a
#: booster in its library's own format.
ENGINES = ("python", "sklearn", "xgboost", "lightgbm")


@dataclass(frozen=True)
class ModelConfig:
    """One model's settings: global defaults, then its ``serving.properties``, then management.

    ``max_batch_delay`` is in milliseconds and ``max_idle_time`` in seconds, as in DJL.
    """

    min_workers: int = 1
    max_workers: int = field(default_factory=cpu_count)
    batch_size: int = 32
    max_batch_delay: int = 0
    #: Request bytes one batch may hold (a request larger than this is a batch alone).
    max_batch_bytes: int = 6 * 1024 * 1024
    max_idle_time: int = 60
    job_queue_size: int = 1000
    required_memory_mb: float | None = None
    predict_timeout: float = 60.0
    engine: str | None = None
    method: str = "predict"
    #: The model file inside the model folder (``option.model_file``); found by its name otherwise.
    model_file: str | None = None
    #: Whether verified fast predict paths may replace the estimator's own method.
    fast_path: bool = True
    entry_point: str = "model.py"
    handler: str = "predict"
    #: Missing values (null, NaN, empty CSV fields): ``auto`` (those the model answers on at
    #: load), ``accept`` (all, to the model) or ``refuse`` (a 400 naming the column and row).
    missing_values: str = "auto"
    #: A CSV body's first line names the columns, whatever its content type says.
    csv_header: bool = False
    #: A custom handler takes each request as it came (body, content type, accept).
    raw_input: bool = False
    #: Read and answer as the SageMaker XGBoost container; ``None``: for an ``xgboost-model``.
    sagemaker_xgboost: bool | None = None
    #: Every key of serving.properties as written, for custom handlers.
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` saying which key and value are wrong; the caller adds
        where they came from (a file, an option, a request)."""
        for name in (
            "min_workers",
            "max_workers",
            "batch_size",
            "max_batch_delay",
            "max_batch_bytes",
            "max_idle_time",
            "job_queue_size",
            "predict_timeout",
        ):
            value = getattr(self, name)
            if value != value:  # NaN
                raise ConfigError(f"{_djl_key(name)}={value!r} is not a valid number")
            if value < 0:
                raise ConfigError(f"{_djl_key(name)}={value!r} must not be negative")
            if isinstance(value, int) and value > _LARGEST:  # used in float arithmetic
                raise ConfigError(f"{_djl_key(name)}={_short_number(value)} is too large")
        if self.max_batch_delay > MAX_BATCH_DELAY_MS:
            raise ConfigError(
                f"max_batch_delay={_short_number(self.max_batch_delay)} is over the limit of "
                f"{MAX_BATCH_DELAY_MS} ms: a batch waiting longer for company only delays its "
                "requests"
            )
        for name in ("batch_size", "job_queue_size", "max_batch_bytes"):  # maxWorkers may be 0
            if getattr(self, name) < 1:
                raise ConfigError(f"{_djl_key(name)}={getattr(self, name)!r} must be >= 1")
        if self.required_memory_mb is not None and self.required_memory_mb < 0:
            raise ConfigError(
                f"required_memory_mb={self.required_memory_mb!r} must not be negative"
            )
        if self.required_memory_mb is not None and not self.required_memory_mb * 2**20 <= _LARGEST:
            raise ConfigError(
                f"required_memory_mb={self.required_memory_mb!r} must be a finite number of MiB"
            )
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"minWorkers={self.min_workers} is greater than maxWorkers={self.max_workers}"
            )
        if self.missing_values not in MISSING_POLICIES:
            raise ConfigError(
                f"option.missing_values={self.missing_values!r} must be one of "
                f"{', '.join(MISSING_POLICIES)}"
            )
        if self.method not in METHODS:
            raise ConfigError(f"option.method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.engine is not None and self.engine.lower() not in ENGINES:
            raise ConfigError(
                f"engine={self.engine!r} must be one of Python, sklearn, XGBoost, LightGBM"
            )

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated; raises :class:`ConfigError`)."""
        return dataclasses.replace(self, **changes)

    def requested(self, **changes: Any) -> ModelConfig:
        """A copy with the ``changes`` a management request asks for: a value the model cannot
        take is the request's fault (:class:`InvalidInput`, 400), not the configuration's."""
        try:
            return dataclasses.replace(self, **changes)
        except ConfigError as exc:
            raise InvalidInput(exc.message) from None

    @property
    def batch_delay_s(self) -> float:
        return self.max_batch_delay / 1000.0


#: The longest ``max_batch_delay`` (ms) of any model: a hundred times DJL's default of 100 ms
#: and a sixth of the default ``predict_timeout``. Waiting for a fuller batch pays off within
#: milliseconds; a longer wait holds every request of a quiet model for nothing.
MAX_BATCH_DELAY_MS = 10_000

#: The server computes with the numbers of a configuration as floats: an integer above this has
#: no float form, and a size must be finite. (An infinite ``predict_timeout`` means no timeout.)
_LARGEST = sys.float_info.max


def _short_number(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


# serving.properties key -> (ModelConfig field, type). DJL's spellings, plus the common aliases.
_MODEL_KEYS: dict[str, tuple[str, type]] = {
    "minWorkers": ("min_workers", int),
    "maxWorkers": ("max_workers", int),
    "cpu.minWorkers": ("min_workers", int),
    "cpu.maxWorkers": ("max_workers", int),
    "batch_size": ("batch_size", int),
    "batchSize": ("batch_size", int),
    "max_batch_delay": ("max_batch_delay", int),
    "maxBatchDelay": ("max_batch_delay", int),
    "max_batch_bytes": ("max_batch_bytes", int),
    "max_idle_time": ("max_idle_time", int),
    "maxIdleTime": ("max_idle_time", int),
    "job_queue_size": ("job_queue_size", int),
    "required_memory_mb": ("required_memory_mb", float),
    "option.predict_timeout": ("predict_timeout", float),
    "engine": ("engine", str),
    "option.method": ("method", str),
    "option.entryPoint": ("entry_point", str),
    "option.handler": ("handler", str),
    "option.model_file": ("model_file", str),
    "option.fast_path": ("fast_path", bool),
    "option.missing_values": ("missing_values", str),
    "option.csv_header": ("csv_header", bool),
    "option.raw_input": ("raw_input", bool),
    "option.sagemaker_xgboost": ("sagemaker_xgboost", bool),
}


def _djl_key(name: str) -> str:
    for key, (fname, _) in _MODEL_KEYS.items():
        if fname == name:
            return key
    return name


_warned_unknown: set[tuple[str, str]] = set()
#: Keys the backend reads where the model loads (:mod:`mmserver.schema`).
_READ_AT_LOAD = frozenset({"option.columns"})


def model_config_from_properties(
    props: Mapping[str, str], defaults: ModelConfig, where: str
) -> ModelConfig:
    """Apply ``props`` (serving.properties keys) over ``defaults``. Raises :class:`ConfigError`
    naming ``where`` (the file), the key and the value."""
    changes: dict[str, Any] = {}
    for key, raw in props.items():
        spec = _MODEL_KEYS.get(key)
        if spec is None:
            if key in _READ_AT_LOAD:
                continue
            if (where, key) not in _warned_unknown:
                _warned_unknown.add((where, key))
                log.info("%s: key %r is not used by mmserver; kept for the handler", where, key)
            continue
        name, kind = spec
        text = raw.strip()
        if kind is str:
            changes[name] = text
            continue
        if kind is bool:
            value = boolean(text)
            if value is None:
                raise ConfigError(f"{where}: {key}={raw!r} must be true or false")
            changes[name] = value
            continue
        try:
            number = kind(text)
        except ValueError:
            raise ConfigError(
                f"{where}: {key}={raw!r} is not a valid {'integer' if kind is int else 'number'}"
            ) from None
        if isinstance(number, float) and number != number:  # NaN
            raise ConfigError(f"{where}: {key}={raw!r} is not a valid number")
        changes[name] = number
    changes["properties"] = dict(props)
    try:
        return dataclasses.replace(defaults, **changes)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def load_model_config(model_dir: Path, defaults: ModelConfig) -> ModelConfig:
    """Read ``model_dir/serving.properties`` (if any) over ``defaults``."""
    path = model_dir / PROPERTIES_FILE
    if not path.is_file():
        return defaults
    return model_config_from_properties(read_properties(path), defaults, str(path))
