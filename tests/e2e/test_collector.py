"""The garbage collector of the real server's processes is set for a heap of long-lived models
(:mod:`mmserver.ops.heap`): the frontend says so at start, and a backend process answers from its
own interpreter."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from mmserver.ops import heap
from tests.behaviour_models import make_slow_load_dir
from tests.e2e.server_process import ServerProcess, until

# Predictions: the collector's settings in the backend process running the model, and its id.
COLLECTOR_REPORT = """
import gc


def predict(model, batch):
    return [[*gc.get_threshold(), gc.get_freeze_count(), os.getpid()] for _ in batch]
"""


async def test_frontend_and_backends_collect_young_objects_less_often_and_freeze_startup(
    tmp_path: Path,
) -> None:
    # collector-a's load is held at its gate; collector-b's gate is open from the start.
    store = tmp_path / "store"
    started, gate, open_gate = tmp_path / "started", tmp_path / "gate", tmp_path / "open"
    open_gate.touch()
    make_slow_load_dir(store / "collector-a", started, gate, COLLECTOR_REPORT)
    make_slow_load_dir(store / "collector-b", tmp_path / "started-b", open_gate, COLLECTOR_REPORT)
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
