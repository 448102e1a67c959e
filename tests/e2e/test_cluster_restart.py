"""``mmserver cluster restart`` on a running 2-instance cluster under a steady client through the
balancer: every instance is taken out of HAProxy, drained, restarted and put back once its warm
set is loaded again, one at a time.

The contract: no request fails, every instance runs a new process, and each comes back with the
models it had loaded. The client runs until the restart has ended and a few more requests have
been answered, within a bound in count and in time. An instance that does not come back ends
the restart, failed, with the instances after it untouched.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.cluster_process import ClusterProcess, require_haproxy, run_cli
from tests.e2e.test_cluster import check_answer, request_for
from tests.models import make_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

MODELS = 8
USERS = 8
#: The client's bounds: requests in all, seconds in all, and requests after the restart ended.
MAX_REQUESTS = 200_000
LOAD_TIMEOUT_S = 60.0
AFTER = 50


async def loaded_models(session: aiohttp.ClientSession, port: int) -> set[str]:
    """The models instance ``port`` has loaded (``GET /models``, status READY)."""
    async with session.get(f"http://127.0.0.1:{port}/models") as response:
        body = await response.json()
    return {m["modelName"] for m in body["models"] if m["status"] == "READY"}


async def test_a_rolling_restart_under_load_fails_no_request(tmp_path: Path) -> None:
    require_haproxy()
    store = make_store(tmp_path / "store", MODELS)
    state_dir = tmp_path / "state"
    async with ClusterProcess(
        store,
        state_dir,
        "--instances",
        "2",
        "--backend-processes",
        "1",
        "--check-interval-ms",
        "200",
    ) as cluster:
        old_pids = {i["name"]: int(i["pid"]) for i in cluster.state["instances"]}
        ports = {i["name"]: int(i["port"]) for i in cluster.state["instances"]}
        timeout = aiohttp.ClientTimeout(total=30)
        connector = aiohttp.TCPConnector(limit=USERS)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def send(i: int) -> tuple[str | None, str]:
                path, headers = request_for(i, MODELS)
                async with session.post(
                    cluster.url + path, data=b"[[0.5]]", headers=headers
                ) as response:
                    body = await response.json(content_type=None)
                    return (
                        check_answer(response.status, body),
                        response.headers.get("X-Mmserver-Instance", ""),
                    )

            # Every model on every instance, requested straight at each one.
            for port in ports.values():
                for m in range(MODELS):
                    async with session.post(
                        f"http://127.0.0.1:{port}/predictions/sklearn-{m}",
                        data=b"[[0.5]]",
                        headers={"Content-Type": "application/json"},
                    ) as response:
                        assert response.status == 200, await response.text()
            before = {name: await loaded_models(session, port) for name, port in ports.items()}
            assert all(len(models) == MODELS for models in before.values()), before

            # Asynchronous inference is refused by the balancer, as before the instances had a
            # state_dir each.
            async with session.post(
                cluster.url + "/endpoints/e/async-invocations",
                headers={
                    "X-Amzn-SageMaker-Target-Model": "sklearn-0",
                    "Content-Type": "application/json",
                },
                data=b"[[0.5]]",
            ) as response:
                assert response.status == 404
                assert "not served through mmserver cluster" in await response.text()

            failures: list[str] = []
            served: Counter[str] = Counter()
            during = 0
            after = 0
            ended = asyncio.Event()
            loop = asyncio.get_running_loop()
            give_up = loop.time() + LOAD_TIMEOUT_S
            sent = 0

            async def user() -> None:
                nonlocal sent, during, after
                while sent < MAX_REQUESTS and after < AFTER and loop.time() < give_up:
                    i = sent
                    sent += 1
                    try:
                        problem, by = await send(i)
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        problem, by = f"{type(exc).__name__}: {exc}", ""
                    if problem is not None:
                        failures.append(f"request {i}: {problem}")
                    served[by] += 1
                    if ended.is_set():
                        after += 1
                    else:
                        during += 1

            async def restart() -> tuple[int, str]:
                try:
                    return await run_cli("restart", "--state-dir", str(state_dir), timeout=100)
                finally:
                    ended.set()

            users = asyncio.gather(*(user() for _ in range(USERS)))
            code, out = await restart()
            await users

        assert code == 0, f"{out}\n{cluster.logs()}"
        assert "restarted 2 instance(s), one at a time" in out, out
        assert failures == [], f"{len(failures)} failed: {failures[:10]}\n{out}\n{cluster.logs()}"
        assert after >= AFTER, (sent, during, after)
        assert during > 0 and set(served) == {"i0", "i1"}, served

        # A new process for each instance, on its port, with the models it had.
        state = cluster.reload_state()
        for each in state["instances"]:
            assert int(each["pid"]) != old_pids[each["name"]], each
            assert int(each["port"]) == ports[each["name"]]
        restart = state["restart"]
        assert restart["phase"] == "done" and restart["seq"] == 1, restart
        for each in restart["instances"]:
            assert each["new_pid"] == int(cluster.instance(each["name"])["pid"])
            assert each["models_before"] == each["models_after"] == MODELS, restart
        async with aiohttp.ClientSession() as session:
            for name, port in ports.items():
                assert before[name] <= await loaded_models(session, port), name
        warm = json.loads((state_dir / "instance-0" / "warm.json").read_text())
        assert {m["model"] for m in warm["models"]} >= before["i0"]
        haproxy_log = (state_dir / "haproxy.log").read_text()
        for name in ports:
            assert f"Server instances/{name} enters drain state" in haproxy_log

        assert "stopped the cluster" in await cluster.stop()
        assert await cluster.leftovers() == []


async def test_restart_of_a_cluster_that_is_not_running_says_so(tmp_path: Path) -> None:
    for command in ("restart", "upgrade"):
        code, out = await run_cli(command, "--state-dir", str(tmp_path / "none"))
        assert code == 2, out
        assert f"mmserver cluster {command}: no cluster is running from" in out


async def test_an_instance_that_does_not_come_back_ends_the_restart(tmp_path: Path) -> None:
    require_haproxy()
    store = make_store(tmp_path / "store", 2)
    state_dir = tmp_path / "state"
    async with ClusterProcess(
        store, state_dir, "--instances", "2", "--backend-processes", "1"
    ) as cluster:
        old_pids = {i["name"]: int(i["pid"]) for i in cluster.state["instances"]}
        # The store is gone: the first instance started again exits at once.
        store.rename(tmp_path / "elsewhere")
        code, out = await run_cli("restart", "--state-dir", str(state_dir), timeout=100)
        assert code == 1, out
        assert "failed: instance i0 did not come back: exited with code" in out, out
        state = cluster.reload_state()
        assert state["restart"]["phase"] == "failed"
        # The instances after it keep their processes, and HAProxy still serves through them.
        assert int(cluster.instance("i1")["pid"]) == old_pids["i1"]
        stats = await cluster.server_stats()
        assert stats["i1"]["status"] == "UP", stats["i1"]
        (tmp_path / "elsewhere").rename(store)
