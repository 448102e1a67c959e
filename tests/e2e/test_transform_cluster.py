"""``mmserver transform --url`` at the HAProxy balancer of ``mmserver cluster``: the job's
mini-batches spread over every instance, and the outputs are the model's predictions."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from mmserver.commands.transform.options import parse
from mmserver.commands.transform.records import Framing, pack
from tests.e2e.cluster_process import ClusterProcess, require_haproxy
from tests.e2e.transform_process import csv_rows, predictions, run_transform, write_csv_files
from tests.models import make_pipeline_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

FILES = {f"day-{n}.csv": 200 for n in range(6)}


async def answered(session: aiohttp.ClientSession, port: int, model: str) -> int:
    """The requests for ``model`` an instance answered 200, from its own metrics."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    pattern = rf'^mmserver_requests_total\{{[^}}]*model="{model}"[^}}]*code="200"[^}}]*\}} (\S+)$'
    return sum(int(float(v)) for v in re.findall(pattern, text, re.MULTILINE))


async def test_a_job_through_the_balancer_reaches_every_instance(tmp_path: Path) -> None:
    require_haproxy()
    store = tmp_path / "store"
    model = make_pipeline_dir(store / "pipe")
    data = tmp_path / "in"
    write_csv_files(data, FILES, features=3)
    async with ClusterProcess(
        store, tmp_path / "state", "--instances", "2", "--backend-processes", "1"
    ) as cluster:
        code, text = await run_transform(
            "--url", cluster.url, "--model", "pipe", "--input", str(data),
            "--output", str(tmp_path / "out"), "--max-payload-mb", "0.001",
            "--max-concurrent-transforms", "4",
        )  # fmt: skip
        assert code == 0, text
        for name in FILES:
            lines = (tmp_path / "out" / (name + ".out")).read_text().splitlines()
            expected = predictions(model, csv_rows(data / name)).tolist()
            assert [float(v) for v in lines] == pytest.approx(expected, rel=1e-12)
        async with aiohttp.ClientSession() as session:
            counts = [
                await answered(session, int(i["port"]), "pipe") for i in cluster.state["instances"]
            ]
    options = parse(["--model", "pipe", "--input", "-", "--output", "-"])
    payloads = sum(
        len(pack((data / name).read_bytes().split(), Framing(options), 1048, single=False))
        for name in FILES
    )
    assert payloads > 20
    assert len(counts) == 2
    assert all(count > 0 for count in counts), counts
    assert sum(counts) == payloads
