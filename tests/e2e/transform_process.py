"""``mmserver transform`` run as the user runs it, in a child process, and the data and models
its tests use (real files, real models, their predictions computed here for comparison)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import joblib
import numpy as np

from tests.e2e.server_process import ROOT


async def run_transform(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> tuple[int, str]:
    """``mmserver transform ARGS``: (exit code, what it printed)."""
    proc = await start_transform(*args, env=env)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def start_transform(
    *args: str, env: Mapping[str, str] | None = None
) -> asyncio.subprocess.Process:
    """``mmserver transform ARGS`` started, its output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mmserver",
        "transform",
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


def write_csv_files(folder: Path, sizes: Mapping[str, int], features: int, seed: int = 0) -> None:
    """CSV files of random rows (``sizes``: relative name -> rows), values with 6 decimals."""
    generator = np.random.default_rng(seed)
    for name, count in sizes.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = generator.uniform(-5, 5, size=(count, features))
        path.write_text("".join(",".join(f"{v:.6f}" for v in row) + "\n" for row in rows))


def csv_rows(path: Path) -> np.ndarray:
    """The rows of a CSV input file."""
    return np.array([[float(v) for v in line.split(",")] for line in path.read_text().split()])


def predictions(model_dir: Path, rows: Any) -> np.ndarray:
    """What the model in ``model_dir`` (``model.joblib``, ``option.method`` aside) predicts."""
    model = joblib.load(model_dir / "model.joblib")
    return np.asarray(model.predict(np.asarray(rows, dtype=float)))


def outputs(folder: Path) -> dict[str, bytes]:
    """Every file of an output folder (the journal aside), by relative path."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and ".mmserver-transform" not in path.parts
    }
