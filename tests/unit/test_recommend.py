"""``mmserver recommend``'s pure parts: the grid, the search's next rate, the lines written into
serving.properties, the choice and the instance counts, and the errors of bad arguments (given
before anything starts)."""

from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path

import pytest

from mmserver.commands.recommend.advice import Advice
from mmserver.commands.recommend.cli import main
from mmserver.commands.recommend.payloads import sample_body
from mmserver.commands.recommend.progress import Progress
from mmserver.commands.recommend.search import Run, SettingResult, done, next_rate
from mmserver.commands.recommend.settings import Setting, grid, write_properties
from mmserver.commands.recommend.target import ModelFacts
from mmserver.config.model import ModelConfig, load_model_config
from mmserver.store.properties import read_properties
from tests.models import make_linear_archive, make_linear_model


def test_grid_tries_no_delay_without_batching() -> None:
    assert grid([1, 32], [0, 2], [1, 2]) == [
        Setting(1, 0, 1),
        Setting(1, 0, 2),
        Setting(32, 0, 1),
        Setting(32, 0, 2),
        Setting(32, 2, 1),
        Setting(32, 2, 2),
    ]


def test_each_lane_is_a_server_of_its_own_after_the_default() -> None:
    settings = grid([8], [0], [1, 2], ["one", "auto"])
    assert [(s.lane, s.max_workers) for s in settings] == [
        ("auto", 1),
        ("auto", 2),
        ("one", 1),
        ("one", 2),
    ]
    assert settings[0].server_args == ()
    assert settings[2].server_args == ("--heavy-processes", "0")
    assert settings[2].label == "batch 8, delay 0 ms, workers 1, one lane"


@pytest.mark.parametrize(
    ("passed", "failed", "expected"),
    [
        (0.0, None, 800.0),  # first: a share of the closed loop's rate
        (800.0, None, 1000.0),  # passed, nothing failed yet: higher
        (0.0, 800.0, 400.0),  # failed, nothing passed yet: half
        (800.0, 1000.0, 900.0),  # between
    ],
)
def test_next_rate(passed: float, failed: float | None, expected: float) -> None:
    assert next_rate(1000.0, passed, failed) == pytest.approx(expected)


def test_search_stops_when_pass_and_failure_are_close() -> None:
    assert done(980.0, 1000.0)
    assert not done(900.0, 1000.0)
    assert not done(0.0, 1000.0)
    assert not done(900.0, None)


def test_written_lines_replace_every_spelling_and_keep_the_rest(tmp_path: Path) -> None:
    folder = make_linear_model(tmp_path / "m")
    (folder / "serving.properties").write_text(
        "batchSize=4\nmaxBatchDelay=100\ncpu.maxWorkers=7\nminWorkers=2\n"
        "# mine\noption.method=predict\n"
    )
    path = write_properties(folder, Setting(32, 2, 3))
    properties = read_properties(path)
    assert properties == {
        "minWorkers": "2",
        "option.method": "predict",
        "batch_size": "32",
        "max_batch_delay": "2",
        "maxWorkers": "3",
    }
    assert "# mine" in path.read_text()
    config = load_model_config(folder, ModelConfig())
    assert (config.batch_size, config.max_batch_delay, config.max_workers) == (32, 2, 3)
    assert config.min_workers == 2


def _result(setting: Setting, rps: float | None, cpu_ms: float = 1.0) -> SettingResult:
    result = SettingResult(setting, memory_bytes=2**20, lane="light")
    result.runs.append(Run(0.0, (rps or 100) * 1.2, 1.0, 30.0, 0, cpu_ms, False))
    if rps is not None:
        result.runs.append(Run(rps, rps, 1.0, 12.0, 0, cpu_ms, True))
    result.runs.append(Run((rps or 100) * 1.5, (rps or 100) * 1.1, 5.0, 80.0, 0, cpu_ms, False))
    return result


def test_choice_prefers_the_cheaper_of_nearly_equal_settings() -> None:
    results = [
        _result(Setting(1, 0, 2), 1000.0, cpu_ms=1.5),
        _result(Setting(32, 0, 2), 980.0, cpu_ms=0.9),  # within 5 %: less CPU wins
        _result(Setting(32, 2, 1), 600.0, cpu_ms=0.5),
        _result(Setting(32, 2, 2), None),
    ]
    advice = Advice("m", 20.0, 40_000.0, 2, "wrk", results)
    assert advice.chosen is results[1]
    recommendation = advice.to_json()["recommendation"]
    assert recommendation["serving_properties"] == [
        "batch_size=32",
        "max_batch_delay=0",
        "maxWorkers=2",
    ]
    assert recommendation["rps_per_instance"] == 980.0
    assert recommendation["instances"] == 41  # 40,000 / 980, rounded up
    assert recommendation["instances_by_cpus_estimate"]["4"] == 21  # twice the CPUs
    assert recommendation["cpus_busy_at_target"] == pytest.approx(36.0)
    text = advice.text()
    assert "40,000 req/s: 41 instances like this one" in text
    assert "an estimate" in text
    assert "  maxWorkers=2" in text


def test_a_disturbed_machine_is_said() -> None:
    result = _result(Setting(1, 0, 1), 100.0)
    quiet = Advice("m", 20.0, None, 2, "wrk", [result])
    assert quiet.other_cpu_percent == 0.0
    assert "WARNING" not in quiet.text()
    result.runs[:] = [dataclasses.replace(run, other_cpu_percent=80.0) for run in result.runs]
    busy = Advice("m", 20.0, None, 2, "wrk", [result])
    assert busy.to_json()["other_cpu_percent"] == 80.0
    assert "WARNING: other programs kept the machine 80 % of a core busy" in busy.text()


def test_no_setting_meeting_the_target_is_said_plainly() -> None:
    advice = Advice("m", 1.0, None, 2, "wrk", [_result(Setting(1, 0, 1), None)])
    assert advice.chosen is None
    assert advice.to_json()["recommendation"] is None
    assert "No setting kept p99 <= 1 ms" in advice.text()
    assert "The lowest p99 seen was 30.0 ms" in advice.text()


@pytest.mark.parametrize(
    ("inputs", "body"),
    [
        ([{"name": "input-0", "datatype": "FP64", "shape": [-1, 3]}], [[0.5, 0.5, 0.5]]),
        ([{"name": "input-0", "datatype": "FP64", "shape": [-1, -1]}], [[0.5]]),
        (
            [
                {"name": "city", "datatype": "BYTES", "shape": [-1]},
                {"name": "x1", "datatype": "FP64", "shape": [-1]},
            ],
            [{"city": "a", "x1": 0.5}],
        ),
        ([], [[0.5]]),
    ],
)
def test_sample_body_from_the_models_inputs(inputs: list[dict[str, object]], body: object) -> None:
    assert json.loads(sample_body(inputs)) == body


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    make_linear_archive(root / "sklearn-0.tar.gz")
    make_linear_model(root / "folder-model")
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--p99-ms", "0"], "--p99-ms must be a positive number of ms, not 0"),
        (["--p99-ms", "nan"], "--p99-ms must be a positive number of ms"),
        (["--p99-ms", "20", "--target-rps", "-5"], "--target-rps must be positive, not -5"),
        (["--p99-ms", "20", "--batch-sizes", "1,x"], "--batch-sizes '1,x' is not a comma"),
        (["--p99-ms", "20", "--batch-sizes", "0"], "--batch-sizes: 0 must be at least 1"),
        (
            ["--p99-ms", "20", "--batch-delays", "20000"],
            "--batch-delays: 20000 must be at least 0 and at most 10000",
        ),
        (["--p99-ms", "20", "--workers", ""], "--workers is empty"),
        (["--p99-ms", "20", "--steps", "0"], "--steps must be at least 1, not 0"),
        (
            ["--p99-ms", "20", "--max-minutes", "0.05"],
            "--max-minutes 0.05 is too short for 6 settings of 5 runs of at least 1 s",
        ),
        (["--p99-ms", "20", "--lanes", "auto,two"], "--lanes: 'two' is not one of auto, one"),
        (
            ["--p99-ms", "20", "--write"],
            "--write: sklearn-0 is an archive in",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    store: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sklearn-0", "--model-store", str(store), "--workers", "1,2", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("mmserver recommend: ")
    assert message in err


def test_a_missing_model_or_store_or_payload_is_refused(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nope", "--model-store", str(store), "--p99-ms", "20"]) == 2
    assert f"the model store {store} has no model nope" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["m", "--model-store", str(missing), "--p99-ms", "20"]) == 2
    assert f"--model-store {missing} is not a folder" in capsys.readouterr().err
    payload = tmp_path / "payload.json"
    payload.write_text("[[0.5]")
    argv = ["folder-model", "--model-store", str(store), "--p99-ms", "20"]
    assert main([*argv, "--payload", str(payload)]) == 2
    assert f"--payload {payload} is not JSON" in capsys.readouterr().err
    assert main([*argv, "--payload", str(tmp_path / "none.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_store_and_url_together_or_neither_are_refused(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["m", "--p99-ms", "20"])
    assert info.value.code == 2
    assert "one of the arguments --model-store --url is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["m", "--p99-ms", "20", "--model-store", str(store), "--url", "http://127.0.0.1:1"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_url_where_nothing_answers_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    from mmserver.commands.procfs import free_port

    port = free_port()
    assert main(["m", "--p99-ms", "20", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert f"no server answers at http://127.0.0.1:{port}" in capsys.readouterr().err
    url = f"http://127.0.0.1:{port}"
    assert main(["m", "--p99-ms", "20", "--url", url, "--lanes", "auto,one"]) == 2
    assert "--lanes: a running server's lanes are its own" in capsys.readouterr().err
    assert main(["m", "--p99-ms", "20", "--url", "ftp://x"]) == 2
    assert "--url 'ftp://x' is not an http://HOST:PORT address" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    terminal = _Terminal()
    bar = Progress(4, time.monotonic() + 60, terminal)
    bar.step("closed loop 100 req/s")
    bar.step("200 req/s offered")
    bar.finish()
    text = terminal.getvalue()
    assert text.startswith("\r\x1b[K[######..................] 1/4 ")
    assert "closed loop 100 req/s\r\x1b[K[############............] 2/4 " in text
    assert text.rstrip("\n").endswith("left  200 req/s offered")
    assert text.endswith("\n")
    plain = io.StringIO()
    lines = Progress(2, time.monotonic() + 60, plain)
    lines.step("closed loop 100 req/s")
    lines.step("done")
    lines.finish()
    assert plain.getvalue() == "[1/2] closed loop 100 req/s\n[2/2] done\n"


def test_memory_a_copy_counts_a_copy_in_each_backend_of_each_lane() -> None:
    described = {
        "batchSize": 32,
        "maxBatchDelayMillis": 2,
        "memoryBytes": 3 * 2**20,
        "lane": "light",
        "workerGroups": [
            {
                "minWorkers": 1,
                "maxWorkers": 3,
                "workers": [
                    {"id": 1, "backend": 0, "lane": "light"},
                    {"id": 2, "backend": 1, "lane": "light"},
                    {"id": 3, "backend": 0, "lane": "heavy"},
                ],
            }
        ],
    }
    facts = ModelFacts.of(described)
    assert facts.memory_bytes == 2**20
    assert facts.setting == Setting(32, 2, 3)
    assert (facts.min_workers, facts.lane) == (1, "light")
