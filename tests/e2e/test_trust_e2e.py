"""Code that is trusted to run never shares a process with other models (docs/security.md): a
trusted pickle that patches the backend process it loads in changes only its own answers, and
its process ends with its unload. Real ``mmserver serve``, real backend processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import joblib
import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from tests.e2e.server_process import ServerProcess, until, wait_gone
from tests.e2e.test_faults import backend_pids, predict, process_title
from tests.models import make_linear_archive

#: Run when the pickle loads: from then on, every answer its process encodes is 0.5 a row.
PATCH = """\
import mmserver.backend.batching as batching
batching.encode_as = (lambda encode: lambda piece, csv: encode([0.5] * len(piece), csv))(
    batching.encode_as
)
"""


class _Patch:
    def __reduce__(self) -> Any:
        return (exec, (PATCH,))


def _store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    (store / "patcher").mkdir(parents=True)
    model = LinearRegression().fit(np.array([[0.0], [1.0]]), np.array([1.0, 3.0]))
    model.patch = _Patch()  # type: ignore[attr-defined]
    joblib.dump(model, store / "patcher" / "model.joblib")
    make_linear_archive(store / "sklearn-0.tar.gz")  # y = 2x + 1
    return store


async def _answer(session: aiohttp.ClientSession, url: str, name: str) -> float:
    status, body, _ = await predict(session, url, name, 0.5)
    assert status == 200, body
    value: float = body["predictions"][0]
    return value


async def test_a_trusted_model_runs_in_a_process_of_its_own_that_ends_with_it(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    args = ("--backend-processes", "1", "--heavy-processes", "0", "--trusted-models", "patcher")
    async with (
        ServerProcess(store, tmp_path / "server.log", *args) as server,
        aiohttp.ClientSession() as session,
    ):
        assert await _answer(session, server.url, "sklearn-0") == pytest.approx(2.0, abs=0.05)
        shared = backend_pids(server.pid)
        assert len(shared) == 1
        assert await _answer(session, server.url, "patcher") == 0.5  # its own process, patched
        assert await _answer(session, server.url, "sklearn-0") == pytest.approx(2.0, abs=0.05)
        pids = backend_pids(server.pid)
        [own] = [pid for pid in pids if pid not in shared]
        assert process_title(own) == "mmserver: backend light 1"
        async with session.get(f"{server.url}/models/patcher") as response:
            [workflow] = await response.json()
        described = workflow["models"][0]
        assert (described["trust"], described["trustedBy"]) == (
            "trusted",
            "trusted_models=patcher",
        )
        assert [w["backend"] for w in described["workerGroups"][0]["workers"]] == [1]

        async with session.delete(f"{server.url}/models/patcher") as response:
            assert response.status == 200
        await wait_gone({own})
        assert backend_pids(server.pid) == shared
        assert await _answer(session, server.url, "sklearn-0") == pytest.approx(2.0, abs=0.05)
        # Loaded again: a fresh process of its own.
        assert await _answer(session, server.url, "patcher") == 0.5

        async def two_processes() -> bool:
            return len(backend_pids(server.pid)) == 2

        await until(two_processes, 10, "the model's own process")
        assert own not in backend_pids(server.pid)


async def test_without_isolation_a_trusted_model_shares_and_can_change_its_neighbours(
    tmp_path: Path,
) -> None:
    """What isolate_trusted=false means (a store whose every model its operator wrote): the
    trusted model shares the backend process, and what its code does there reaches the others."""
    store = _store(tmp_path)
    args = ("--backend-processes", "1", "--heavy-processes", "0")
    trust = ("--trusted-models", "patcher", "--no-isolate-trusted")
    async with (
        ServerProcess(store, tmp_path / "server.log", *args, *trust) as server,
        aiohttp.ClientSession() as session,
    ):
        assert await _answer(session, server.url, "sklearn-0") == pytest.approx(2.0, abs=0.05)
        assert await _answer(session, server.url, "patcher") == 0.5
        assert len(backend_pids(server.pid)) == 1
        assert await _answer(session, server.url, "sklearn-0") == 0.5


async def test_a_trusted_model_scales_over_processes_of_its_own(tmp_path: Path) -> None:
    """As many processes of its own as the light lane has, one per worker while each holds one:
    trust does not cost a model the machine's other cores."""
    store = _store(tmp_path)
    (store / "patcher" / "serving.properties").write_text("minWorkers=2\nmaxWorkers=2\n")
    args = ("--backend-processes", "2", "--heavy-processes", "0", "--trusted-models", "patcher")
    async with (
        ServerProcess(store, tmp_path / "server.log", *args) as server,
        aiohttp.ClientSession() as session,
    ):
        shared = set(backend_pids(server.pid))
        assert len(shared) == 2
        assert await _answer(session, server.url, "patcher") == 0.5
        own = set(backend_pids(server.pid)) - shared
        assert len(own) == 2
        assert sorted(process_title(pid) for pid in own) == [
            "mmserver: backend light 2",
            "mmserver: backend light 3",
        ]
        assert await _answer(session, server.url, "sklearn-0") == pytest.approx(2.0, abs=0.05)
        async with session.delete(f"{server.url}/models/patcher") as response:
            assert response.status == 200
        await wait_gone(own)
        assert set(backend_pids(server.pid)) == shared
