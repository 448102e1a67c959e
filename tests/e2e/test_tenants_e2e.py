"""Tenants on the real server: ``mmserver serve --tenants FILE`` with real backend processes,
boto3 signing with a tenant's keys, bearer tokens on the lean path, SIGHUP reading the file
again, and a refused file stopping the start with its lines."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from botocore.exceptions import ClientError

from mmserver.commands.procfs import free_port
from tests.e2e.server_process import ServerProcess, one_model_store, until
from tests.integration.test_tenants import runtime

pytestmark = pytest.mark.e2e

TENANTS = """\
tenants:
  acme:
    models: ["sklearn-*"]
    access_keys: {AKIAACME00000001: "acme-secret"}
    tokens: ["tok-acme-0001"]
"""


async def status_of(session: aiohttp.ClientSession, url: str, token: str) -> int:
    async with session.post(
        f"{url}/predictions/sklearn-0",
        data="[[0.5]]",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    ) as response:
        await response.read()
        return response.status


async def test_tenants_on_the_real_server_and_sighup(tmp_path: Path) -> None:
    store = one_model_store(tmp_path)
    tenants = tmp_path / "tenants.yaml"
    await asyncio.to_thread(tenants.write_text, TENANTS)
    log = tmp_path / "server.log"
    async with (
        ServerProcess(store, log, "--tenants", str(tenants)) as server,
        aiohttp.ClientSession() as session,
    ):
        assert await status_of(session, server.url, "tok-acme-0001") == 200
        assert await status_of(session, server.url, "tok-other-0001") == 401

        class Url:
            url = server.url

        client = runtime(Url(), "AKIAACME00000001", "acme-secret")  # type: ignore[arg-type]
        answer = await asyncio.to_thread(
            client.invoke_endpoint,
            EndpointName="mme",
            TargetModel="sklearn-0.tar.gz",
            Body=b"[[0.5]]",
            ContentType="application/json",
        )
        assert answer["ResponseMetadata"]["HTTPStatusCode"] == 200
        # A refused file keeps the tenants in force; a good one takes effect on SIGHUP.
        await asyncio.to_thread(tenants.write_text, TENANTS.replace("models:", "modelz:"))
        server.signal(signal.SIGHUP)
        await until(
            lambda: _logged(server, "SIGHUP: the tenants in force are kept"), 10, "the refusal"
        )
        assert "unknown key 'modelz'; did you mean 'models'?" in server.log()
        assert await status_of(session, server.url, "tok-acme-0001") == 200
        await asyncio.to_thread(
            tenants.write_text, TENANTS.replace("tok-acme-0001", "tok-acme-0002")
        )
        server.signal(signal.SIGHUP)
        await until(lambda: _logged(server, "read again (SIGHUP)"), 10, "the new file")
        assert await status_of(session, server.url, "tok-acme-0002") == 200
        assert await status_of(session, server.url, "tok-acme-0001") == 401
        with pytest.raises(ClientError) as caught:
            await asyncio.to_thread(
                runtime(Url(), "AKIAACME00000001", "wrong").invoke_endpoint,  # type: ignore[arg-type]
                EndpointName="mme",
                TargetModel="sklearn-0.tar.gz",
                Body=b"[[0.5]]",
                ContentType="application/json",
            )
        assert caught.value.response["Error"]["Code"] == "InvalidSignatureException"


async def _logged(server: ServerProcess, text: str) -> bool:
    return text in server.log()


def test_a_refused_tenants_file_stops_the_start(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS.replace('["sklearn-*"]', '["sklearn-["]'))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserver",
            "serve",
            "--model-store",
            str(tmp_path),
            "--port",
            str(free_port()),
            "--tenants",
            str(tenants),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "line 3: tenant acme: model pattern 'sklearn-[' leaves a [ open" in done.stderr
