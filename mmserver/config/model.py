"""Each model's settings (:class:`ModelConfig`), every option declared once, as a field with
its metadata (:func:`option`): its ``serving.properties`` keys, its lower bound, whether a
management call may change it on a loaded model, whether the server has a global default for it,
and its help. The server's options (:class:`mmserver.config.server.ServerConfig`, and through it the
command line, the environment and ``--config FILE``), the reading of ``serving.properties``
(:func:`model_config_from_properties`) and the management API's overrides (:data:`RESCALABLE`)
all read that one declaration.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserver.config.trust import Trust
from mmserver.errors import ConfigError, InvalidInput
from mmserver.ops import capacity
from mmserver.ops.capacity import Limit
from mmserver.store.properties import boolean, read_properties

# The configuration's logger: what serving.properties says is logged where the options' lines
# have always been (operators filter on it).
log = logging.getLogger("mmserver.config.server")

PROPERTIES_FILE = "serving.properties"


@functools.cache
def default_cpus() -> Limit:
    """The CPUs the server is sized by when not told: the container's CPU quota, capped by the
    affinity mask (:func:`mmserver.ops.capacity.cpus`), read once."""
    return capacity.cpus()


def cpu_count() -> int:
    return default_cpus().value


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    keys: tuple[str, ...] = (),
    minimum: int | None = None,
    rescalable: bool = False,
    param: str | None = None,
    server_default: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """One model option, declared once: a :class:`ModelConfig` field whose metadata carries

    - ``keys``: its ``serving.properties`` keys (DJL's spellings, then the aliases; the first
      names it in error messages);
    - ``minimum``: the least value of a number (checked with it: not NaN, not too large);
    - ``rescalable``: whether the management API may set it (``POST /models``, and
      ``PUT /models/{model}`` on a loaded model);
    - ``param``: its name as a parameter of those calls (DJL's spelling, ``min_worker``);
    - ``server_default``: whether the server has a global option (``--batch-size``...) that is
      every model's default, :func:`server_option`;
    - ``help``: what it does, for ``mmserver serve --help``.
    """
    metadata = {
        "help": help,
        "keys": keys,
        "minimum": minimum,
        "rescalable": rescalable,
        "param": param,
        "server_default": server_default,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


METHODS = ("predict", "predict_proba", "decision_function", "transform")
MISSING_POLICIES = ("auto", "accept", "refuse")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model's settings: global defaults, then its ``serving.properties``, then management.

    ``max_batch_delay`` is in milliseconds and ``max_idle_time`` in seconds, as in DJL.
    """

    min_workers: int = option(
        1,
        "Default minWorkers of a model (0 = scale to zero).",
        keys=("minWorkers", "cpu.minWorkers"),
        minimum=0,
        rescalable=True,
        param="min_worker",
        server_default=True,
    )
    max_workers: int = option(
        help="Default maxWorkers of a model.",
        default_factory=cpu_count,
        keys=("maxWorkers", "cpu.maxWorkers"),
        minimum=0,
        rescalable=True,
        param="max_worker",
        server_default=True,
    )
    batch_size: int = option(
        32,
        "Default most jobs per predict call (a worker takes what is queued, up to this).",
        keys=("batch_size", "batchSize"),
        minimum=1,
        rescalable=True,
        param="batch_size",
        server_default=True,
    )
    max_batch_delay: int = option(
        0,
        "Default ms a worker waits to fill a batch; 0 = never wait, take what is queued. At "
        "most 10000 (MAX_BATCH_DELAY_MS), for every model.",
        keys=("max_batch_delay", "maxBatchDelay"),
        minimum=0,
        rescalable=True,
        param="max_batch_delay",
        server_default=True,
    )
    max_batch_bytes: int = option(
        6 * 1024 * 1024,
        "Default most request bytes in one batch (serving.properties max_batch_bytes): many "
        "large requests are not one batch that outlasts predict_timeout; a request larger than "
        "this is a batch of its own.",
        keys=("max_batch_bytes",),
        minimum=1,
        server_default=True,
    )
    max_idle_time: int = option(
        60,
        "Default s before a worker above minWorkers retires.",
        keys=("max_idle_time", "maxIdleTime"),
        minimum=0,
        rescalable=True,
        param="max_idle_time",
        server_default=True,
    )
    job_queue_size: int = option(
        1000,
        "Default capacity of a model's request queue.",
        keys=("job_queue_size",),
        minimum=1,
        rescalable=True,
        param="job_queue_size",
        server_default=True,
    )
    required_memory_mb: float | None = option(
        None,
        "MiB one copy of the model takes, instead of what its load measures.",
        keys=("required_memory_mb",),
    )
    predict_timeout: float = option(
        60.0,
        "Default s a request may take before it is answered 504.",
        keys=("option.predict_timeout",),
        minimum=0,
        server_default=True,
    )
    engine: str | None = option(
        None,
        "The model's library, as its family spells it: Python, sklearn, XGBoost or LightGBM.",
        keys=("engine",),
    )
    method: str = option("predict", "The estimator's method to call.", keys=("option.method",))
    model_file: str | None = option(
        None,
        "The model file inside the model folder; found by its name otherwise.",
        keys=("option.model_file",),
    )
    fast_path: bool = option(
        True,
        "Whether verified fast predict paths may replace the estimator's own method.",
        keys=("option.fast_path",),
    )
    entry_point: str = option("model.py", "The custom handler's file.", keys=("option.entryPoint",))
    handler: str = option("predict", "The custom handler's function.", keys=("option.handler",))
    missing_values: str = option(
        "auto",
        "Missing values (null, NaN, empty CSV fields): auto (those the model answers on at "
        "load), accept (all, to the model) or refuse (a 400 naming the column and row).",
        keys=("option.missing_values",),
    )
    csv_header: bool = option(
        False,
        "A CSV body's first line names the columns, whatever its content type says.",
        keys=("option.csv_header",),
    )
    explain: bool = option(
        True,
        "Whether the model answers explanations (a model whose predict paths let its "
        "estimator go reads it again from its file for its first explanation).",
        keys=("option.explain",),
    )
    explain_background: str | None = option(
        None,
        "The background sample of the model's explanations, a CSV file in its folder; "
        "explain_background.csv when there is one.",
        keys=("option.explain_background",),
    )
    explain_samples: int = option(
        256,
        "The most coalitions Kernel SHAP evaluates per explained row (models with no exact "
        "method).",
        keys=("option.explain_samples",),
        minimum=1,
    )
    raw_input: bool = option(
        False,
        "A custom handler takes each request as it came (body, content type, accept).",
        keys=("option.raw_input",),
    )
    sagemaker_xgboost: bool | None = option(
        None,
        "Read and answer as the SageMaker XGBoost container; unset: for an xgboost-model.",
        keys=("option.sagemaker_xgboost",),
    )
    async_max_workers: int = option(
        1,
        "Default most asynchronous requests of a model running at once (they run only where "
        "real-time requests leave room, and never count toward the real-time scale-up).",
        keys=("option.async_max_workers",),
        minimum=1,
        server_default=True,
    )
    async_output_path: str | None = option(
        None,
        "Where the model's asynchronous answers go, instead of the server's async_output_path.",
        keys=("option.async_output_path",),
    )
    async_failure_path: str | None = option(
        None,
        "Where the model's asynchronous failures go, instead of the server's async_failure_path.",
        keys=("option.async_failure_path",),
    )
    capture_percent: float = option(
        0.0,
        "Share (0 to 100) of the model's answered requests written to capture_path, with "
        "their answers.",
        keys=("option.capture_percent",),
        minimum=0,
    )
    #: Every key of serving.properties as written, for custom handlers.
    properties: Mapping[str, str] = field(default_factory=dict)
    #: How far the model's files are trusted: the server's options say it (no key of
    #: serving.properties sets it; :mod:`mmserver.config.trust`).
    trust: Trust = field(default_factory=Trust)
    #: What a pickle made by another minor version of scikit-learn gets: ``refuse`` or ``warn``
    #: (the server's ``on_version_skew`` option; :mod:`mmserver.execution.skew`).
    on_version_skew: str = "refuse"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` saying which key and value are wrong; the caller adds
        where they came from (a file, an option, a request)."""
        for name in LEAST:
            value = getattr(self, name)
            if value != value:  # NaN
                raise ConfigError(f"{_KEY_OF[name]}={value!r} is not a valid number")
            if (why := short_of(value, 0)) is not None:
                raise ConfigError(f"{_KEY_OF[name]}={value!r} {why}")
            if isinstance(value, int) and value > _LARGEST:  # used in float arithmetic
                raise ConfigError(f"{_KEY_OF[name]}={_short_number(value)} is too large")
        if self.max_batch_delay > MAX_BATCH_DELAY_MS:
            raise ConfigError(
                f"max_batch_delay={_short_number(self.max_batch_delay)} is over the limit of "
                f"{MAX_BATCH_DELAY_MS} ms: a batch waiting longer for company only delays its "
                "requests"
            )
        for name, least in LEAST.items():  # maxWorkers may be 0
            if (why := short_of(getattr(self, name), least)) is not None:
                raise ConfigError(f"{_KEY_OF[name]}={getattr(self, name)!r} {why}")
        memory = self.required_memory_mb
        if memory is not None and (why := short_of(memory, 0)) is not None:
            raise ConfigError(f"required_memory_mb={memory!r} {why}")
        if self.required_memory_mb is not None and not self.required_memory_mb * 2**20 <= _LARGEST:
            raise ConfigError(
                f"required_memory_mb={self.required_memory_mb!r} must be a finite number of MiB"
            )
        order = out_of_order("minWorkers", self.min_workers, "maxWorkers", self.max_workers)
        if order is not None:
            raise ConfigError(order)
        if self.missing_values not in MISSING_POLICIES:
            raise ConfigError(
                f"option.missing_values={self.missing_values!r} must be one of "
                f"{', '.join(MISSING_POLICIES)}"
            )
        if self.capture_percent > 100:
            raise ConfigError(
                f"option.capture_percent={self.capture_percent!r} must be from 0 to 100"
            )
        if self.method not in METHODS:
            raise ConfigError(f"option.method={self.method!r} is not one of {', '.join(METHODS)}")

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

_OPTIONS = [f for f in dataclasses.fields(ModelConfig) if f.metadata.get("keys")]
_TYPES = typing.get_type_hints(ModelConfig)


def _kind(name: str) -> type:
    """The type of an option's values: its field's type without ``None``."""
    kinds = [k for k in typing.get_args(_TYPES[name]) or (_TYPES[name],) if k is not type(None)]
    return typing.cast(type, kinds[0])


#: serving.properties key -> (ModelConfig field, type of its values).
MODEL_KEYS: dict[str, tuple[str, type]] = {
    key: (f.name, _kind(f.name)) for f in _OPTIONS for key in f.metadata["keys"]
}
#: The key that names an option in error messages (DJL's spelling).
_KEY_OF = {f.name: f.metadata["keys"][0] for f in _OPTIONS}
#: Options the management API may set (DJL's POST /models and PUT /models/{model}).
RESCALABLE = tuple(f.name for f in _OPTIONS if f.metadata["rescalable"])
#: The management API's parameter names (DJL's ``min_worker``...) of those options.
MANAGEMENT_PARAMS: dict[str, str] = {
    f.metadata["param"]: f.name for f in _OPTIONS if f.metadata["param"] is not None
}
#: The least value of each bounded option.
LEAST: Mapping[str, int] = {
    f.name: f.metadata["minimum"] for f in _OPTIONS if f.metadata["minimum"] is not None
}


def short_of(value: float, least: float) -> str | None:
    """Why ``value`` is under the lower bound ``least`` (``must not be negative``,
    ``must be >= 1``), ``None`` when it is not: the one rule of every option's lower bound,
    whichever source (``serving.properties``, a server option, a management parameter) gave it."""
    if value >= least:
        return None
    return "must not be negative" if least == 0 else f"must be >= {least:g}"


def out_of_order(low_key: str, low: float, high_key: str, high: float) -> str | None:
    """``minWorkers=3 is greater than maxWorkers=2`` when a range's lower end passes its upper
    one, ``None`` otherwise: the one rule of ``min <= max``, each source naming the keys its
    way."""
    return f"{low_key}={low} is greater than {high_key}={high}" if low > high else None


#: The options the server has a global default for (its ``--NAME`` flags...).
#: What the ``on_version_skew`` option may say (:mod:`mmserver.execution.skew`).
SKEW_CHOICES = ("refuse", "warn", "env")
SERVER_DEFAULTS = tuple(f.name for f in _OPTIONS if f.metadata["server_default"])


def server_option(name: str) -> Any:
    """The :class:`~mmserver.config.server.ServerConfig` field of model option ``name``: its default
    and help are the model option's."""
    declared = next(f for f in _OPTIONS if f.name == name and f.metadata["server_default"])
    default, factory = declared.default, declared.default_factory
    if default is dataclasses.MISSING and callable(factory):
        default = factory()
    return field(default=default, metadata={"help": declared.metadata["help"]})


def _short_number(value: float) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


_warned_unknown: set[tuple[str, str]] = set()
#: Keys the backend reads where the model loads (:mod:`mmserver.codecs.schema`).
#: Keys of a model folder's serving.properties that set its versions' rollout
#: (:mod:`mmserver.lifecycle.versions`), not one version's configuration.
ROLLOUT_KEYS = frozenset(
    {
        "option.default_version",
        "option.canary_version",
        "option.canary_percent",
        "option.shadow_version",
        "option.shadow_percent",
    }
)
_READ_AT_LOAD = frozenset({"option.columns"}) | ROLLOUT_KEYS
#: Keys with which other servers let a model's folder trust its own files (DJL's): read, and
#: ignored with a line saying why.
_TRUST_KEYS = frozenset({"option.trust_insecure_model_files", "option.trust_remote_code"})


def mistyped_keys(props: Mapping[str, str]) -> list[str]:
    """What to tell of the keys of ``props`` that mmserver does not read but that are close to
    one it does (``minWorker``, ``batchSize=`` with a typo): DJL files carry keys of other
    engines, and ``option.*`` keys may be a custom handler's, so only a near miss is said."""
    said = []
    for key in props:
        if key in MODEL_KEYS or key in _READ_AT_LOAD or key in _TRUST_KEYS:
            continue
        close = difflib.get_close_matches(key, list(MODEL_KEYS), n=1, cutoff=0.8)
        if close:
            said.append(
                f"serving.properties key {key!r} is not one mmserver reads; did you mean "
                f"{close[0]!r}?"
            )
    return said


def model_config_from_properties(
    props: Mapping[str, str], defaults: ModelConfig, where: str
) -> ModelConfig:
    """Apply ``props`` (serving.properties keys) over ``defaults``. Raises :class:`ConfigError`
    naming ``where`` (the file), the key and the value."""
    changes: dict[str, Any] = {}
    for key, raw in props.items():
        spec = MODEL_KEYS.get(key)
        if spec is None:
            if key in _READ_AT_LOAD:
                continue
            if key in _TRUST_KEYS:
                if (where, key) not in _warned_unknown:
                    _warned_unknown.add((where, key))
                    log.warning(
                        "%s: %s=%s is ignored: a model's files are trusted only by the server's "
                        "trusted_models and trusted_types options, never by its own folder",
                        where,
                        key,
                        raw.strip(),
                    )
                continue
            if (where, key) not in _warned_unknown:
                _warned_unknown.add((where, key))
                mistyped = mistyped_keys({key: raw})
                if mistyped:
                    log.warning("%s: %s", where, mistyped[0])
                else:
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
    # A version's keys over those of its model folder (empty for a model without versions).
    changes["properties"] = {**defaults.properties, **props}
    try:
        return dataclasses.replace(defaults, **changes)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def load_model_config(model_dir: Path, defaults: ModelConfig) -> ModelConfig:
    """Read ``model_dir/serving.properties`` (if any) over ``defaults`` (for a version, its
    model folder's keys over the server's defaults)."""
    path = model_dir / PROPERTIES_FILE
    if not path.is_file():
        return defaults
    return model_config_from_properties(read_properties(path), defaults, str(path))
