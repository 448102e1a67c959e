"""Access to the management API (DESIGN §9): the bearer token, non-loopback addresses, the
refusal to start an exposed server, and the access-log switch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from mmserver.api.access import check_security
from mmserver.app import access_log_enabled
from mmserver.commands.procfs import free_port
from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError
from tests.e2e.cluster_process import require_haproxy, run_cli
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


async def test_a_balancer_config_off_loopback_needs_a_token_and_haproxy_asks_for_it(
    serve: Serve, tmp_path: Path
) -> None:
    harness = await serve()  # on loopback: its management calls need no token
    server = f"127.0.0.1:{harness.client.port}"

    async def config(*args: str) -> tuple[int, str]:
        return await run_cli("config", "--server", server, *args)

    code, out = await config("--bind", "0.0.0.0")
    assert code == 2 and "refusing to bind 0.0.0.0" in out and "--management-token" in out
    code, out = await config("--bind", "0.0.0.0", "--insecure-management")
    assert code == 0 and "bind 127.0.0.1:8404" in out  # the stats page stays on loopback
    code, out = await config("--bind", "0.0.0.0", "--management-token", 'a"b')
    assert code == 2 and "--management-token" in out
    # With a token, HAProxy itself refuses management calls that lack it (here on loopback,
    # where it can be reached by the test).
    haproxy = require_haproxy()
    port, stats_port = free_port(), free_port()
    code, out = await config(
        "--port", str(port), "--stats-port", str(stats_port), "--management-token", "s3cret"
    )
    assert code == 0, out
    (tmp_path / "haproxy.cfg").write_text(out)
    proc = await asyncio.create_subprocess_exec(
        haproxy, "-f", str(tmp_path / "haproxy.cfg"), "-db", stderr=asyncio.subprocess.DEVNULL
    )
    try:
        async with ClientSession(f"http://127.0.0.1:{port}") as client:
            for _ in range(400):  # until HAProxy listens and has seen the instance up
                try:
                    async with client.get("/ping") as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                await asyncio.sleep(0.025)
            for method, path in (
                ("DELETE", "/models/sklearn-0"),
                ("PUT", "/models/sklearn-0?max_worker=1"),
                ("POST", "/models?url=sklearn-1.tar.gz"),
                ("POST", "/v2/repository/models/sklearn-1/load"),
                ("POST", "/predictions/../models?url=sklearn-1.tar.gz"),
                ("POST", "/%6dodels?url=sklearn-1.tar.gz"),
            ):
                async with client.request(method, path) as response:
                    assert response.status == 401, (method, path)
                    body = await response.json()
                    assert "Authorization: Bearer <management token>" in body["message"]
            assert list(harness.wlm.room.loaded) == []
            async with client.post("/predictions/sklearn-0", json=[[0.5]]) as response:
                assert response.status == 200
            auth = {"Authorization": "Bearer s3cret"}
            async with client.delete("/models/sklearn-0", headers=auth) as response:
                assert response.status == 200
    finally:
        proc.kill()
        await proc.wait()
