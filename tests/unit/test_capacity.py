"""Capacity defaults from fake cgroup v1 and v2 trees written by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmserver.config.server import ServerConfig
from mmserver.ops import capacity

GiB = 2**30
MiB = 2**20


def write(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def v2_tree(root: Path, cpu_max: str, memory_max: str, *, own: str = "/") -> Path:
    folder = "sys/fs/cgroup" + own.rstrip("/")
    return write(
        root,
        {
            "proc/self/cgroup": f"0::{own}\n",
            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
            f"{folder}/cpu.max": cpu_max + "\n",
            f"{folder}/memory.max": memory_max + "\n",
            "proc/meminfo": "MemTotal: 65536000 kB\nMemAvailable: 33554432 kB\n",
        },
    )


def v1_tree(root: Path, quota: int, period: int, memory: int, *, own: str = "/") -> Path:
    own_dir = own.rstrip("/")
    return write(
        root,
        {
            "proc/self/cgroup": (
                f"12:memory:{own}\n11:cpu,cpuacct:{own}\n10:pids:{own}\n1:name=systemd:{own}\n"
            ),
            f"sys/fs/cgroup/cpu,cpuacct{own_dir}/cpu.cfs_quota_us": f"{quota}\n",
            f"sys/fs/cgroup/cpu,cpuacct{own_dir}/cpu.cfs_period_us": f"{period}\n",
            f"sys/fs/cgroup/memory{own_dir}/memory.limit_in_bytes": f"{memory}\n",
            "proc/meminfo": "MemTotal: 65536000 kB\nMemAvailable: 33554432 kB\n",
        },
    )


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("100000 100000", 1)],
)
def test_v2_cpu_quota(tmp_path: Path, cpu_max: str, expected: int) -> None:
    root = v2_tree(tmp_path, cpu_max, "max")
    limit = capacity.cpus(root, affinity=64)
    assert limit.value == expected
    assert limit.source == f"cgroup v2 cpu.max {cpu_max}"


def test_v2_no_quota_falls_back_to_the_affinity_mask(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "max 100000", "max")
    assert capacity.cpus(root, affinity=6) == capacity.Limit(6, "CPU affinity mask (6 CPUs)")
    assert capacity.cgroup_memory_bytes(root) is None


def test_the_affinity_mask_caps_a_larger_quota(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "800000 100000", "max")
    assert capacity.cpus(root, affinity=3).value == 3


def test_v2_the_smallest_limit_on_the_path_wins(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "max 100000", "max", own="/kubepods/pod1/ctr")
    write(
        root,
        {
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "300000 100000\n",
            "sys/fs/cgroup/kubepods/pod1/memory.max": f"{2 * GiB}\n",
            "sys/fs/cgroup/kubepods/cpu.max": "1600000 100000\n",
            "sys/fs/cgroup/kubepods/memory.max": f"{64 * GiB}\n",
        },
    )
    assert capacity.cpus(root, affinity=64).value == 3
    assert capacity.cgroup_memory_bytes(root) == capacity.Limit(
        2 * GiB, f"cgroup v2 memory.max {2 * GiB}"
    )


def test_v1_cfs_quota_and_memory_limit(tmp_path: Path) -> None:
    root = v1_tree(tmp_path, 250000, 100000, 3 * GiB)
    assert capacity.cpus(root, affinity=64) == capacity.Limit(
        3, "cgroup v1 cpu.cfs_quota_us 250000 / cpu.cfs_period_us 100000"
    )
    assert capacity.cgroup_memory_bytes(root) == capacity.Limit(
        3 * GiB, f"cgroup v1 memory.limit_in_bytes {3 * GiB}"
    )


def test_v1_unlimited(tmp_path: Path) -> None:
    root = v1_tree(tmp_path, -1, 100000, 9223372036854771712)
    assert capacity.cgroup_cpus(root) is None
    assert capacity.cgroup_memory_bytes(root) is None
    assert capacity.cpus(root, affinity=4).value == 4


def test_v1_container_sees_the_host_path_but_mounts_its_own_cgroup(tmp_path: Path) -> None:
    """Inside a container /proc/self/cgroup names the host's path (/docker/ID), which is not
    under the container's mount: the mount's own files are the container's limits."""
    root = v1_tree(tmp_path, 100000, 100000, 512 * MiB)
    write(root, {"proc/self/cgroup": "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n"})
    assert capacity.cpus(root, affinity=8).value == 1
    assert capacity.cgroup_memory_bytes(root) is not None


def test_memory_budget_is_the_limit_less_the_servers_own_use(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "max 100000", str(2 * GiB))
    budget = capacity.memory_budget(512 * MiB, root)
    assert budget.value == int((2 * GiB - 512 * MiB) * 0.8) // MiB
    assert budget.source == (
        f"80% of cgroup v2 memory.max {2 * GiB} less 512 MiB used by the server"
    )


def test_memory_budget_without_a_limit_uses_available_memory(tmp_path: Path) -> None:
    root = v2_tree(tmp_path, "max 100000", "max")
    budget = capacity.memory_budget(512 * MiB, root)
    assert budget == capacity.Limit(int(32 * GiB * 0.8) // MiB, "80% of MemAvailable 32768 MiB")


def test_a_limit_above_the_hosts_available_memory_is_capped(tmp_path: Path) -> None:
    root = v1_tree(tmp_path, -1, 100000, 256 * GiB)
    assert capacity.memory_budget(0, root).source.startswith("80% of MemAvailable")


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    root = write(tmp_path, {"proc/meminfo": "MemAvailable: 1048576 kB\n"})
    assert capacity.cgroup_cpus(root) is None
    assert capacity.cgroup_memory_bytes(root) is None
    assert capacity.memory_budget(0, root).value == int(GiB * 0.8) // MiB


@pytest.mark.parametrize("garbage", ["", "lots", "-5 100000", "100000 0", "1 2 3"])
def test_malformed_files_are_no_limit(tmp_path: Path, garbage: str) -> None:
    root = v2_tree(tmp_path, garbage, garbage)
    assert capacity.cgroup_cpus(root) is None
    assert capacity.cgroup_memory_bytes(root) is None


def test_the_option_wins_over_detection() -> None:
    config = ServerConfig(max_memory_mb=300)
    assert config.memory_budget(10 * GiB) == capacity.Limit(300, "option max_memory_mb")
    assert ServerConfig(backend_processes=0).backend_processes_source() == (
        "option backend_processes"
    )
