"""``serving.properties``: any text parses; any keys and values give a valid, usable
configuration or a :class:`ConfigError` naming the file."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mmserver.config.server import (
    METHODS,
    ModelConfig,
    ServerConfig,
    load_model_config,
    model_config_from_properties,
    parse_properties,
)
from mmserver.errors import MAX_MESSAGE, ConfigError
from mmserver.execution.families import engine_families
from tests.fuzz.strategies import FAST

WHERE = "/store/m/serving.properties"
DEFAULTS = ModelConfig(max_workers=4)

KNOWN_KEYS = (
    "minWorkers",
    "maxWorkers",
    "cpu.minWorkers",
    "cpu.maxWorkers",
    "batch_size",
    "batchSize",
    "max_batch_delay",
    "maxBatchDelay",
    "max_idle_time",
    "maxIdleTime",
    "job_queue_size",
    "required_memory_mb",
    "option.predict_timeout",
    "engine",
    "option.method",
    "option.entryPoint",
    "option.handler",
)

keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))
values = st.one_of(
    st.integers(min_value=-5, max_value=10).map(str),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(
        [
            "",
            " 3 ",
            "inf",
            "-inf",
            "nan",
            "1e400",
            "1" + "0" * 400,
            "1" * 5000,
            "0x10",
            "1_000",
            "\uff11\uff12",
            "2.0",
            "python",
            "SKLearn",
            "predict_proba",
            "fit",
            *METHODS,
        ]
    ),
    st.text(max_size=12),
)


def _fits_a_float(value: float | int) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def assert_usable(config: ModelConfig) -> None:
    """What the server relies on of every configuration it accepts."""
    assert 0 <= config.min_workers <= config.max_workers  # maxWorkers 0: no worker, as in DJL
    assert config.batch_size >= 1 and config.job_queue_size >= 1
    assert config.max_batch_delay >= 0 and config.max_idle_time >= 0
    assert config.predict_timeout >= 0
    for name in (
        "min_workers",
        "max_workers",
        "batch_size",
        "max_batch_delay",
        "max_idle_time",
        "job_queue_size",
        "predict_timeout",
    ):
        assert _fits_a_float(getattr(config, name)), name
    assert config.batch_delay_s >= 0
    if config.required_memory_mb is not None:
        assert math.isfinite(config.required_memory_mb) and config.required_memory_mb >= 0
        assert int(config.required_memory_mb * 2**20) >= 0  # the bytes the eviction counts
    assert config.method in METHODS
    if config.engine is not None:  # one family's, or refused by the load's file work, named
        try:
            assert len(engine_families(config.engine)) == 1
        except ConfigError as exc:
            # A message past MAX_MESSAGE keeps its start (an engine of thousands of characters).
            said = f"engine={config.engine!r} must be one of"
            assert said[: MAX_MESSAGE // 2] in exc.message


@FAST
@given(st.text(max_size=400))
@example("a\\")
@example("\\\n\\\n")
@example("=\n:\n \t\f")
@example("key\\\\\nnext=1")
@example("a=\\u12")
def test_any_text_parses(text: str) -> None:
    """Any text parses, or is refused (a malformed \\uXXXX, as Java refuses it) with a
    :class:`ConfigError` naming the escape."""
    try:
        parsed = parse_properties(text)
    except ConfigError as exc:
        assert "malformed \\uXXXX escape" in exc.message
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in parsed.items())


plain_keys = st.text(
    st.characters(whitelist_categories=("L", "N"), whitelist_characters="._-"),
    min_size=1,
    max_size=12,
)
plain_values = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Zs"), blacklist_characters="\\"),
    max_size=12,
)


@FAST
@given(st.dictionaries(plain_keys, plain_values, max_size=6), st.sampled_from(["=", ":", " = "]))
def test_written_properties_read_back(props: dict[str, str], separator: str) -> None:
    text = "# written by a test\n" + "".join(f"{k}{separator}{v}\n" for k, v in props.items())
    assert parse_properties(text) == props


@FAST
@given(st.dictionaries(keys, values, max_size=5))
@example({"max_batch_delay": "1" + "0" * 400})
@example({"maxIdleTime": "1" + "0" * 400})
@example({"required_memory_mb": "inf"})
@example({"required_memory_mb": "1e400"})
@example({"required_memory_mb": "1.7144137714980277e+302"})
@example({"minWorkers": "1" + "0" * 400, "maxWorkers": "1" + "0" * 401})
def test_any_keys_and_values(props: dict[str, str]) -> None:
    try:
        config = model_config_from_properties(props, DEFAULTS, WHERE)
    except ConfigError as exc:
        assert exc.message.startswith(f"{WHERE}: "), exc.message
        assert exc.status_code == 500  # a model load failure, never a client error
        return
    except Exception as exc:
        pytest.fail(f"undocumented error {type(exc).__name__}: {exc}")
    assert_usable(config)
    assert config.properties == props


@FAST
@given(st.binary(max_size=200))
def test_any_file(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    folder = tmp_path_factory.mktemp("model")
    (folder / "serving.properties").write_bytes(data)
    try:
        config = load_model_config(folder, DEFAULTS)
    except ConfigError as exc:
        assert str(folder / "serving.properties") in exc.message
        return
    assert_usable(config)


@FAST
@given(
    st.sampled_from(
        [
            "max_batch_delay",
            "max_idle_time",
            "batch_size",
            "job_queue_size",
            "min_workers",
            "max_workers",
        ]
    ),
    st.one_of(st.integers(), st.sampled_from(["1" + "0" * 400, "1" * 4000, "x", "", "-0"])),
)
def test_global_model_defaults(option: str, value: int | str) -> None:
    """A global default a model cannot use is refused when the options are built (the command
    exits 2 naming the option), not when the first request reaches a model."""
    flags = {option: str(value)}
    try:
        config = ServerConfig.build(env={}, flags=flags)
    except ConfigError as exc:
        djl = {"min_workers": "minWorkers", "max_workers": "maxWorkers"}.get(option, option)
        named = (option, option.replace("_", "-"), djl)
        assert exc.message.startswith("option") and any(n in exc.message for n in named), (
            exc.message
        )
        return
    assert_usable(config.model_defaults())
