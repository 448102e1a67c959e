"""Model environments' pure parts, by table: a requirement set read, normalized and keyed,
checked against the installed distributions, pinned for a pickle of another version; the
installer's last error line; the registry's choice to build again or answer a failure; and an
environment's fork server starting, answering and losing a backend process (run here by the
test's own interpreter, mmserver on its path through the package's link only)."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from mmserver.backend import wire
from mmserver.backend.envprocs import EnvContext, EnvForkServer, package_link
from mmserver.envs import building
from mmserver.envs.registry import Environment, Environments, EnvState
from mmserver.envs.requirements import (
    RequirementSet,
    normalize,
    parse,
    pinned_for_skew,
    read_folder,
    unmet,
)
from mmserver.errors import EnvironmentFailed, ModelLoadError
from mmserver.ops.metrics import Metrics
from mmserver.procs.framing import FrameReader, frame, send_frame


def _set(text: str) -> RequirementSet:
    return RequirementSet(normalize(parse(text, "requirements.txt")))


def test_one_set_however_it_is_spelled_and_ordered() -> None:
    one = _set("scikit-learn==1.3.2\nnumpy==1.26.4\n")
    other = _set("# pinned\n\nNumPy == 1.26.4  # the old one\nScikit_Learn==1.3.2\nnumpy==1.26.4\n")
    assert one == other and one.key == other.key
    assert one.requirements == ("numpy==1.26.4", "scikit-learn==1.3.2")
    assert len(one.key) == 16
    assert _set("scikit-learn==1.3.1").key != one.key
    assert RequirementSet(one.requirements, "3.10").key != one.key  # another Python
    # MLflow's own packages are never installed: the server reads the flavour's file itself.
    assert _set("mlflow==2.10.0\nscikit-learn==1.3.2\nmlflow-skinny").requirements == (
        "scikit-learn==1.3.2",
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("numpy\n-r other.txt\n", "requirements.txt, line 2: '-r other.txt': options are not"),
        ("--index-url http://x/\n", "requirements.txt, line 1: '--index-url http://x/'"),
        ("numpy\nnot a requirement!\n", "requirements.txt, line 2: 'not a requirement!': "),
    ],
)
def test_what_is_not_a_requirement_fails_naming_its_line(text: str, said: str) -> None:
    with pytest.raises(ModelLoadError) as caught:
        parse(text, "requirements.txt")
    assert caught.value.message.startswith(said)


def test_a_folder_s_set_from_requirements_txt_or_python_env_yaml(tmp_path: Path) -> None:
    assert read_folder(tmp_path) is None
    (tmp_path / "requirements.txt").write_text("scikit-learn==1.3.2\n")
    found = read_folder(tmp_path)
    assert found is not None and found.requirements == ("scikit-learn==1.3.2",)
    (tmp_path / "python_env.yaml").write_text(
        "python: 3.11.7\nbuild_dependencies:\n- pip\ndependencies:\n- -r requirements.txt\n"
        "- numpy==1.26.4\n"
    )
    found = read_folder(tmp_path)
    assert found is not None
    assert found.requirements == ("numpy==1.26.4", "scikit-learn==1.3.2")
    (tmp_path / "python_env.yaml").write_text("dependencies:\n- -r ../elsewhere.txt\n")
    with pytest.raises(ModelLoadError, match="not a file of the folder"):
        read_folder(tmp_path)
    (tmp_path / "python_env.yaml").write_text("dependencies:\n- mlflow\n")
    assert read_folder(tmp_path) is None  # nothing but MLflow: the server's environment


@pytest.mark.parametrize(
    ("line", "met"),
    [
        ("numpy", True),
        (f"numpy=={np.__version__}", True),
        ("numpy>=1.0", True),
        ("numpy==0.0.1", False),
        ("numpy<1", False),
        ("mmserver-no-such-distribution", False),
        ("mmserver-no-such-distribution; python_version < '3'", True),  # not for this Python
    ],
)
def test_the_server_s_environment_meets_a_requirement_by_its_installed_version(
    line: str, met: bool
) -> None:
    assert (not unmet((str(Requirement(line)),))) is met


def test_a_pickle_is_pinned_to_its_version_and_numpy_1_before_1_4_2() -> None:
    assert pinned_for_skew("1.3.2").requirements == ("numpy<2", "scikit-learn==1.3.2")
    assert pinned_for_skew("1.5.1").requirements == ("scikit-learn==1.5.1",)


PIP_OUTPUT = """\
Looking in indexes: https://pypi.org/simple
ERROR: Could not find a version that satisfies the requirement nosuch==9.9 (from versions: none)
ERROR: No matching distribution found for nosuch==9.9
"""
UV_OUTPUT = """\
  \u00d7 No solution found when resolving dependencies:
  \u2570\u2500\u25b6 Because nosuch was not found in the package registry and you require
      nosuch==9.9, we can conclude that your requirements are unsatisfiable.
"""


@pytest.mark.parametrize(
    ("output", "line"),
    [
        (PIP_OUTPUT, "No matching distribution found for nosuch==9.9"),
        (UV_OUTPUT, "nosuch==9.9, we can conclude that your requirements are unsatisfiable."),
        (
            "error: Failed to fetch: `https://x/`\n  Caused by: connection refused\n",
            "connection refused",
        ),
        ("", ""),
    ],
)
def test_the_installer_s_last_error_line(output: str, line: str) -> None:
    assert building.last_error_line(output) == line


def test_the_packages_a_line_names() -> None:
    wanted = _set("nosuch==9.9\nnumpy==1.26.4\n")
    assert building.named_packages("No matching distribution for nosuch==9.9", wanted) == [
        "nosuch==9.9"
    ]
    assert building.named_packages("a network error", wanted) == list(wanted.requirements)


async def test_a_failure_is_answered_until_its_retry_time_or_another_entry(
    tmp_path: Path,
) -> None:
    envs = Environments(
        tmp_path, Metrics(), timeout=5.0, retry_s=3600.0, max_envs=0, disk_mb=0, uv=None
    )
    wanted = _set("nosuch==9.9")
    failed = Environment(wanted, tmp_path / wanted.key, EnvState.FAILED)
    failed.error = EnvironmentFailed("its requirements cannot be installed: nosuch==9.9: gone")
    failed.failed_at, failed.failed_for = envs._clock(), "entry-1"
    envs.envs[wanted.key] = failed
    with pytest.raises(EnvironmentFailed, match=r"nosuch==9\.9: gone"):
        envs.get(wanted, "entry-1")
    assert failed.build is None  # not built again
    again = envs.get(wanted, "entry-2")  # the store entry changed: built again at once
    assert again is failed and failed.state is EnvState.BUILDING and failed.build is not None
    failed.build.cancel()
    await asyncio.gather(failed.build, return_exceptions=True)


def _built(folder: Path, wanted: RequirementSet) -> Path:
    """A finished environment's folder, as a build leaves it (its interpreter a link)."""
    done = folder / wanted.key
    (done / "bin").mkdir(parents=True)
    (done / "bin" / "python").symlink_to(sys.executable)
    manifest = {
        "key": wanted.key,
        "requirements": list(wanted.requirements),
        "python": wanted.python,
        "versions": {"scikit-learn": "1.3.2"},
        "tool": "uv",
        "seconds": 2.5,
    }
    (done / building.MANIFEST).write_text(json.dumps(manifest))
    return done


@pytest.mark.parametrize(("max_envs", "disk_mb"), [(1, 0), (0, 2)])
async def test_unused_environments_are_removed_oldest_first_past_the_limits(
    tmp_path: Path, max_envs: int, disk_mb: int
) -> None:
    sets = [_set(f"scikit-learn==1.{minor}.0") for minor in (1, 2, 3)]
    for wanted in sets:
        _built(tmp_path, wanted)
    envs = Environments(
        tmp_path, Metrics(), timeout=5.0, retry_s=1.0, max_envs=max_envs, disk_mb=disk_mb, uv=None
    )
    assert envs.scan() == 3
    removed: list[str] = []

    async def on_remove(key: str) -> None:
        removed.append(key)

    envs.on_remove = on_remove
    oldest, used, newer = (envs.envs[w.key] for w in sets)
    oldest.last_used, used.last_used, newer.last_used = 1.0, 0.5, 2.0
    used.users.add("churn")  # oldest of all, but a loaded model runs there
    for env in (oldest, used, newer):
        env.disk_bytes = 2 << 20  # three of 2 MiB: one fits a budget of 2 MiB
    await envs._trim()
    assert removed == [oldest.key, newer.key]
    assert list(envs.envs) == [used.key]
    assert not (tmp_path / oldest.key).exists() and (tmp_path / used.key).exists()


def test_a_restart_takes_finished_environments_and_removes_unfinished_ones(
    tmp_path: Path,
) -> None:
    wanted = _set("scikit-learn==1.3.2")
    _built(tmp_path, wanted)
    unfinished = tmp_path / "0123456789abcdef"
    (unfinished / "bin").mkdir(parents=True)
    envs = Environments(
        tmp_path, Metrics(), timeout=5.0, retry_s=1.0, max_envs=0, disk_mb=0, uv=None
    )
    assert envs.scan() == 1
    assert not unfinished.exists()
    env = envs.envs[wanted.key]
    assert env.state is EnvState.READY
    assert env.describe() == {
        "id": wanted.key,
        "state": "ready",
        "python": wanted.python,
        "requirements": ["scikit-learn==1.3.2"],
        "versions": {"scikit-learn": "1.3.2"},
        "builtWith": "uv",
        "buildSeconds": 2.5,
    }


def test_an_environment_s_fork_server_starts_answers_and_loses_a_process(
    tmp_path: Path,
) -> None:
    server = EnvForkServer("env-test", Path(sys.executable), package_link(tmp_path / "path"))
    context = EnvContext(server)
    try:
        parent, child = context.Pipe()
        process = context.Process(
            target=print, args=(child, 7, 0, False, "env-test"), name="backend"
        )
        process.start()
        child.close()
        assert process.pid is not None and process.is_alive() and process.exitcode is None
        sock = socket.socket(fileno=os.dup(parent.fileno()))
        sock.setblocking(True)
        send_frame(sock, frame((wire.PING,)))
        data = FrameReader(sock).read()
        assert data is not None
        assert pickle.loads(data) == (wire.OK, process.pid)
        process.kill()
        process.join(10.0)
        assert process.exitcode == -9 and not process.is_alive()
        sock.close()
        parent.close()
    finally:
        server.stop()


async def test_a_build_past_its_deadline_is_killed_and_fails_its_loads(tmp_path: Path) -> None:
    metrics = Metrics()
    envs = Environments(
        tmp_path, metrics, timeout=0.001, retry_s=3600.0, max_envs=0, disk_mb=0, uv=None
    )
    wanted = _set("scikit-learn==1.3.2")
    env = envs.get(wanted, "entry")
    with pytest.raises(EnvironmentFailed) as caught:
        await envs.ready(env, "churn")
    assert caught.value.message == (
        "its environment (scikit-learn==1.3.2) was not built within env_build_timeout_s=0.001 s"
    )
    assert env.state is EnvState.FAILED and not env.users
    assert not (tmp_path / wanted.key).exists()
    assert metrics.env_build_failures.labels().value == 1


#: What a model environment is sure to have: the model's own scikit-learn (with SciPy and
#: threadpoolctl), NumPy and joblib (with cloudpickle, which joblib's loky imports).
_ENVIRONMENT_HAS = {
    "numpy",
    "joblib",
    "cloudpickle",
    "sklearn",
    "scipy",
    "threadpoolctl",
    "mmserver",
}

_IMPORT_BACKEND_SIDE = """
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in HAS or top.startswith("_"):
            return None
        raise ImportError(f"{name} is not in a model environment")

HAS = set(sys.argv[1].split(","))
sys.meta_path.insert(0, Absent())
for module in sys.argv[2:]:
    __import__(module)
print("imported")
"""


def test_the_backend_side_imports_with_nothing_but_numpy_joblib_and_scikit_learn() -> None:
    """What a model environment's fork server and backend processes import runs without any of
    the server's other libraries (aiohttp, pandas, prometheus-client, setproctitle, packaging,
    PyYAML...), as a model environment has none of them."""
    import subprocess

    modules = [
        "mmserver.backend.envfork",
        "mmserver.backend.child",
        "mmserver.backend.batching",
        "mmserver.execution.predictor",
        "mmserver.execution.families",
        "mmserver.execution.fastpath",
        "mmserver.execution.candidates",
        "mmserver.execution.explainers",
    ]
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_BACKEND_SIDE, ",".join(_ENVIRONMENT_HAS), *modules],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"
