"""The garbage collector of the real server's processes is set for a heap of long-lived models
(:mod:`mmserver.heap`): the frontend says so at start, and a backend process answers from its
own interpreter."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from mmserver import heap
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_faults import until

# A model whose predictions are the collector's settings in the backend process running it.
# With a ``gate`` property, its load waits (up to 30 s) for that file, once it has written the file
# ``started``: the test keeps it bound to its backend process while it places another model.
COLLECTOR_REPORT = """
import gc
import os
import time
from pathlib import Path


def load(model_dir, properties):
    if "gate" in properties:
        Path(properties["started"]).write_text(str(os.getpid()))
        gate = Path(properties["gate"])
        for _ in range(30000):
            if gate.exists():
                break
            time.sleep(0.001)
    return None


def predict(model, batch):
    return [[*gc.get_threshold(), gc.get_freeze_count(), os.getpid()] for _ in batch]
"""


async def test_frontend_and_backends_collect_young_objects_less_often_and_freeze_startup(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    for name in ("collector-a", "collector-b"):
        (store / name).mkdir(parents=True)
        (store / name / "model.py").write_text(COLLECTOR_REPORT)
    started, gate = tmp_path / "started", tmp_path / "gate"
    (store / "collector-a" / "serving.properties").write_text(f"started={started}\ngate={gate}\n")
    async with (
        ServerProcess(store, tmp_path / "server.log", "--backend-processes", "2") as server,
        aiohttp.ClientSession() as session,
    ):

        async def ask(name: str) -> list[list[int]]:
            async with session.post(
                f"{server.url}/predictions/{name}", json=[[0.0], [1.0]]
            ) as response:
                assert response.status == 200, await response.text()
                answer: list[list[int]] = (await response.json())["predictions"]
                return answer

        # While collector-a loads in one backend process, collector-b goes to the other.
        first = asyncio.create_task(ask("collector-a"))

        async def loading() -> bool:
            return started.exists()

        await until(loading, 30, "collector-a's load started")
        second = await ask("collector-b")
        gate.touch()
        answers = [await first, second]
        pids = set()
        for predictions in answers:
            young, middle, oldest, frozen, pid = predictions[0]
            pids.add(pid)
            assert (young, middle) == (heap.YOUNG_OBJECTS, heap.MIDDLE_COLLECTIONS)
            assert oldest == 10  # CPython's rule for the oldest generation is kept
            assert frozen > 1000  # the interpreter's, numpy's and scikit-learn's objects
            assert predictions[1] == predictions[0]
        assert len(pids) == 2  # both backend processes answered
        found = re.search(
            r"garbage collector: youngest generation every (\d+) allocations, middle every "
            r"(\d+) of its collections; (\d+) start-up objects frozen",
            server.log(),
        )
        assert found is not None, server.log()
        assert (int(found[1]), int(found[2])) == (heap.YOUNG_OBJECTS, heap.MIDDLE_COLLECTIONS)
        assert int(found[3]) > 10_000
