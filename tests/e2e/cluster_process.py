"""A real cluster (``mmserver cluster start``: mmserver instances behind HAProxy) for end-to-end
tests, stopped with ``mmserver cluster stop`` and, should that fail, by the recorded pids."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import pytest

from tests.e2e.server_process import ROOT, alive, descendants, free_port


def require_haproxy() -> str:
    """The haproxy binary, or skip: ``scripts/test`` installs it where apt-get is available."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).is_file()), None
    )
    if found is None:
        pytest.skip(
            "haproxy is not installed and could not be installed here "
            "(scripts/test installs the Debian package haproxy with apt-get)"
        )
    return found


async def run_cli(*args: str, timeout: float = 120.0) -> tuple[int, str]:
    """``mmserver cluster ARGS`` (what ``scripts/cluster`` runs): (exit code, output)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mmserver",
        "cluster",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


class ClusterProcess:
    """``mmserver cluster start`` with ``args`` over ``store``, its state in ``state_dir``."""

    def __init__(self, store: Path, state_dir: Path, *args: str) -> None:
        self.store = store
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.state: dict[str, Any] = {}
        self._recorded: set[int] = set()

    async def __aenter__(self) -> ClusterProcess:
        code, out = await run_cli(
            "start",
            "--model-store",
            str(self.store),
            "--state-dir",
            str(self.state_dir),
            "--port",
            str(self.port),
            *self.args,
        )
        self.state = json.loads((self.state_dir / "cluster.json").read_text()) if code == 0 else {}
        if code != 0:
            raise AssertionError(f"scripts/cluster start failed ({code}):\n{out}\n{self.logs()}")
        self._remember()
        return self

    def reload_state(self) -> dict[str, Any]:
        self.state = json.loads((self.state_dir / "cluster.json").read_text())
        self._remember()
        return self.state

    def _remember(self) -> None:
        """Every process of the cluster seen so far, to check they all went away at the end."""
        for pid in self.pids():
            self._recorded.add(pid)
            self._recorded.update(descendants(pid))

    def pids(self) -> list[int]:
        instances = [int(i["pid"]) for i in self.state.get("instances", [])]
        return [
            int(self.state["supervisor"]["pid"]),
            int(self.state["balancer"]["pid"]),
            *instances,
        ]

    def instance(self, name: str) -> dict[str, Any]:
        return next(i for i in self.state["instances"] if i["name"] == name)

    async def server_stats(self) -> dict[str, dict[str, str]]:
        """HAProxy's CSV stats of the instances, by name."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.state['stats_port']}/stats;csv") as response,
        ):
            text = await response.text()
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {
            r["svname"]: r
            for r in rows
            if r["pxname"] == "instances" and r["svname"] not in ("FRONTEND", "BACKEND")
        }

    def kill_instance(self, name: str) -> set[int]:
        """SIGKILL one instance's server process; returns its descendants (its backend
        processes), which the kill leaves to end on their own."""
        pid = int(self.instance(name)["pid"])
        family = descendants(pid)
        self._recorded.update(family)
        os.kill(pid, signal.SIGKILL)
        return family

    def logs(self) -> str:
        parts = []
        for path in sorted(self.state_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    async def stop(self) -> str:
        self._remember()
        code, out = await run_cli("stop", "--state-dir", str(self.state_dir))
        assert code == 0, out
        return out

    async def leftovers(self, timeout: float = 10.0) -> list[int]:
        """The cluster's processes still alive after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            left = [p for p in self._recorded if alive(p)]
            if not left or loop.time() > give_up:
                return left
            await asyncio.sleep(0.05)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if (self.state_dir / "cluster.json").exists():
            await run_cli("stop", "--state-dir", str(self.state_dir))
        for pid in await self.leftovers(5.0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
