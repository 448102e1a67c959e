"""Global options (precedence, validation) and serving.properties (every key, Java syntax)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

from mmserver.config.server import (
    METHODS,
    ModelConfig,
    ServerConfig,
    load_model_config,
    model_config_from_properties,
    parse_properties,
    read_properties,
)
from mmserver.errors import ConfigError

# ------------------------------------------------------------------------------------------------
# Global options
# ------------------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_given() -> None:
    config = ServerConfig.build(env={})
    assert config.host == "127.0.0.1"
    assert config.port == 8080
    assert config.load_models == "NONE"
    assert config.batch_size == 32
    assert config.max_batch_delay == 0
    assert config.job_queue_size == 1000
    assert config.max_request_size == 6 * 1024 * 1024
    assert config.predict_timeout == 60.0
    assert config.insecure_management is False
    assert config.is_loopback


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    conf = write(
        tmp_path / "mmserver.store.properties",
        "port=8001\nbatch_size=2\nmax_batch_delay=7\nhost=127.0.0.2\n",
    )
    env = {"MMSERVER_PORT": "8002", "MMSERVER_BATCH_SIZE": "3", "OTHER_PORT": "1"}
    flags = {"port": "8003", "host": None}

    assert ServerConfig.build(config_file=conf, env={}).port == 8001
    from_env = ServerConfig.build(config_file=conf, env=env)
    assert (from_env.port, from_env.batch_size) == (8002, 3)

    config = ServerConfig.build(config_file=conf, env=env, flags=flags)
    assert config.port == 8003  # flag beats env and file
    assert config.batch_size == 3  # env beats file
    assert config.max_batch_delay == 7  # file beats default
    assert config.host == "127.0.0.2"  # a flag left at None does not override
    assert config.job_queue_size == 1000  # default


def test_bool_and_float_options_convert(tmp_path: Path) -> None:
    conf = write(tmp_path / "c.properties", "insecure_management=yes\npredict_timeout=2.5\n")
    config = ServerConfig.build(config_file=conf, env={"MMSERVER_ACCESS_LOG": "true"})
    assert config.insecure_management is True
    assert config.access_log is True
    assert config.predict_timeout == 2.5
    off = ServerConfig.build(config_file=conf, env={"MMSERVER_INSECURE_MANAGEMENT": "off"})
    assert off.insecure_management is False
    assert ServerConfig.build(env={}, flags={"access_log": True}).access_log is True


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ({"env": {"MMSERVER_PORT": "eighty"}}, ["MMSERVER_PORT", "'eighty'", "int"]),
        ({"flags": {"max_workers": "many"}}, ["--max-workers", "'many'"]),
        ({"env": {"MMSERVER_PREDICT_TIMEOUT": "soon"}}, ["MMSERVER_PREDICT_TIMEOUT", "'soon'"]),
        ({"env": {"MMSERVER_ACCESS_LOG": "maybe"}}, ["MMSERVER_ACCESS_LOG", "'maybe'"]),
    ],
)
def test_bad_values_name_their_source(
    source: dict[str, dict[str, str]], expected: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig.build(env=source.get("env", {}), flags=source.get("flags"))
    for text in expected:
        assert text in info.value.message


def test_bad_value_in_file_names_file_key_and_value(tmp_path: Path) -> None:
    conf = write(tmp_path / "bad.properties", "# comment\nmax_batch_delay = 10ms\n")
    with pytest.raises(ConfigError) as info:
        ServerConfig.build(config_file=conf, env={})
    message = info.value.message
    assert str(conf) in message
    assert "max_batch_delay" in message
    assert "'10ms'" in message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"max_workers": -1}, "max_workers=-1: must not be negative"),
        ({"min_workers": 4, "max_workers": 2}, "min_workers=4 is greater than max_workers=2"),
        ({"port": 70000}, "port=70000"),
        ({"batch_size": 0}, "batch_size"),
        ({"log_level": "LOUD"}, "log_level='LOUD'"),
    ],
)
def test_invalid_combinations_are_refused(flags: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig.build(env={}, flags=flags)
    assert expected in info.value.message


def test_missing_config_file_and_unknown_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ServerConfig.build(config_file=tmp_path / "nope.properties", env={})
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        ServerConfig.build(env={}, flags={"colour": "red"})


def test_unknown_key_in_config_file_is_refused_with_the_closest_option(tmp_path: Path) -> None:
    conf = write(tmp_path / "c.properties", "port=8005\nmax_worker=3\n")
    with pytest.raises(ConfigError, match="unknown option 'max_worker'; did you mean max_workers"):
        ServerConfig.build(config_file=conf, env={})
    conf = write(tmp_path / "d.properties", "colour=red\n")
    with pytest.raises(ConfigError, match=r"unknown option 'colour' \(unknown_options=warn"):
        ServerConfig.build(config_file=conf, env={})


def test_unknown_options_warn_logs_and_ignores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conf = write(tmp_path / "c.properties", "port=8005\ncolour=red\nunknown_options=warn\n")
    with caplog.at_level(logging.WARNING, logger="mmserver.config.server"):
        config = ServerConfig.build(config_file=conf, env={"MMSERVER_BACH_SIZE": "4"})
    assert config.port == 8005
    messages = [r.getMessage() for r in caplog.records]
    assert any("colour" in m and m.endswith("ignored") for m in messages)
    assert any(
        "MMSERVER_BACH_SIZE: not an option; did you mean MMSERVER_BATCH_SIZE" in m for m in messages
    )


def test_an_environment_variable_close_to_an_option_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError, match="did you mean MMSERVER_BATCH_SIZE"):
        ServerConfig.build(env={"MMSERVER_BACH_SIZE": "4"})
    # A variable of another program, far from every option's name: logged, not refused.
    with caplog.at_level(logging.WARNING, logger="mmserver.config.server"):
        config = ServerConfig.build(env={"MMSERVER_FUZZ_SCALE": "3", "MMSERVER_PORT": "8006"})
    assert config.port == 8006
    assert any("MMSERVER_FUZZ_SCALE: not an option" in r.getMessage() for r in caplog.records)


def test_derived_paths(tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = ServerConfig.build(env={}, flags={"model_store": str(store)})
    assert config.store_path == store.resolve()
    assert config.cache_path == store.resolve() / ".mmserver-cache"
    assert config.allowed_roots == (store.resolve(),)
    roots = ServerConfig.build(
        env={}, flags={"allowed_model_roots": f"{tmp_path / 'a'}, {tmp_path / 'b'}"}
    ).allowed_roots
    assert roots == ((tmp_path / "a").resolve(), (tmp_path / "b").resolve())
    assert not ServerConfig.build(env={}, flags={"host": "0.0.0.0"}).is_loopback


def test_model_defaults_follow_global_options() -> None:
    config = ServerConfig.build(
        env={},
        flags={"min_workers": 0, "max_workers": 3, "batch_size": 4, "max_batch_delay": 9},
    )
    defaults = config.model_defaults()
    assert (defaults.min_workers, defaults.max_workers) == (0, 3)
    assert (defaults.batch_size, defaults.max_batch_delay) == (4, 9)
    assert defaults.batch_delay_s == pytest.approx(0.009)


# ------------------------------------------------------------------------------------------------
# serving.properties
# ------------------------------------------------------------------------------------------------

BASE = ModelConfig(max_workers=4)


@pytest.mark.parametrize(
    ("key", "raw", "field", "value"),
    [
        ("minWorkers", "2", "min_workers", 2),
        ("minWorkers", "0", "min_workers", 0),
        ("maxWorkers", "3", "max_workers", 3),
        ("cpu.minWorkers", "2", "min_workers", 2),
        ("cpu.maxWorkers", "2", "max_workers", 2),
        ("batch_size", "8", "batch_size", 8),
        ("batchSize", "16", "batch_size", 16),
        ("max_batch_delay", "5", "max_batch_delay", 5),
        ("maxBatchDelay", "0", "max_batch_delay", 0),
        ("max_idle_time", "30", "max_idle_time", 30),
        ("maxIdleTime", "1", "max_idle_time", 1),
        ("job_queue_size", "100", "job_queue_size", 100),
        ("required_memory_mb", "12.5", "required_memory_mb", 12.5),
        ("engine", "Python", "engine", "Python"),
        ("engine", "sklearn", "engine", "sklearn"),
        ("option.method", "predict_proba", "method", "predict_proba"),
        ("option.method", "decision_function", "method", "decision_function"),
        ("option.method", "transform", "method", "transform"),
        ("option.entryPoint", "handler.py", "entry_point", "handler.py"),
        ("option.handler", "handle", "handler", "handle"),
        ("option.predict_timeout", "2.5", "predict_timeout", 2.5),
    ],
)
def test_every_key_with_a_good_value(key: str, raw: str, field: str, value: object) -> None:
    config = model_config_from_properties({key: raw}, BASE, "m/serving.properties")
    assert getattr(config, field) == value
    assert config.properties == {key: raw}


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"minWorkers": "two"}, "minWorkers='two' is not a valid integer"),
        ({"maxWorkers": "1.5"}, "maxWorkers='1.5' is not a valid integer"),
        ({"batch_size": ""}, "batch_size='' is not a valid integer"),
        ({"max_batch_delay": "100ms"}, "max_batch_delay='100ms' is not a valid integer"),
        ({"max_idle_time": "1m"}, "max_idle_time='1m' is not a valid integer"),
        ({"job_queue_size": "lots"}, "job_queue_size='lots' is not a valid integer"),
        ({"required_memory_mb": "1GB"}, "required_memory_mb='1GB' is not a valid number"),
        ({"required_memory_mb": "nan"}, "required_memory_mb='nan' is not a valid number"),
        ({"option.predict_timeout": "x"}, "option.predict_timeout='x' is not a valid number"),
        ({"minWorkers": "-1"}, "minWorkers=-1 must not be negative"),
        ({"max_batch_delay": "-5"}, "max_batch_delay=-5 must not be negative"),
        ({"max_idle_time": "-1"}, "max_idle_time=-1 must not be negative"),
        ({"option.predict_timeout": "-1"}, "option.predict_timeout=-1.0 must not be negative"),
        ({"required_memory_mb": "-3"}, "required_memory_mb=-3.0 must not be negative"),
        ({"batch_size": "0"}, "batch_size=0 must be >= 1"),
        ({"maxWorkers": "0"}, "minWorkers=1 is greater than maxWorkers=0"),
        ({"job_queue_size": "0"}, "job_queue_size=0 must be >= 1"),
        ({"minWorkers": "3", "maxWorkers": "2"}, "minWorkers=3 is greater than maxWorkers=2"),
        ({"minWorkers": "5"}, "minWorkers=5 is greater than maxWorkers=4"),
        ({"option.method": "fit"}, "option.method='fit' is not one of"),
        ({"option.fast_path": "maybe"}, "option.fast_path='maybe' must be true or false"),
    ],
)
def test_bad_values_name_file_key_and_value(
    tmp_path: Path, props: dict[str, str], expected: str
) -> None:
    path = tmp_path / "m" / "serving.properties"
    path.parent.mkdir()
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    with pytest.raises(ConfigError) as info:
        load_model_config(path.parent, BASE)
    assert info.value.message.startswith(f"{path}: ")
    assert expected in info.value.message


def test_bad_method_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        model_config_from_properties({"option.method": "score"}, BASE, "x")
    for method in METHODS:
        assert method in info.value.message


def test_unknown_keys_are_kept_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    where = str(tmp_path / "serving.properties")
    props = {"batch_size": "2", "option.my_threshold": "0.7"}
    with caplog.at_level(logging.INFO, logger="mmserver.config.server"):
        first = model_config_from_properties(props, BASE, where)
        second = model_config_from_properties(props, BASE, where)
    assert first.properties["option.my_threshold"] == "0.7"
    assert second.properties == props
    logged = [r for r in caplog.records if "option.my_threshold" in r.getMessage()]
    assert len(logged) == 1
    assert where in logged[0].getMessage()


def test_no_file_means_defaults(tmp_path: Path) -> None:
    assert load_model_config(tmp_path, BASE) is BASE


def test_file_overrides_only_its_keys(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("batch_size=8\nmaxWorkers=2\n")
    config = load_model_config(tmp_path, BASE.replace(max_batch_delay=50))
    assert (config.batch_size, config.max_workers) == (8, 2)
    assert config.max_batch_delay == 50
    assert config.min_workers == 1


def test_replace_validates() -> None:
    assert BASE.replace(batch_size=4).batch_size == 4
    with pytest.raises(ConfigError, match="minWorkers=9 is greater than maxWorkers=4"):
        BASE.replace(min_workers=9)


# ------------------------------------------------------------------------------------------------
# Java-properties syntax
# ------------------------------------------------------------------------------------------------


def test_java_properties_syntax() -> None:
    text = (
        "# a comment\n"
        "! another comment\n"
        "\n"
        "   minWorkers=1\n"
        "maxWorkers : 4\n"
        "batch_size 8\n"
        "max_batch_delay   =   5   \n"
        "option.note = first \\\n"
        "    second \\\n"
        "    third\n"
        "# comment ending in a backslash does not continue \\\n"
        "engine=Python\n"
        "option.url=http://x:1/a=b\n"
        "my\\ key=spaced\n"
        "flag\n"
    )
    assert parse_properties(text) == {
        "minWorkers": "1",
        "maxWorkers": "4",
        "batch_size": "8",
        "max_batch_delay": "5   ",  # Java keeps a value's trailing white space
        "option.note": "first second third",
        "engine": "Python",
        "option.url": "http://x:1/a=b",
        "my key": "spaced",
        "flag": "",
    }


def test_later_keys_win_and_crlf_is_accepted() -> None:
    assert parse_properties("batch_size=1\r\nbatch_size=2\r\n") == {"batch_size": "2"}


def test_a_properties_file_that_is_not_utf8_is_read_as_iso_8859_1(tmp_path: Path) -> None:
    """``Properties.load(InputStream)``, which DJL calls, reads ISO-8859-1: every file reads."""
    path = tmp_path / "serving.properties"
    path.write_bytes(b"note=caf\xe9\nbatch_size=2\n")
    assert read_properties(path) == {"note": "caf\u00e9", "batch_size": "2"}
    path.write_bytes("note=caf\u00e9\n".encode())
    assert read_properties(path) == {"note": "caf\u00e9"}
    path.write_bytes(b"bad=\\u12\n")
    with pytest.raises(ConfigError, match=r"serving.properties: malformed \\uXXXX escape"):
        read_properties(path)
    (tmp_path / "model").mkdir()
    bad = tmp_path / "model" / "serving.properties"
    bad.write_text("minWorkers:2\nmaxWorkers 1\n")
    with pytest.raises(ConfigError, match="minWorkers=2 is greater than maxWorkers=1"):
        load_model_config(bad.parent, BASE)


@pytest.mark.parametrize("name", ["PREDICT_TIMEOUT", "DRAIN_TIMEOUT", "HEAVY_BATCH_MS"])
def test_not_a_number_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="must be a number"):
        ServerConfig.build(env={f"MMSERVER_{name}": "nan"})
    with pytest.raises(ConfigError, match="is not a valid number"):
        ModelConfig(predict_timeout=float("nan"))


def test_metrics_model_label_must_be_a_known_choice() -> None:
    with pytest.raises(
        ConfigError, match=r"metrics_model_label='every': must be one of all, requests, none"
    ):
        ServerConfig(metrics_model_label="every")
    assert ServerConfig().metrics_model_label == "requests"


def test_a_model_config_reaches_a_backend_whole_and_keeps_no_dict(tmp_path: Path) -> None:
    """A model's settings are pickled to every backend that loads it: they arrive equal, trust
    included, and neither end keeps them in a per-instance dict (the requests' way reads them
    from a slot)."""
    path = write(
        tmp_path / "serving.properties",
        "batch_size=4\nmax_batch_delay=20\nmaxWorkers=3\noption.method=predict_proba\n",
    )
    config = model_config_from_properties(read_properties(path), ModelConfig(), str(path))
    arrived = pickle.loads(pickle.dumps(config, protocol=5))
    assert arrived == config
    assert (arrived.batch_size, arrived.batch_delay_s, arrived.max_workers) == (4, 0.02, 3)
    assert arrived.method == "predict_proba"
    assert arrived.trust == config.trust
    for settings in (config, arrived, arrived.trust):
        assert not hasattr(settings, "__dict__")
