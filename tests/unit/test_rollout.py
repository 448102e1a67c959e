"""The rollout's pure decisions, version names and the comparison of shadow answers, by table."""

from __future__ import annotations

import json

import pytest

from mmserver import errors
from mmserver.lifecycle.shadow import same_answers
from mmserver.policy.rollout import (
    FROM_CONFIG,
    FROM_MANAGEMENT,
    FROM_STORE,
    Saved,
    Share,
    canary_bucket,
    make_rollout,
    percent_of,
    shadow_bucket,
)
from mmserver.store.names import entry_version, file_stem, key_of_stem, normalize_target

VERSIONS = (1, 2, 5)


@pytest.mark.parametrize(
    ("props", "saved", "default", "source", "shares"),
    [
        ({}, None, 5, FROM_STORE, {}),
        ({"option.default_version": "2"}, None, 2, FROM_CONFIG, {}),
        ({"option.default_version": " 1 "}, Saved(default=2), 2, FROM_MANAGEMENT, {}),
        ({}, Saved(default=4), 5, FROM_STORE, {}),  # a saved version the store no longer holds
        (
            {"option.canary_version": "1", "option.canary_percent": "12.5"},
            None,
            5,
            FROM_STORE,
            {"canary": Share(1, 12.5, FROM_CONFIG)},
        ),
        (
            {"option.shadow_version": "2", "option.shadow_percent": "100"},
            Saved(shadow=[1, 30.0]),
            5,
            FROM_STORE,
            {"shadow": Share(1, 30.0, FROM_MANAGEMENT)},
        ),
        (
            {"option.canary_version": "1", "option.canary_percent": "10"},
            Saved(canary=[None, 0.0]),  # ended by a call
            5,
            FROM_STORE,
            {},
        ),
    ],
)
def test_a_rollout_is_made_from_the_store_the_file_and_the_calls(
    props: dict[str, str],
    saved: Saved | None,
    default: int,
    source: str,
    shares: dict[str, Share],
) -> None:
    rollout = make_rollout("m", VERSIONS, props, saved)
    assert (rollout.default, rollout.default_from, rollout.shares) == (default, source, shares)
    assert rollout.error is None


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"option.default_version": "3"}, "option.default_version='3' is not one of its versions"),
        ({"option.canary_version": "x"}, "option.canary_version='x' is not one of its versions"),
        (
            {"option.shadow_version": "1", "option.shadow_percent": "101"},
            "option.shadow_percent='101' must be a number from 0 to 100",
        ),
    ],
)
def test_a_key_naming_no_version_is_the_rollouts_error(props: dict[str, str], message: str) -> None:
    rollout = make_rollout("m", VERSIONS, props, None)
    assert rollout.error is not None and message in rollout.error.message
    # A call that names the default clears it.
    assert make_rollout("m", VERSIONS, props, Saved(default=1)).error is None


def test_the_canary_takes_the_keys_below_its_share_and_the_draws_below_it() -> None:
    rollout = make_rollout(
        "m", VERSIONS, {"option.canary_version": "1", "option.canary_percent": "25"}, None
    )
    keys = [f"k{i}" for i in range(2000)]
    picked = [rollout.pick(key, lambda: 0.0) for key in keys]
    assert {k for k, p in zip(keys, picked, strict=True) if p == "m/1"} == {
        k for k in keys if canary_bucket(k) < 25
    }
    assert 400 <= picked.count("m/1") <= 600
    assert rollout.pick(None, lambda: 0.2499) == "m/1"
    assert rollout.pick(None, lambda: 0.25) == "m/5"
    # The shadow hashes the keys apart from the canary.
    assert sum(1 for k in keys if (canary_bucket(k) < 25) == (shadow_bucket(k) < 25)) < 1800


def test_a_share_on_the_default_version_or_of_zero_takes_nothing() -> None:
    rollout = make_rollout("m", VERSIONS, {}, Saved(canary=[5, 50.0], shadow=[1, 0.0]))
    assert rollout.share("canary") is None and rollout.share("shadow") is None
    assert rollout.takes("shadow", "k", lambda: 0.0) is None


@pytest.mark.parametrize("value", ["-1", "100.5", "nan", "inf", "x", True, None, [1]])
def test_a_share_is_a_number_from_0_to_100(value: object) -> None:
    with pytest.raises(errors.ConfigError, match="must be a number from 0 to 100"):
        percent_of(value, "parameter percent")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("m", "m"),
        ("m.tar.gz", "m"),
        ("m/2", "m/2"),
        ("m/2.tar.gz", "m/2"),
        ("m.tar.gz/12", "m/12"),
    ],
)
def test_version_keys(name: str, key: str) -> None:
    assert normalize_target(name) == key
    assert key_of_stem(file_stem(key)) == key and "/" not in file_stem(key)


@pytest.mark.parametrize("name", ["m/0", "m/01", "m/x", "m/2/3", "/2", "m/"])
def test_what_is_not_a_version_is_refused(name: str) -> None:
    with pytest.raises(errors.InvalidModelName):
        normalize_target(name)


@pytest.mark.parametrize(
    ("filename", "version"),
    [("1", 1), ("12.tar.gz", 12), ("3.tgz", 3), ("01", None), ("a", None), ("2.zip", None)],
)
def test_the_entries_of_a_model_folder_that_are_versions(
    filename: str, version: int | None
) -> None:
    assert entry_version(filename) == version


@pytest.mark.parametrize(
    ("primary", "shadow", "same"),
    [
        ({"predictions": [1.0, 2.0]}, {"predictions": [1.0, 2.0000000001]}, True),
        ({"predictions": [1.0]}, {"predictions": [1.001]}, False),
        ({"predictions": [[0.1, 0.9]]}, {"predictions": [[0.1, 0.9], [0.0, 1.0]]}, False),
        (
            {"model_name": "m", "model_version": "2", "outputs": [{"data": [3]}]},
            {"model_name": "m", "model_version": "3", "outputs": [{"data": [3]}]},
            True,
        ),
        ({"predictions": [True]}, {"predictions": [1]}, False),
        ({"predictions": ["a"]}, {"predictions": ["b"]}, False),
    ],
)
def test_shadow_answers_compare_by_value(primary: object, shadow: object, same: bool) -> None:
    assert same_answers(json.dumps(primary).encode(), json.dumps(shadow).encode()) is same


def test_answers_that_are_not_json_compare_byte_for_byte() -> None:
    assert same_answers(b"1.0\n2.0\n", b"1.0\n2.0\n")
    assert not same_answers(b"1.0\n2.0\n", b"1.0\n2.5\n")
