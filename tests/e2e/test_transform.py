"""``mmserver transform`` end to end: real files through the real server (started by the test
and given with --url, or started by the command itself), outputs compared line by line with the
model's own predictions.

The tests that give the job a running server share one (``served``): each sends its jobs to its
own model and output folders, and none changes the server; the tests of a server the command
starts start their own."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest
import pytest_asyncio

from mmserver.commands.transform.options import TransformOptions
from mmserver.ops.folderlock import FolderLock
from tests.e2e.server_process import ServerProcess
from tests.e2e.transform_process import (
    csv_rows,
    outputs,
    predictions,
    run_transform,
    write_csv_files,
)
from tests.models import make_classifier_dir, make_pipeline_dir
from tests.tabular_models import customers
from tests.tabular_models import make_pipeline_model as make_tabular_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

FILES = {"a.csv": 300, "b.csv": 7, "day/2.csv": 120}


@dataclass(frozen=True)
class Served:
    """The running server of the module and its models: ``pipe`` (its folder) and
    ``customers`` (the fitted pipeline)."""

    url: str
    pipe: Path
    customers: Any


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    folder = tmp_path_factory.mktemp("served")
    store = folder / "store"
    pipe = make_pipeline_dir(store / "pipe")
    customers_model = make_tabular_pipeline(store / "customers")
    args = ("--backend-processes", "1")
    async with ServerProcess(store, folder / "server.log", *args) as server:
        yield Served(server.url, pipe, customers_model)


def _floats(data: bytes) -> list[float]:
    return [float(line) for line in data.decode().splitlines()]


async def test_csv_folder_through_a_running_server_matches_the_model(
    served: Served, tmp_path: Path
) -> None:
    model = served.pipe
    data = tmp_path / "in"
    write_csv_files(data, FILES, features=3)
    (data / "a.csv").write_text((data / "a.csv").read_text().replace("\n", "\n\n", 3))  # blanks
    common = ("--url", served.url, "--model", "pipe", "--input", str(data))

    # Small payloads: several requests a file, the answers assembled in order.
    code, text = await run_transform(
        *common, "--output", str(tmp_path / "multi"), "--max-payload-mb", "0.002"
    )
    assert code == 0, text
    multi = outputs(tmp_path / "multi")
    assert sorted(multi) == ["a.csv.out", "b.csv.out", "day/2.csv.out"]
    for name, count in FILES.items():
        expected = predictions(model, csv_rows(data / name))
        assert len(expected) == count
        assert _floats(multi[name + ".out"]) == pytest.approx(expected.tolist(), rel=1e-12)
    assert "3 of 3 files written, 0 failed; 427 records" in text

    code, text = await run_transform(
        *common, "--output", str(tmp_path / "single"), "--batch-strategy", "SingleRecord"
    )
    assert code == 0, text
    # The same values (a model's float arithmetic on a batch may differ in the last bit).
    single = outputs(tmp_path / "single")
    assert sorted(single) == sorted(multi)
    for name in multi:
        assert _floats(single[name]) == pytest.approx(_floats(multi[name]), rel=1e-12)

    code, text = await run_transform(
        *common, "--output", str(tmp_path / "joined"), "--join-source", "Input"
    )
    assert code == 0, text
    for name in FILES:
        inputs = [line for line in (data / name).read_text().splitlines() if line]
        joined = (tmp_path / "joined" / (name + ".out")).read_text().splitlines()
        answers = multi[name + ".out"].decode().splitlines()
        assert joined == [f"{i},{a}" for i, a in zip(inputs, answers, strict=True)]

    code, text = await run_transform(
        *common, "--output", str(tmp_path / "json"), "--accept", "application/json"
    )
    assert code == 0, text
    lines = (tmp_path / "json" / "b.csv.out").read_text().splitlines()
    assert [json.loads(line) for line in lines] == _floats(multi["b.csv.out"])


async def test_json_lines_on_a_server_the_command_starts(tmp_path: Path) -> None:
    store = tmp_path / "store"
    classifier = joblib.load(make_classifier_dir(store / "iris") / "model.joblib")
    data = tmp_path / "in"
    data.mkdir()
    rows = np.random.default_rng(5).uniform(0, 7, size=(40, 4)).round(3)
    (data / "part-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.tolist()))
    common = ("--model", "iris", "--model-store", str(store), "--backend-processes", "1")
    code, text = await run_transform(
        *common,
        "--input",
        str(data),
        "--output",
        str(tmp_path / "out"),
        "--content-type",
        "application/jsonlines",
        "--join-source",
        "Input",
        "--max-payload-mb",
        "0.0005",
    )
    assert code == 0, text
    lines = (tmp_path / "out" / "part-1.jsonl.out").read_text().splitlines()
    joined = [json.loads(line) for line in lines]
    assert [j["SageMakerInput"] for j in joined] == rows.tolist()
    expected = classifier.predict_proba(rows)
    assert np.allclose([j["SageMakerOutput"] for j in joined], expected, rtol=1e-12, atol=0)

    # A whole file a request, the answers as the server sent them. The job's own server takes
    # neither a journal nor a gRPC port from the environment: these are held as a user's
    # server would hold them.
    users = FolderLock(tmp_path / "user-state")
    users.take()
    grpc = socket.create_server(("127.0.0.1", 0))
    try:
        code, text = await run_transform(
            *common,
            "--input",
            str(data / "part-1.jsonl"),
            "--output",
            str(tmp_path / "whole"),
            "--content-type",
            "application/jsonlines",
            "--split-type",
            "None",
            "--assemble-with",
            "None",
            env={
                "MMSERVER_STATE_DIR": str(users.folder),
                "MMSERVER_GRPC_PORT": str(grpc.getsockname()[1]),
            },
        )
    finally:
        users.release()
        grpc.close()
    assert code == 0, text
    assert [p.name for p in users.folder.iterdir()] == ["mmserver.lock"]
    answer = json.loads((tmp_path / "whole" / "part-1.jsonl.out").read_bytes())
    assert np.allclose(answer["predictions"], expected, rtol=1e-12, atol=0)


async def test_a_bad_record_fails_its_file_and_the_job_goes_on(
    served: Served, tmp_path: Path
) -> None:
    data = tmp_path / "in"
    write_csv_files(data, {"good.csv": 20, "bad.csv": 20, "wide.csv": 3}, features=3)
    lines = (data / "bad.csv").read_text().splitlines()
    lines[11] = "1.0,abc,2.0"
    (data / "bad.csv").write_text("\n".join(lines) + "\n")
    (data / "wide.csv").write_text("1.0,2.0," + "3" * 1500 + "\n")
    out = tmp_path / "out"
    common = ("--url", served.url, "--input", str(data), "--output", str(out))
    options = ("--model", "pipe", "--max-payload-mb", "0.001", "--batch-strategy")
    code, text = await run_transform(*common, *options, "SingleRecord")
    assert code == 1, text
    assert "1 of 3 files written, 2 failed" in text
    assert sorted(outputs(out)) == ["bad.csv.error", "good.csv.out", "wide.csv.error"]
    bad = (out / "bad.csv.error").read_text()
    assert bad.startswith(f"{data / 'bad.csv'}: record 12: the server answered 400: ")
    assert "'abc'" in bad
    wide = (out / "wide.csv.error").read_text()
    assert "record 1 is 1,508 bytes, more than the payload limit of 1,048 bytes" in wide

    # Run again, stopping at the first failed file: the written file is not redone.
    written_at = (out / "good.csv.out").stat().st_mtime_ns
    code, text = await run_transform(*common, *options, "SingleRecord", "--on-error", "fail")
    assert code == 2, text
    assert "stopped at a failed file (--on-error fail)" in text
    assert (out / "good.csv.out").stat().st_mtime_ns == written_at

    # A different job into the same output is refused, and changes nothing.
    code, text = await run_transform(*common, *options, "MultiRecord")
    assert code == 2, text
    assert "holds the progress of another job" in text

    code, text = await run_transform(
        *common, "--model", "nothing", "--journal", str(tmp_path / "j")
    )
    assert code == 2, text
    assert "model 'nothing' at http://127.0.0.1" in text
    assert "nothing is not in the model store" in text
    assert sorted(outputs(out)) == ["bad.csv.error", "good.csv.out", "wide.csv.error"]

    code, text = await run_transform(
        "--url",
        served.url,
        "--model",
        "pipe",
        "--input",
        str(tmp_path / "none"),
        "--output",
        str(tmp_path / "o2"),
    )
    assert code == 2, text
    assert f"the input {tmp_path / 'none'} does not exist" in text


async def test_help_lists_every_option() -> None:
    code, text = await run_transform("--help")
    assert code == 0, text
    flags = {"--" + f.name.replace("_", "-") for f in TransformOptions.options()}
    assert flags >= {
        "--model", "--input", "--output", "--data-type", "--url", "--model-store",
        "--content-type", "--split-type", "--batch-strategy", "--max-payload-mb",
        "--max-concurrent-transforms", "--accept", "--assemble-with", "--join-source",
        "--on-error", "--journal", "--progress",
    }  # fmt: skip
    for flag in flags:
        assert f"  {flag} " in text
    for value in ("MultiRecord", "SingleRecord", "ManifestFile", "application/jsonlines"):
        assert value in text


async def test_dataframe_records_in_json_lines_joined_to_their_answers(
    served: Served, tmp_path: Path
) -> None:
    pipeline = served.customers
    frame = customers(60, seed=4)
    rows = [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
        for r in frame.to_dict(orient="records")
    ]
    data = tmp_path / "in"
    data.mkdir()
    (data / "customers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, text = await run_transform(
        "--url", served.url, "--model", "customers", "--input", str(data),
        "--output", str(tmp_path / "out"), "--content-type", "application/jsonlines",
        "--join-source", "Input", "--max-payload-mb", "0.001",
    )  # fmt: skip
    assert code == 0, text
    lines = (tmp_path / "out" / "customers.jsonl.out").read_text().splitlines()
    joined = [json.loads(line) for line in lines]
    assert [{k: v for k, v in j.items() if k != "SageMakerOutput"} for j in joined] == rows
    assert [j["SageMakerOutput"] for j in joined] == pipeline.predict(frame).tolist()
