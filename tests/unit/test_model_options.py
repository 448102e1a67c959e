"""Each model option is declared once (mmserver.config.model.option): what reads it follows."""

from __future__ import annotations

import dataclasses

import pytest

from mmserver.config.model import (
    MODEL_KEYS,
    RESCALABLE,
    SERVER_DEFAULTS,
    ModelConfig,
    model_config_from_properties,
)
from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError

SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("name", SERVER_DEFAULTS)
def test_a_global_default_is_the_model_options_default_and_help(name: str) -> None:
    server, model = SERVER_FIELDS[name], MODEL_FIELDS[name]
    assert server.metadata["help"] == model.metadata["help"]
    assert getattr(ServerConfig(), name) == getattr(ModelConfig(), name)


def test_model_defaults_copy_exactly_the_global_defaults() -> None:
    config = ServerConfig(batch_size=7, max_batch_delay=3, predict_timeout=9.0)
    defaults = config.model_defaults()
    assert {n: getattr(defaults, n) for n in SERVER_DEFAULTS} == {
        n: getattr(config, n) for n in SERVER_DEFAULTS
    }


@pytest.mark.parametrize(("key", "spec"), sorted(MODEL_KEYS.items()))
def test_every_key_reaches_its_field(key: str, spec: tuple[str, type]) -> None:
    name, kind = spec
    assert key in MODEL_FIELDS[name].metadata["keys"]
    raw = {"engine": "sklearn", "missing_values": "refuse"}.get(
        name, {bool: "true", int: "3", float: "3.5", str: "predict"}[kind]
    )
    config = model_config_from_properties({key: raw}, ModelConfig(max_workers=4), "x")
    assert getattr(config, name) == {bool: True, int: 3, float: 3.5}.get(kind, raw)


def test_rescalable_options_are_declared_so() -> None:
    assert set(RESCALABLE) == {n for n, f in MODEL_FIELDS.items() if f.metadata.get("rescalable")}
    assert "max_batch_bytes" not in RESCALABLE and "batch_size" in RESCALABLE


@pytest.mark.parametrize(
    ("name", "least"),
    [(n, f.metadata["minimum"]) for n, f in MODEL_FIELDS.items() if f.metadata.get("minimum")],
)
def test_a_declared_minimum_is_checked(name: str, least: int) -> None:
    key = MODEL_FIELDS[name].metadata["keys"][0]
    with pytest.raises(ConfigError, match=f"{key}=0 must be >= {least}"):
        ModelConfig(max_workers=4).replace(**{name: least - 1})
