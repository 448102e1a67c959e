"""The ``mmserver`` command line: help, flags derived from ServerConfig, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mmserver import __version__
from mmserver.cli import build_config, build_parser, main
from mmserver.config.server import ServerConfig


def serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_serve_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    text = serve_help(capsys)
    words = set(text.replace(",", " ").split())  # "--x, --no-x" for options on by default
    assert "--config" in words
    for field in ServerConfig.options():
        flag = "--" + field.name.replace("_", "-")
        env = "MMSERVER_" + field.name.upper()
        assert flag in words, flag
        assert env + ")" in words, env
        first_words = str(field.metadata["help"]).split()[:2]
        assert " ".join(first_words) in " ".join(text.split()), field.name
    assert "80% of the container's memory limit" in " ".join(text.split())


def test_python_dash_m_works() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mmserver", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--max-workers" in done.stdout
    assert "MMSERVER_MAX_WORKERS" in done.stdout


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: mmserver" in out
    assert "serve" in out


def test_cluster_is_listed_and_runs_its_own_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "cluster" in capsys.readouterr().out
    done = subprocess.run(
        [sys.executable, "-m", "mmserver", "cluster", "config", "--server", "127.0.0.1:9001"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "server i0 127.0.0.1:9001 id 1" in done.stdout
    assert "balance leastconn" in done.stdout


def test_serving_does_not_import_the_cluster_nor_the_batch_transform() -> None:
    code = (
        "import sys\n"
        "import mmserver.cli, mmserver.server\n"
        "mmserver.cli.build_config(['serve'], {})\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mmserver.commands.cluster', "
        "'mmserver.commands.transform'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mmserver {__version__}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "--port", "abc"], "mmserver: option --port: value 'abc' is not a valid int"),
        (["serve", "--max-workers", "-3"], "mmserver: option max_workers=-3: must not be negative"),
        (
            ["serve", "--min-workers", "5", "--max-workers", "2"],
            "mmserver: option min_workers=5 is greater than max_workers=2",
        ),
        (["serve", "--predict-timeout", "soon"], "option --predict-timeout: value 'soon'"),
        (["serve", "--heavy-nice", "20"], "option heavy_nice=20: must be between 1 and 19"),
        (["serve", "--config", "/nonexistent/mm.properties"], "does not exist"),
    ],
)
def test_bad_values_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.startswith("mmserver: ")
    assert "Traceback" not in err


def test_unknown_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_precedence_through_the_parser(tmp_path: Path) -> None:
    conf = tmp_path / "mm.properties"
    conf.write_text("port=8001\nbatch_size=2\nmax_idle_time=5\naccess_log=true\n")
    env = {"MMSERVER_PORT": "8002", "MMSERVER_BATCH_SIZE": "3", "MMSERVER_MAX_WORKERS": "6"}
    argv = ["serve", "--config", str(conf), "--port", "8003", "--model-store", str(tmp_path)]
    config = build_config(argv, env)
    assert config.port == 8003  # flag
    assert config.batch_size == 3  # env over file
    assert config.max_workers == 6  # env
    assert config.max_idle_time == 5  # file
    assert config.access_log is True  # file; the absent flag does not reset it
    assert config.max_batch_delay == 0  # default
    assert config.store_path == tmp_path.resolve()


def test_bool_flags(tmp_path: Path) -> None:
    assert build_config(["serve"], {}).insecure_management is False
    assert build_config(["serve", "--insecure-management"], {}).insecure_management is True
    env = {"MMSERVER_INSECURE_MANAGEMENT": "1"}
    assert build_config(["serve"], env).insecure_management is True
    # An option that is on by default is turned off with --no-<name> (or its variable).
    assert build_config(["serve"], {}).lean_http is True
    assert build_config(["serve", "--no-lean-http"], {}).lean_http is False
    assert build_config(["serve"], {"MMSERVER_LEAN_HTTP": "0"}).lean_http is False
    # The heavy lane runs at a nice value unless asked for SCHED_IDLE.
    assert build_config(["serve"], {}).heavy_sched_idle is False
    assert build_config(["serve", "--heavy-sched-idle"], {}).heavy_sched_idle is True
    assert build_config(["serve", "--no-heavy-sched-idle"], {}).heavy_sched_idle is False
    assert build_config(["serve"], {}).heavy_nice == 5


def test_every_flag_reaches_the_config() -> None:
    argv = ["serve"]
    expected: dict[str, object] = {}
    for field in ServerConfig.options():
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            argv.append(flag)
            expected[field.name] = True
        elif isinstance(field.default, int):
            value = {"port": 9001, "min_workers": 1}.get(field.name, 7)
            argv += [flag, str(value)]
            expected[field.name] = value
        elif isinstance(field.default, float):
            argv += [flag, "1.5"]
            expected[field.name] = 1.5
        else:
            value = {
                "log_level": "DEBUG",
                "metrics_model_label": "none",
                "log_format": "json",
                "unknown_options": "warn",
                "trusted_types": "fractions.Fraction",
                "trusted_models": "team-a-*",
                "on_version_skew": "warn",
                "env_installer": "pip",
                "peers": "10.0.0.2:8080,10.0.0.3:8080",
            }.get(field.name, f"/x/{field.name}")
            argv += [flag, value]
            expected[field.name] = value
    config = build_config(argv, {})
    assert {name: getattr(config, name) for name in expected} == expected


def _file(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p / "missing", "does not exist: create it, or pass the folder"),
        (lambda p: _file(p / "file"), "is not a directory"),
    ],
)
def test_a_store_that_cannot_serve_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, expected: str
) -> None:
    store = make(tmp_path)
    assert main(["serve", "--model-store", str(store)]) == 2
    # The last line: others before it may say what the environment holds that is not an option.
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"mmserver: the model store {store} ")
    assert expected in err


_STATE_DIR_REFUSED = (
    "the instances cannot share a state_dir (--server-arg=--state-dir or MMSERVER_STATE_DIR): "
    "each has its own under the cluster's --state-dir (its warm set), and asynchronous "
    "inference keeps its journal on one server; serve it with mmserver serve"
)
_GRPC_PORT_REFUSED = (
    "the instances cannot share a grpc_port (--server-arg=--grpc-port or "
    "MMSERVER_GRPC_PORT): only the first would listen on it, and the balancer carries "
    "HTTP only; serve gRPC with mmserver serve"
)


@pytest.mark.parametrize(
    ("server_args", "env", "refused"),
    [
        (["--server-arg=--state-dir=/var/lib/mmserver"], {}, _STATE_DIR_REFUSED),
        (["--server-arg=--state-dir", "--server-arg=/var/lib/mmserver"], {}, _STATE_DIR_REFUSED),
        ([], {"MMSERVER_STATE_DIR": "/var/lib/mmserver"}, _STATE_DIR_REFUSED),
        ([], {"MMSERVER_GRPC_PORT": "8081"}, _GRPC_PORT_REFUSED),
    ],
)
def test_a_cluster_refuses_a_state_dir_or_a_grpc_port_for_its_instances(
    server_args: list[str],
    env: dict[str, str],
    refused: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mmserver.commands.cluster.cli import parse_args

    for name in ("MMSERVER_STATE_DIR", "MMSERVER_GRPC_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        parse_args(["start", "--model-store", ".", *server_args])
    assert stopped.value.code == 2
    assert refused in capsys.readouterr().err


def test_what_a_cluster_reads_of_its_instances_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmserver.commands.cluster.cli import _instance_option

    monkeypatch.delenv("MMSERVER_STATE_DIR", raising=False)
    monkeypatch.setenv("MMSERVER_GRPC_PORT", "8081")
    assert _instance_option(["--max-workers=2"], "state_dir") is None
    assert _instance_option(["--state-dir="], "state_dir") == ""
    assert _instance_option(["--state-dir", "/x"], "state_dir") == "/x"
    assert _instance_option([], "grpc_port") == "8081"
    assert _instance_option(["--grpc-port=0"], "grpc_port") == "0"  # the argument wins


def test_a_cluster_state_dir_too_long_for_haproxys_admin_socket_is_refused(
    tmp_path: Path,
) -> None:
    from mmserver.commands.cluster.cli import _spec, parse_args

    deep = tmp_path / ("d" * 100)
    with pytest.raises(SystemExit) as stopped:
        _spec(parse_args(["start", "--model-store", str(tmp_path), "--state-dir", str(deep)]))
    assert "too long for HAProxy's admin socket" in str(stopped.value.code)
    assert "choose a shorter --state-dir" in str(stopped.value.code)


def test_an_instance_of_a_cluster_has_a_state_dir_of_its_own(tmp_path: Path) -> None:
    from mmserver.commands.cluster.instances import InstanceSpec

    spec = InstanceSpec(tmp_path, 1, ("--warm-ready-timeout=5",), warm_ready_timeout=120)
    argv = spec.serve(9000, tmp_path / "instance-0").argv()
    own = argv.index(f"--state-dir={tmp_path / 'instance-0'}")
    # The cluster's warm_ready_timeout first: an argument of the operator's comes after, and wins.
    assert argv[own + 1 :] == ["--warm-ready-timeout=120", "--warm-ready-timeout=5"]
    assert not any(a.startswith("--state-dir") for a in spec.serve(9000).argv())


def test_the_instances_of_a_cluster_are_each_others_peers(tmp_path: Path) -> None:
    from mmserver.commands.cluster.cli import _spec, parse_args
    from mmserver.commands.cluster.cluster import Cluster

    cluster = Cluster(
        _spec(parse_args(["start", "--model-store", str(tmp_path), "--instances", "3"]))
    )
    ports = [instance.port for instance in cluster.instances]
    expected = "--peers=" + ",".join(f"127.0.0.1:{port}" for port in ports)
    for instance in cluster.instances:
        assert expected in instance.argv
