"""Management that reaches every instance (option ``peers``): two real servers on loopback ports
that name each other (and themselves, as a DNS name of every pod would); a management call made
on one is applied by both, a peer that is down is reported, a call that fails is not sent on,
and a new instance takes the versions' rollouts from a peer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserver.api.peers import FORWARDED, PEERS_HEADER, Peers, adopt_rollouts
from mmserver.api.web import STATE
from mmserver.commands.procfs import free_port
from mmserver.config.peers import parse_peers
from mmserver.errors import ConfigError
from tests.integration.harness import Harness, Serve, describe
from tests.integration.test_versions import make_versioned_store, predict


async def pair(serve: Serve, store: Path, tmp_path: Path) -> tuple[Harness, Harness, str]:
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    servers = [
        await serve(
            model_store=str(store), cache_dir=str(tmp_path / f"cache-{n}"), port=p, peers=peers
        )
        for n, p in enumerate(ports)
    ]
    return servers[0], servers[1], peers


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return make_versioned_store(tmp_path / "store")


async def test_a_call_made_on_one_instance_is_applied_by_both(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    a, b, _ = await pair(serve, store, tmp_path)
    for harness in (a, b):
        assert (await predict(harness, "/predictions/versioned"))["predictions"] == [12.0]
    response = await a.client.put("/models/versioned/1/set-default")
    assert response.status == 200, await response.text()
    # One peer besides itself, and it applied the call.
    assert response.headers[PEERS_HEADER] == "1/1"
    assert "peers" not in await response.json()
    for harness in (a, b):
        assert (await predict(harness, "/predictions/versioned"))["predictions"] == [11.0]
        assert "versioned/1" in harness.wlm.room.loaded
    # Workers and unloads too.
    response = await b.client.put("/models/plain?max_worker=3")
    assert response.status == 200, await response.text()
    assert response.headers[PEERS_HEADER] == "1/1"
    for harness in (a, b):
        assert (await describe(harness, "plain"))["workerGroups"][0]["maxWorkers"] == 3
    response = await a.client.delete("/models/plain")
    assert response.status == 200
    for harness in (a, b):
        assert "plain" not in harness.wlm.room.loaded


async def test_a_call_refused_here_is_not_sent_on(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    a, b, _ = await pair(serve, store, tmp_path)
    await predict(b, "/predictions/plain")
    response = await a.client.put("/models/plain?max_worker=3&min_worker=5")
    assert response.status == 400
    assert PEERS_HEADER not in response.headers
    assert (await describe(b, "plain"))["workerGroups"][0]["maxWorkers"] == 2


async def test_a_peer_that_does_not_answer_is_reported_and_the_call_stands(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    down = free_port()  # nothing listens there
    port = free_port()
    a = await serve(
        model_store=str(store),
        cache_dir=str(tmp_path / "cache"),
        port=port,
        peers=f"127.0.0.1:{port},127.0.0.1:{down}",
    )
    response = await a.client.put("/models/versioned/1/set-default")
    assert response.status == 200
    assert response.headers[PEERS_HEADER] == "0/1"
    [failed] = (await response.json())["peers"]
    assert failed["peer"] == f"127.0.0.1:{down}"
    assert failed["status"] == 0 and "ClientConnectorError" in failed["error"]
    assert (await predict(a, "/predictions/versioned"))["predictions"] == [11.0]


async def test_a_new_instance_takes_the_rollouts_of_its_peers(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    a, _, peers = await pair(serve, store, tmp_path)
    response = await a.client.put("/models/versioned/1/set-canary?percent=25")
    assert response.status == 200, await response.text()
    # A third instance, new (no rollouts.json of its own), asks the others first.
    cache = tmp_path / "cache-new"
    cache.mkdir()
    state_file = cache / "rollouts.json"
    asking = Peers(peers)
    try:
        assert await adopt_rollouts(asking, state_file)
        # One that has its own keeps it.
        assert not await adopt_rollouts(asking, state_file)
    finally:
        await asking.close()
    saved = json.loads(state_file.read_text())["models"]["versioned"]
    assert saved["canary"] == [1, 25.0]
    new = await serve(model_store=str(store), cache_dir=str(cache), peers=peers)
    model = await describe(new, "versioned/1")
    assert (model["canaryPercent"], model["canaryFrom"]) == (25.0, "management")


async def test_an_instance_does_not_apply_a_call_from_itself(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    a, _, _ = await pair(serve, store, tmp_path)
    instance = a.client.app[STATE].peers.instance
    response = await a.client.put("/models/versioned/1/set-default", headers={FORWARDED: instance})
    assert response.status == 208
    assert a.wlm.versions.saved() == {"models": {}}


def test_the_option_is_host_port_pairs_or_a_dns_name() -> None:
    assert parse_peers("10.0.0.1:8080, [::1]:9000") == ((("10.0.0.1", 8080), ("::1", 9000)), None)
    assert parse_peers("dns:mmserver-headless.ml.svc:8080") == (
        (),
        ("mmserver-headless.ml.svc", 8080),
    )
    for bad in ("10.0.0.1", "dns:name", "host:99999", "dns::80"):
        with pytest.raises(ConfigError, match="host:port, or dns:NAME:PORT"):
            parse_peers(bad)


async def test_a_peers_rollouts_are_read_with_the_management_token(
    serve: Serve, store: Path, tmp_path: Path
) -> None:
    token = "s3cret"
    port = free_port()
    peers = f"127.0.0.1:{port}"
    a = await serve(
        model_store=str(store),
        cache_dir=str(tmp_path / "cache"),
        port=port,
        peers=peers,
        management_token=token,
    )
    bearer = {"Authorization": f"Bearer {token}"}
    response = await a.client.put("/models/versioned/1/set-default", headers=bearer)
    assert response.status == 200, await response.text()
    # They name the server's models: nobody without the token reads them.
    response = await a.client.get("/peers/rollouts")
    assert response.status == 401
    state_file = tmp_path / "new" / "rollouts.json"
    state_file.parent.mkdir()
    for given, adopted in (("", False), (token, True)):
        asking = Peers(peers, given)
        try:
            assert await adopt_rollouts(asking, state_file) is adopted
        finally:
            await asking.close()
    assert json.loads(state_file.read_text())["models"]["versioned"]["default"] == 1
