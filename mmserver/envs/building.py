"""One environment built: a virtual environment with a requirement set installed, from the
package index the server's own pip is configured with.

With ``uv`` installed (beside the server's interpreter or on ``PATH``): ``uv venv`` and
``uv pip install``, told pip's configured index, extra indexes and find-links (uv reads no pip
configuration of its own). Without: ``python -m venv`` and the new environment's pip, which
reads the same pip configuration as the server's. Each step is a subprocess awaited on the event
loop (nothing blocks it), in a session of its own so that a build past its deadline is killed
with everything it started.

A built environment holds :data:`MANIFEST`: its set, its Python, what it installed (name →
version) and how long it took. A folder without it is a build that did not finish, removed and
built again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.envs.requirements import BASE, RequirementSet

MANIFEST = "mmserver-env.json"
#: What is kept of a failing step's output for its message.
_TAIL_BYTES = 64 << 10


class BuildFailed(Exception):
    """A build that failed: ``line`` is the installer's last error line, ``packages`` the
    requirements of the set it names (all of them when it names none)."""

    def __init__(self, line: str, packages: list[str]) -> None:
        super().__init__(line)
        self.line = line
        self.packages = packages


@dataclass(frozen=True)
class Built:
    """What a finished build left: the interpreter, what it installed, the seconds it took and
    the tool that built it (``uv`` or ``pip``)."""

    python: Path
    versions: dict[str, str]
    seconds: float
    tool: str


def find_uv() -> str | None:
    """The ``uv`` executable: beside the server's interpreter (installed in its environment),
    else on ``PATH``; ``None`` without one."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


def interpreter(folder: Path) -> Path:
    return folder / "bin" / "python"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a finished environment; ``None`` for one that is not finished."""
    try:
        data = json.loads((folder / MANIFEST).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and interpreter(folder).exists() else None


async def build(
    wanted: RequirementSet, folder: Path, timeout: float, uv: str | None = None
) -> Built:
    """Build the environment of ``wanted`` in ``folder`` (whatever was there is removed first),
    within ``timeout`` seconds. Raises :class:`BuildFailed`, or :class:`TimeoutError`."""
    started = time.perf_counter()
    await asyncio.to_thread(shutil.rmtree, folder, True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    python = interpreter(folder)
    listing = folder.with_name(folder.name + ".requirements.txt")
    listing.write_text(wanted.text() + "".join(f"{name}\n" for name in BASE), "utf-8")
    try:
        if uv is not None:
            await _run([uv, "venv", "--quiet", "--python", sys.executable, str(folder)], deadline)
            index = await _pip_index_options()
            # Compiled now, as pip does: an environment's fork server then starts without
            # compiling scikit-learn at each start (1.5 s), however the server runs.
            install = [uv, "pip", "install", "--compile-bytecode", "--python", str(python)]
            install += [*index, "-r", str(listing)]
            await _run(install, deadline, wanted)
            frozen = await _run([uv, "pip", "freeze", "--python", str(python)], deadline)
        else:
            await _run([sys.executable, "-m", "venv", str(folder)], deadline)
            pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
            await _run([*pip, "install", "--quiet", "-r", str(listing)], deadline, wanted)
            frozen = await _run([*pip, "freeze", "--all"], deadline)
    finally:
        listing.unlink(missing_ok=True)
    versions = dict(
        line.split("==", 1) for line in frozen.splitlines() if "==" in line and " @ " not in line
    )
    seconds = time.perf_counter() - started
    tool = "uv" if uv is not None else "pip"
    manifest = {
        "key": wanted.key,
        "requirements": list(wanted.requirements),
        "python": wanted.python,
        "versions": versions,
        "seconds": round(seconds, 3),
        "tool": tool,
        "built_at": time.time(),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), "utf-8")
    return Built(python, versions, seconds, tool)


async def _pip_index_options() -> list[str]:
    """uv's options for the indexes and find-links pip is configured with (its configuration
    files and ``PIP_*`` variables), resolved as pip resolves them: the best version of every
    index, not the first index's."""
    text = await _run([sys.executable, "-m", "pip", "config", "list"], time.monotonic() + 60)
    options: list[str] = ["--index-strategy", "unsafe-best-match"]
    for line in text.splitlines():
        key, _, raw = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        value = raw.strip().strip("'\"")
        flag = {
            "index-url": "--index-url",
            "extra-index-url": "--extra-index-url",
            "find-links": "--find-links",
        }.get(name)
        if flag is None or not value:
            continue
        for each in value.split():
            if flag == "--index-url" and "--index-url" in options:
                continue
            options += [flag, each]
    return options


async def _run(argv: list[str], deadline: float, wanted: RequirementSet | None = None) -> str:
    """Run one step; its standard output. A step that fails raises :class:`BuildFailed` with
    its last error line; one past ``deadline`` is killed and raises :class:`TimeoutError`."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(
            process.communicate(), max(0.0, deadline - time.monotonic())
        )
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    if process.returncode != 0:
        text = (err[-_TAIL_BYTES:] + b"\n" + out[-_TAIL_BYTES:]).decode("utf-8", "replace")
        line = last_error_line(text) or f"{Path(argv[0]).name} exited {process.returncode}"
        raise BuildFailed(line, named_packages(line, wanted))
    return out.decode("utf-8", "replace")


#: What uv draws before its lines (a cross, tree branches, an arrow).
_DECORATION = re.compile("^[\\s\u00d7\u2570\u2500\u25b6\u2502|:]+")


def last_error_line(text: str) -> str:
    """The installer's last error line: pip's last ``ERROR:`` line, else the last line that
    says anything (uv's explanation)."""
    lines = [_DECORATION.sub("", line).strip() for line in text.splitlines()]
    errors = [line[len("ERROR:") :].strip() for line in lines if line.startswith("ERROR:")]
    if errors:
        return errors[-1]
    said = [line for line in lines if line and not line.startswith(("hint:", "help:"))]
    last = said[-1] if said else ""
    for prefix in ("error:", "cause:", "Caused by:"):
        last = last.removeprefix(prefix).strip()
    return last


def named_packages(line: str, wanted: RequirementSet | None) -> list[str]:
    """The requirements of ``wanted`` whose names ``line`` mentions (all when none is)."""
    if wanted is None:
        return []
    from packaging.requirements import Requirement

    lowered = line.lower().replace("_", "-")
    named = [r for r in wanted.requirements if Requirement(r).name in lowered]
    return named or list(wanted.requirements)


def disk_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take (blocking: run it in a thread)."""
    total = 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
