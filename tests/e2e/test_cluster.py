"""Three mmserver instances behind HAProxy (``scripts/cluster``), once per routing strategy:
requests for many models through the balancer, by every inference path, each answer checked;
one instance is killed (SIGKILL) in the middle of the load.

The contract: no request fails. A request sent to the killed instance after it died meets a
refused connection (HAProxy's ``conn-failure``); one that was inside it when it died sees its
connection closed with no answer (``empty-response``). Both are retried on another instance,
and running a prediction twice has no side effect. Only an answer cut in the middle could not
be retried; mmserver writes its small answers in one go, so none is.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.cluster_process import ClusterProcess, require_haproxy, run_cli
from tests.e2e.server_process import alive
from tests.models import make_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

MODELS = 50
USERS = 24
REQUESTS = 1500
KILL_AFTER = 400
LOAD_TIMEOUT_S = 40.0
STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "MODEL_AFFINITY")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("cluster") / "store", MODELS)


def request_for(i: int, models: int = MODELS) -> tuple[str, dict[str, str]]:
    """Request ``i``: model ``sklearn-(i % models)`` by one of the inference paths, under
    either of its names."""
    name = f"sklearn-{i % models}" + (".tar.gz" if i % 7 == 0 else "")
    json_type = {"Content-Type": "application/json"}
    match i % 4:
        case 0:
            return f"/predictions/{name}", json_type
        case 1:
            return "/invocations", {**json_type, "X-Amzn-SageMaker-Target-Model": name}
        case 2:
            return f"/models/{name}/invoke", json_type
        case _:
            return "/endpoints/e/invocations", {
                **json_type,
                "X-Amzn-SageMaker-Target-Model": name,
            }


def check_answer(status: int, body: object) -> str | None:
    """Why the answer is wrong, or None: y = 2x + 1 + noise predicts about 2.0 at x = 0.5."""
    if status != 200:
        return f"status {status}: {body}"
    predictions = body.get("predictions") if isinstance(body, dict) else None
    if not (
        isinstance(predictions, list)
        and len(predictions) == 1
        and abs(float(predictions[0]) - 2.0) < 0.05
    ):
        return f"wrong answer {body}"
    return None


async def models_loaded(session: aiohttp.ClientSession, port: int) -> int:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    found = re.search(r"^mmserver_models_loaded (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_cluster_serves_every_request_while_an_instance_is_killed(
    strategy: str, store: Path, tmp_path: Path
) -> None:
    require_haproxy()
    async with ClusterProcess(
        store,
        tmp_path / "state",
        "--instances",
        "3",
        "--strategy",
        strategy,
        "--backend-processes",
        "1",
        "--check-interval-ms",
        "200",
    ) as cluster:
        connector = aiohttp.TCPConnector(limit=USERS)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def send(i: int) -> tuple[str | None, str]:
                path, headers = request_for(i)
                async with session.post(
                    cluster.url + path, data=b"[[0.5]]", headers=headers
                ) as response:
                    body = await response.json(content_type=None)
                    served_by = response.headers.get("X-Mmserver-Instance", "")
                    return check_answer(response.status, body), served_by

            # One request at a time: every model once by each path.
            served: dict[int, set[str]] = defaultdict(set)
            for i in range(4 * MODELS):
                problem, served_by = await send(i)
                assert problem is None, problem
                served[i % MODELS].add(served_by)
            if strategy == "MODEL_AFFINITY":
                # Each model on one instance, whatever path and name: loaded once in all.
                assert all(len(names) == 1 for names in served.values()), served
                loaded = [
                    await models_loaded(session, int(i["port"])) for i in cluster.state["instances"]
                ]
                assert sum(loaded) == MODELS, loaded
                assert all(n > 0 for n in loaded), loaded
            assert set().union(*served.values()) == {"i0", "i1", "i2"}

            # Then USERS concurrent users, REQUESTS in all, and a kill in the middle.
            done = 0
            failures: list[str] = []
            per_instance: Counter[str] = Counter()
            killed = asyncio.Event()
            victim_family: set[int] = set()
            victim, victim_pid = "", 0

            async def user(first: int) -> None:
                nonlocal done, victim, victim_pid, victim_family
                for i in range(first, REQUESTS, USERS):
                    try:
                        problem, served_by = await send(i)
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        problem, served_by = f"{type(exc).__name__}: {exc}", ""
                    if problem is not None:
                        failures.append(f"request {i}: {problem}")
                    per_instance[served_by] += 1
                    done += 1
                    if done == KILL_AFTER and not killed.is_set():
                        # The busiest instance: the most requests inside it right now.
                        stats = await cluster.server_stats()
                        victim = max(stats, key=lambda n: int(stats[n]["scur"]))
                        victim_pid = int(cluster.instance(victim)["pid"])
                        victim_family = cluster.kill_instance(victim)
                        killed.set()

            await asyncio.wait_for(asyncio.gather(*(user(u) for u in range(USERS))), LOAD_TIMEOUT_S)
            assert killed.is_set()
            assert failures == [], f"{len(failures)} failed: {failures[:10]}\n{cluster.logs()}"
            assert done == REQUESTS
            # Requests were inside the killed instance, and HAProxy sent them elsewhere.
            stats = await cluster.server_stats()
            assert int(stats[victim]["wredis"]) > 0, stats[victim]
            assert len(per_instance) == 3, per_instance  # all took requests before the kill

            # HAProxy saw the instance go; its backend processes followed it.
            haproxy_log = (tmp_path / "state" / "haproxy.log").read_text()
            assert f"Server instances/{victim} is DOWN" in haproxy_log
            assert await _gone(victim_family), "the killed instance left processes behind"

            # The supervisor restarts it on the same port; the health checks take it back.
            loop = asyncio.get_running_loop()
            give_up = loop.time() + 30
            while (await cluster.server_stats())[victim]["status"] != "UP":
                assert loop.time() < give_up, f"{victim} not back\n{cluster.logs()}"
                await asyncio.sleep(0.1)
            assert cluster.reload_state()["phase"] == "ready"
            assert int(cluster.instance(victim)["pid"]) != victim_pid
            problem, _ = await send(0)
            assert problem is None, problem

        assert "stopped the cluster" in await cluster.stop()
        assert not (tmp_path / "state" / "cluster.json").exists()
        assert await cluster.leftovers() == []


async def _gone(pids: set[int], timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while [p for p in pids if alive(p)]:
        if loop.time() > give_up:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_config_command_prints_a_configuration_haproxy_accepts(
    strategy: str, tmp_path: Path
) -> None:
    haproxy = require_haproxy()
    code, out = await run_cli(
        "config",
        "--strategy",
        strategy,
        "--server",
        "127.0.0.1:9001",
        "--server",
        "127.0.0.1:9002",
        "--port",
        "9000",
    )
    assert code == 0, out
    assert "server i0 127.0.0.1:9001 id 1" in out and "server i1 127.0.0.1:9002 id 2" in out
    config = tmp_path / "haproxy.cfg"
    config.write_text(out)
    check = await asyncio.create_subprocess_exec(
        haproxy,
        "-c",
        "-f",
        str(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await check.communicate()
    assert check.returncode == 0, output.decode()
