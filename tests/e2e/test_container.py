"""The container image (``Dockerfile``) run by Docker: it serves a mounted store as a non-root
user on a read-only root file system (as the Helm chart runs it), reads its memory budget from
the container's limit, and drains on ``docker stop``.

The image is built by ``scripts/container`` and named by ``IMAGE_UNDER_TEST``; ``scripts/test``
builds it while the other tests run and names the folder where the build leaves its result in
``IMAGE_BUILD_DIR``, which these tests wait for. Without either they are skipped and say so (in
CI a build that failed fails them).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from mmserver.commands.examples import write_classifier_dir
from tests.e2e.server_process import free_port

IMAGE_UNDER_TEST = os.environ.get("IMAGE_UNDER_TEST", "")
IMAGE_BUILD_DIR = os.environ.get("IMAGE_BUILD_DIR", "")
#: How long the tests wait for the image scripts/test builds beside them.
BUILD_TIMEOUT_S = 600.0
TOKEN = "container-test-token"
MEMORY_LIMIT_MIB = 1536
UID = 10001

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (IMAGE_UNDER_TEST or IMAGE_BUILD_DIR), reason="no image: scripts/container builds one"
    ),
    pytest.mark.timeout(BUILD_TIMEOUT_S + 180),  # the first test's setup waits for the build
]

#: A model whose batch says it has begun (a file), then waits for its gate (another file).
HELD = """\
import time
from pathlib import Path


def load(model_dir, properties):
    return Path(model_dir).parent


def predict(store, batch):
    (store / "entered").write_text("yes")
    for _ in range(60000):  # at most 60 s
        if (store / "gate").exists():
            break
        time.sleep(0.001)
    return [2.0 * float(row[0]) for row in batch]
"""


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


class Container:
    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"

    def logs(self) -> str:
        done = docker("logs", self.name)
        return done.stdout + done.stderr

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 60) -> None:
        """Poll ``/ping`` (Docker gives no event for a server that listens); bounded."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            try:
                async with session.get(self.url + "/ping") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if docker("inspect", "-f", "{{.State.Running}}", self.name).stdout.strip() != "true":
                raise AssertionError(f"the container stopped:\n{self.logs()}")
            await asyncio.sleep(0.2)
        raise AssertionError(f"the server did not answer /ping within {timeout} s:\n{self.logs()}")


@pytest.fixture(scope="module")
def image() -> str:
    """The image under test: ``IMAGE_UNDER_TEST``, or the one scripts/test builds beside the
    tests once its build has ended (bounded by :data:`BUILD_TIMEOUT_S`)."""
    if IMAGE_UNDER_TEST:
        return IMAGE_UNDER_TEST
    build = Path(IMAGE_BUILD_DIR)
    status = build / "status"
    end = time.monotonic() + BUILD_TIMEOUT_S
    while not status.exists():
        if time.monotonic() > end:
            pytest.fail(f"the image was not built within {BUILD_TIMEOUT_S:.0f} s")
        time.sleep(1.0)  # a file another process writes: no event to wait on
    built = (build / "image").read_text().strip().splitlines()
    if status.read_text().strip() == "0" and built:
        return built[-1]
    log = (build / "log").read_text(errors="replace")[-3000:]
    if os.environ.get("CI"):
        pytest.fail(f"could not build the container image:\n{log}")
    pytest.skip(f"could not build the container image; its tests skip:\n{log}")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    write_classifier_dir(store / "iris-classifier")
    held = store / "held"
    held.mkdir()
    (held / "model.py").write_text(HELD)
    for path in (store, *store.rglob("*")):
        path.chmod(0o777 if path.is_dir() else 0o666)  # the container's user reads and writes
    return store


@pytest.fixture
async def container(store: Path, image: str) -> AsyncIterator[Container]:
    name = f"mmserver-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    started = docker(
        "run",
        "--detach",
        "--name",
        name,
        "--publish",
        f"127.0.0.1:{port}:8080",
        "--volume",
        f"{store}:/models",
        "--memory",
        f"{MEMORY_LIMIT_MIB}m",
        # As the Helm chart runs it: the image read-only, scratch space in /tmp, the cache a
        # volume of its own (the image declares it).
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--env",
        f"MMSERVER_MANAGEMENT_TOKEN={TOKEN}",
        "--env",
        "MMSERVER_DRAIN_TIMEOUT=60",
        "--env",
        "MMSERVER_BACKEND_PROCESSES=1",
        # The store's model double with a model.py, trusted as an operator would trust it.
        "--env",
        "MMSERVER_TRUSTED_MODELS=held",
        image,
    )
    assert started.returncode == 0, started.stderr
    try:
        yield Container(name, port)
    finally:
        docker("rm", "--force", name)


async def test_serves_a_mounted_store_as_a_non_root_user_within_the_memory_limit(
    container: Container,
) -> None:
    async with aiohttp.ClientSession() as session:
        await container.wait_ready(session)
        body = json.dumps([[5.1, 3.5, 1.4, 0.2]])
        async with session.post(
            container.url + "/predictions/iris-classifier",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            assert response.status == 200
            [probabilities] = (await response.json())["predictions"]
        assert sum(probabilities) == pytest.approx(1.0)
        assert probabilities[0] > 0.9
        async with session.get(container.url + "/v2/health/live") as response:
            assert response.status == 200
        # The management calls need the token on a non-loopback address (0.0.0.0 inside).
        async with session.delete(container.url + "/models/iris-classifier") as response:
            assert response.status == 401
    status = docker("exec", container.name, "cat", "/proc/1/status").stdout
    assert re.search(rf"^Uid:\s+{UID}\s", status, re.M), status
    top = docker("top", container.name, "-o", "pid,uid").stdout.split("\n")[1:]
    uids = {line.split()[1] for line in top if line.strip()}
    assert uids == {str(UID)}, top  # the server, its fork server and backends: none is root
    logs = container.logs()
    budget = re.search(r"memory budget (\d+) MiB from ([^,]*cgroup[^,]*)", logs)
    assert budget is not None, logs
    assert 0 < int(budget.group(1)) < MEMORY_LIMIT_MIB


async def test_docker_stop_drains_the_requests_in_flight(container: Container, store: Path) -> None:
    async with aiohttp.ClientSession() as session:
        await container.wait_ready(session)
        asked = asyncio.ensure_future(
            session.post(
                container.url + "/predictions/held",
                data="[[0.5]]",
                headers={"Content-Type": "application/json"},
            )
        )
        entered = store / "entered"
        for _ in range(600):  # the batch writes the file: at most 60 s
            if entered.exists():
                break
            await asyncio.sleep(0.1)
        assert entered.exists(), container.logs()
        stop = asyncio.create_task(
            asyncio.to_thread(docker, "stop", "--time", "90", container.name)
        )
        for _ in range(300):  # SIGTERM reached the server: it logs the drain
            if "shutting down: draining" in container.logs():
                break
            await asyncio.sleep(0.1)
        assert "shutting down: draining" in container.logs()
        (store / "gate").write_text("open")
        response = await asked
        assert response.status == 200
        assert (await response.json()) == {"predictions": [1.0]}
        stopped = await stop
        assert stopped.returncode == 0, stopped.stderr
    exit_code = docker("inspect", "-f", "{{.State.ExitCode}}", container.name).stdout.strip()
    assert exit_code == "0", container.logs()
    assert "mmserver stopped" in container.logs()
