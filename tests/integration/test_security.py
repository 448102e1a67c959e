"""Access to the management API (DESIGN §9): the bearer token, non-loopback addresses, the
refusal to start an exposed server, and the access-log switch."""

from __future__ import annotations

from typing import Any

import pytest

from mmserver.api.middleware import check_security
from mmserver.app import access_log_enabled
from mmserver.config import ServerConfig
from mmserver.errors import ConfigError
from tests.integration.harness import Serve, error_of


async def test_token_is_required_when_configured(serve: Serve) -> None:
    harness = await serve(management_token="s3cret-token")
    calls = [
        ("POST", "/models?url=sklearn-50.tar.gz&model_name=guarded"),
        ("PUT", "/models/guarded?max_worker=1"),
        ("DELETE", "/models/guarded"),
    ]
    for method, path in calls:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic s3cret-token"},
            {"Authorization": "Bearer s3cret-token-and-more"},
            {"Authorization": "Bearer é"},
        ):
            response = await harness.client.request(method, path, headers=headers)
            assert response.status == 401, (method, headers)
            body = await error_of(response)
            assert body["type"] == "BadRequestException"
            assert "Authorization: Bearer <management token>" in body["message"]
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
    good = {"Authorization": "Bearer s3cret-token"}
    for method, path in calls:
        response = await harness.client.request(method, path, headers=good)
        assert response.status == 200, await response.text()
    # Reads, inference, health and metrics need no token.
    for method, path in [("GET", "/models"), ("GET", "/models/sklearn-50"), ("GET", "/ping")]:
        assert (await harness.client.request(method, path)).status == 200
    assert (await harness.post("/models/sklearn-50/invoke", "[[0.5]]")).status == 200


async def test_non_loopback_without_token(serve: Serve) -> None:
    refused = await serve(host="0.0.0.0")
    response = await refused.client.delete("/models/sklearn-0")
    assert response.status == 401
    assert "the server has none configured" in (await error_of(response))["message"]

    open_ = await serve(host="0.0.0.0", insecure_management=True)
    assert (await open_.post("/predictions/sklearn-0", "[[0.5]]")).status == 200
    assert (await open_.client.delete("/models/sklearn-0")).status == 200


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({}, False),
        ({"host": "localhost"}, False),
        ({"host": "::1"}, False),
        ({"host": "0.0.0.0"}, True),
        ({"host": "10.1.2.3"}, True),
        ({"host": "0.0.0.0", "management_token": "t"}, False),
        ({"host": "0.0.0.0", "insecure_management": True}, False),
    ],
)
def test_check_security(options: dict[str, Any], refused: bool) -> None:
    config = ServerConfig(**options)
    if refused:
        with pytest.raises(ConfigError) as caught:
            check_security(config)
        assert "--management-token" in caught.value.message
        assert "--insecure-management" in caught.value.message
    else:
        check_security(config)


def test_access_log_switch() -> None:
    assert access_log_enabled(ServerConfig()) is False
    assert access_log_enabled(ServerConfig(access_log=True)) is True
