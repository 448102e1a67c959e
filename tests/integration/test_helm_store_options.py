"""The chart's model store, cache, server options and ports: each kind of store and each value
set both ways, rendered and validated (:mod:`tests.integration.helmchart`), with the volumes, the
mounts and the ``MMSERVER_*`` variables the server reads checked."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.integration.helmchart import (
    CHART,
    HEADLESS,
    OPTIONS,
    merge_on,
    refusal,
    render,
)

# The model store ----------------------------------------------------------------------------------


def test_a_store_on_a_claim_is_mounted_read_only() -> None:
    rendered = render({"modelStore": {"mountPath": "/srv/models"}})
    assert rendered.volume("model-store") == {
        "name": "model-store",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    assert rendered.mount("model-store") == {
        "name": "model-store",
        "mountPath": "/srv/models",
        "readOnly": True,
    }
    assert rendered.env_value("MMSERVER_MODEL_STORE") == "/srv/models"
    message = refusal({"modelStore": {"persistentVolumeClaim": {"claimName": ""}}})
    assert "claimName" in message, message


def test_a_store_on_the_node() -> None:
    rendered = render({"modelStore": {"type": "hostPath", "hostPath": {"path": "/data/models"}}})
    assert rendered.volume("model-store") == {
        "name": "model-store",
        "hostPath": {"path": "/data/models", "type": "Directory"},
    }
    assert rendered.env_value("MMSERVER_MODEL_STORE") == "/models"
    assert (rendered.mount("model-store") or {}).get("readOnly") is True
    message = refusal({"modelStore": {"type": "hostPath"}})
    assert "hostPath.path" in message, message


@pytest.mark.parametrize(("size", "source"), [("", {}), ("5Gi", {"sizeLimit": "5Gi"})])
def test_an_empty_store_per_pod(size: str, source: dict[str, str]) -> None:
    rendered = render({"modelStore": {"type": "emptyDir", "emptyDir": {"sizeLimit": size}}})
    assert rendered.volume("model-store") == {"name": "model-store", "emptyDir": source}
    assert rendered.env_value("MMSERVER_MODEL_STORE") == "/models"


@pytest.mark.parametrize("credentials", ["", "s3-keys"])
@pytest.mark.parametrize(("region", "endpoint"), [("", ""), ("eu-west-1", "http://minio:9000")])
def test_a_store_on_s3(credentials: str, region: str, endpoint: str) -> None:
    s3 = {
        "url": "s3://models/prod",
        "region": region,
        "endpointUrl": endpoint,
        "credentialsSecret": credentials,
        "accessKeyIdKey": "id",
    }
    rendered = render({"modelStore": {"type": "s3", "s3": s3}})
    assert rendered.env_value("MMSERVER_MODEL_STORE") == "s3://models/prod"
    assert rendered.volume("model-store") is None and rendered.mount("model-store") is None
    assert rendered.env_value("AWS_DEFAULT_REGION") == (region or None)
    assert rendered.env_value("AWS_ENDPOINT_URL") == (endpoint or None)
    if credentials:
        assert rendered.secret_ref("AWS_ACCESS_KEY_ID") == ("s3-keys", "id")
        assert rendered.secret_ref("AWS_SECRET_ACCESS_KEY") == ("s3-keys", "AWS_SECRET_ACCESS_KEY")
    else:
        assert "AWS_ACCESS_KEY_ID" not in rendered.env
        assert "AWS_SECRET_ACCESS_KEY" not in rendered.env


def test_an_s3_store_needs_an_s3_url() -> None:
    message = refusal({"modelStore": {"type": "s3", "s3": {"url": "/models"}}})
    assert "s3://" in message, message


@pytest.mark.parametrize(("size", "source"), [("", {}), ("20Gi", {"sizeLimit": "20Gi"})])
def test_the_cache_and_tmp_are_volumes_of_each_pod(size: str, source: dict[str, str]) -> None:
    rendered = render({"cache": {"sizeLimit": size}})
    assert rendered.volume("cache") == {"name": "cache", "emptyDir": source}
    assert (rendered.mount("cache") or {}).get("mountPath") == "/cache"
    assert rendered.env_value("MMSERVER_CACHE_DIR") == "/cache"
    assert rendered.volume("tmp") == {"name": "tmp", "emptyDir": {}}
    assert (rendered.mount("tmp") or {}).get("mountPath") == "/tmp"


# Options and ports --------------------------------------------------------------------------------


def test_server_options_become_mmserver_variables() -> None:
    options = {
        "max_loaded_models": 200,
        "max_request_size": 10485760,
        "heavy_batch_ms": 2.5,
        "access_log": True,
        "metrics_model_label": "all",
    }
    rendered = render({"server": {"options": options}})
    for name, value in options.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        assert rendered.env_value(f"MMSERVER_{name.upper()}") == text
    assert rendered.env_value("MMSERVER_LOG_FORMAT") == "json", "values.yaml's option is gone"


def test_without_options_only_the_charts_own_variables_are_set() -> None:
    rendered = render({"server": {"options": None}})
    assert sorted(rendered.env) == [
        "MMSERVER_CACHE_DIR",
        "MMSERVER_DRAIN_TIMEOUT",
        "MMSERVER_HOST",
        "MMSERVER_MANAGEMENT_TOKEN",
        "MMSERVER_MODEL_STORE",
        "MMSERVER_PEERS",
        "MMSERVER_PORT",
    ]


def test_every_mmserver_variable_the_chart_sets_is_an_option_of_the_server() -> None:
    rendered = render(merge_on({"managementToken": {"insecure": True}}))
    names = [n for n in rendered.env if n.startswith("MMSERVER_")]
    assert len(names) >= 10, names
    assert {n.removeprefix("MMSERVER_").lower() for n in names} <= OPTIONS
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults["server"]["options"]) <= OPTIONS


@pytest.mark.parametrize(
    ("option", "value"), [("port", 9000), ("drain_timeout", 5), ("management_token", "x")]
)
def test_an_option_the_chart_sets_itself_is_refused_in_options(option: str, value: Any) -> None:
    message = refusal({"server": {"options": {option: value}}})
    assert f"server.options.{option}" in message, message


def test_the_options_the_chart_sets_itself_are_options_of_the_server() -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = helpers.split('define "mmserver.reservedOptions"')[1].split("{{- end }}")[0]
    reserved = yaml.safe_load(block.split("-}}", 1)[1])
    assert len(reserved) == 9 and set(reserved) <= OPTIONS


def test_an_option_spelled_as_a_variable_is_refused() -> None:
    message = refusal({"server": {"options": {"MAX_WORKERS": 4}}})
    assert "lower case" in message, message


def test_extra_environment_variables_follow() -> None:
    extra = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    rendered = render({"server": {"extraEnv": extra}})
    assert rendered.container["env"][-1] == extra[0]


@pytest.mark.parametrize("grpc_port", [0, 8081])
def test_the_grpc_port_only_when_set(grpc_port: int) -> None:
    rendered = render({"server": {"grpcPort": grpc_port}})
    ports = {p["name"]: p["containerPort"] for p in rendered.container["ports"]}
    services = [rendered.one("Service"), rendered.one("Service", HEADLESS)]
    if grpc_port:
        assert ports == {"http": 8080, "grpc": 8081}
        assert rendered.env_value("MMSERVER_GRPC_PORT") == "8081"
        for service in services:
            assert {"name": "grpc", "port": 8081, "targetPort": "grpc", "protocol": "TCP"} in (
                service["spec"]["ports"]
            )
    else:
        assert ports == {"http": 8080}
        assert "MMSERVER_GRPC_PORT" not in rendered.env
        for service in services:
            assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_the_grpc_port_is_not_the_http_port() -> None:
    message = refusal({"server": {"grpcPort": 8080}})
    assert "grpcPort" in message, message
