"""The transform section (``--only transform``): ``mmserver transform`` against a server of its
own, beside the same rows sent by wrk, the closed-loop load tool.

Per model (the reference linear model ``sklearn-0``, one feature; ``bench-transform-forest``, a
RandomForestRegressor of 300 trees of depth 14 on 8 features, written into the store on first
use): ``--transform-rows`` CSV rows in :data:`FILES` files, sent with the command's defaults
(``--split-type Line``, ``MultiRecord``, 6 MiB payloads) at ``--transform-concurrency``
requests in flight. Measured: the job's rows per second (wall time of the command, from its
start to its exit, reading and writing included); wrk's rows per second sending the job's first
payload, as the job sent it, over and over at the same concurrency for as long as the job ran
(at least ``--duration``); their ratio (target >= 0.8:
the job is not slower than a hand-written client); and the time of a rerun after the job was
killed (SIGKILL) once half its files were done, against the full run's (target about 0.5).
Then the linear model's job again through ``mmserver cluster`` (two instances of one backend
process each, behind HAProxy; skipped without HAProxy), with wrk at the same balancer.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proctools import free_port

from benchlib import servers
from benchlib.loads import Log, Settings, describe_run
from benchlib.store import write_forest
from mmserver.commands.loadtest import cpu, wrk

FILES = 20
CLUSTER_INSTANCES = 2
FOREST = "bench-transform-forest"
FOREST_FEATURES = 8
STAMP = ".bench-transform"
#: The job's payload limit (the command's default), in bytes.
PAYLOAD_BYTES = 6 * 1024 * 1024
JOB_TIMEOUT_S = 3600.0


def ensure(store: Path) -> None:
    """Write the section's forest into ``store`` unless this scikit-learn version did."""
    write_forest(store / FOREST, STAMP, FOREST_FEATURES, rows=20000, trees=300, depth=14, seed=11)


def compile_package(log: Log) -> None:
    """Write the bytecode of the mmserver package the command runs, as installing it does (pip
    compiles a package's modules): a checkout installed in editable mode and run with
    ``PYTHONDONTWRITEBYTECODE`` would compile every module it imports at every start (~80 ms of
    the command's start-up here), which no installed command does."""
    import compileall

    import mmserver

    folder = Path(mmserver.__file__).parent
    compileall.compile_dir(folder, quiet=1)
    log(f"compiled the bytecode of {folder}, as an installed package has it")


def write_inputs(folder: Path, rows: int, features: int) -> list[Path]:
    """``rows`` CSV rows of ``features`` values in :data:`FILES` files."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    paths = []
    for n in range(FILES):
        count = rows // FILES + (1 if n < rows % FILES else 0)
        values = rng.uniform(-1.0, 1.0, size=(count, features))
        path = folder / f"part-{n:02d}.csv"
        np.savetxt(path, values, delimiter=",", fmt="%.6f")
        paths.append(path)
    return paths


def first_payload(path: Path) -> tuple[bytes, int]:
    """The job's first payload of ``path`` (as many lines as fit in :data:`PAYLOAD_BYTES`) and
    its rows."""
    lines, size = [], 0
    for line in path.read_bytes().splitlines():
        if size + len(line) + 1 > PAYLOAD_BYTES:
            break
        lines.append(line)
        size += len(line) + 1
    return b"\n".join(lines) + b"\n", len(lines)


@dataclass(frozen=True)
class Target:
    """Where a job goes: a server, or a cluster's balancer (``pid`` None: no CPU counted)."""

    name: str
    url: str
    pid: int | None


@contextmanager
def cluster(exe: Path, store: Path, state: Path, log: Log) -> Iterator[Target]:
    """``mmserver cluster`` of :data:`CLUSTER_INSTANCES` instances of one backend process each
    over ``store``, stopped at the end."""
    port = free_port()
    start = [
        str(exe), "cluster", "start", "--instances", str(CLUSTER_INSTANCES), "--model-store",
        str(store), "--state-dir", str(state), "--port", str(port), "--backend-processes", "1",
    ]  # fmt: skip
    done = subprocess.run(start, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"mmserver cluster start exited with {done.returncode}:\n{done.stdout}")
    try:
        log(f"mmserver cluster of {CLUSTER_INSTANCES} on http://127.0.0.1:{port}")
        yield Target(f"{CLUSTER_INSTANCES}-instance cluster", f"http://127.0.0.1:{port}", None)
    finally:
        stop = [str(exe), "cluster", "stop", "--state-dir", str(state)]
        subprocess.run(stop, capture_output=True, text=True, timeout=300)


def _command(exe: Path, server: Target, model: str, data: Path, out: Path, c: int) -> list[str]:
    return [
        str(exe), "transform", "--url", server.url, "--model", model, "--input", str(data),
        "--output", str(out), "--max-concurrent-transforms", str(c), "--progress", "none",
    ]  # fmt: skip


_SUMMARY_SECONDS = re.compile(r"records \(\d[\d,]* in failed files\) in \S+ \(([\d.]+) s\)")


def _job(argv: list[str]) -> tuple[float, float]:
    """Run a job: its wall time (the command from start to exit) and the time its summary
    gives (from the first request, the command's start-up and listing aside)."""
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout}")
    found = _SUMMARY_SECONDS.search(done.stdout + done.stderr)
    return wall, float(found.group(1)) if found else wall


def _killed_at_half(argv: list[str], journal: Path) -> int:
    """Run the job until half its files are done, then SIGKILL it; the files it had done."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    done = 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                done = len((journal / "done").read_bytes().splitlines())
            except FileNotFoundError:
                done = 0
            if done >= FILES // 2:
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    return done


def _one_model(
    server: Target,
    exe: Path,
    model: str,
    features: int,
    rows: int,
    concurrency: int,
    settings: Settings,
    tmp: Path,
    log: Log,
) -> dict[str, Any]:
    data = tmp / f"{model}-in"
    paths = sorted(data.glob("*.csv")) if data.is_dir() else write_inputs(data, rows, features)
    body, body_rows = first_payload(paths[0])
    body_file = tmp / f"{model}-payload.csv"
    body_file.write_bytes(body)
    cpu.wait_quiet(settings.quiet_wait_s)
    # Loads the model: one file in small payloads, so that each instance of a cluster gets some.
    warm = _command(exe, server, model, paths[0], tmp / f"{model}-warm", concurrency)
    _job([*warm, "--max-payload-mb", "0.01"])
    shutil.rmtree(tmp / f"{model}-warm")
    runs = []
    for r in range(settings.runs):
        out = tmp / f"{model}-out-{r}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, inside = _job(_command(exe, server, model, data, out, concurrency))
        # As long as the job ran (at least --duration): as many payloads as the job sent.
        load = wrk.Load(
            url=server.url, pattern="single", model=model,
            duration_s=max(settings.duration_s, inside),
            connections=concurrency, threads=1, body_file=str(body_file),
            content_type="text/csv", timeout_s=60, seed=r + 1,
        )  # fmt: skip
        result = wrk.run(load, server.pid, settings.quiet_wait_s)
        log(describe_run(model, load, result))
        run = {
            "job_s": seconds,
            "job_rows_per_s": rows / seconds,
            "job_inside_s": inside,
            "job_inside_rows_per_s": rows / inside,
            "wrk_rows_per_s": result.rps * body_rows,
            "wrk_errors": result.error_count,
        }
        log(f"  transform {model}: {rows:,} rows in {seconds:.1f} s = {rows / seconds:,.0f} rows/s"
            f" ({rows / inside:,.0f} rows/s past start-up); wrk {run['wrk_rows_per_s']:,.0f} rows/s"
            f" ({body_rows:,} rows a request)")  # fmt: skip
        shutil.rmtree(out)
        runs.append(run)
    # Killed at half its files, then run again.
    out = tmp / f"{model}-resumed"
    shutil.rmtree(out, ignore_errors=True)
    argv = _command(exe, server, model, data, out, concurrency)
    done = _killed_at_half(argv, out / ".mmserver-transform")
    rerun = _job(argv)[0]
    log(f"  transform {model}: killed after {done} of {FILES} files; the rerun took {rerun:.1f} s")
    return {"rows": rows, "payload_rows": body_rows, "runs": runs, "killed_after": done,
            "rerun_s": rerun}  # fmt: skip


def run(
    model_store: Path,
    tmp: Path,
    out: Path,
    server_args: list[str],
    server_exe: Path | None,
    settings: Settings,
    rows: int,
    concurrency: int,
    log: Log,
) -> dict[str, Any]:
    """The section's figures, per model."""
    ensure(model_store)
    compile_package(log)
    exe = server_exe or Path(sys.executable).with_name("mmserver")
    concurrency = concurrency or (os.cpu_count() or 1)
    server = servers.mmserver(
        model_store, tmp / "cache", out / "transform-server.log", server_args, server_exe
    )
    results: dict[str, Any] = {"concurrency": concurrency}
    with server:
        log(f"mmserver pid {server.pid} on {server.url} (transform section)")
        one = Target("one server", server.url, server.pid)
        for model, features in (("sklearn-0", 1), (FOREST, FOREST_FEATURES)):
            results[model] = _one_model(
                one, exe, model, features, rows, concurrency, settings, tmp, log
            )
    if not shutil.which("haproxy"):
        log("haproxy is not installed: no cluster run of the transform section")
        return results
    with cluster(exe, model_store, tmp / "cluster", log) as balancer:
        # The linear model only: the forest's run on one server tells its cost already.
        results[f"sklearn-0, {balancer.name}"] = _one_model(
            balancer, exe, "sklearn-0", 1, rows, concurrency, settings, tmp, log
        )
    return results


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def summary_lines(section: dict[str, Any]) -> list[str]:
    """The section's lines of the table, with the targets."""
    lines = ["", f"transform ({FILES} CSV files, {section['concurrency']} requests in flight)"]
    for model, figures in section.items():
        if not isinstance(figures, dict):
            continue
        job = _median([r["job_rows_per_s"] for r in figures["runs"]])
        inside = _median([r["job_inside_rows_per_s"] for r in figures["runs"]])
        tool = _median([r["wrk_rows_per_s"] for r in figures["runs"]])
        full = _median([r["job_s"] for r in figures["runs"]])
        ratio = job / tool if tool else 0.0
        rerun = figures["rerun_s"] / full if full else 0.0
        lines.append(
            f"  {model:<24} {figures['rows']:>10,} rows  job {job:>10,.0f} rows/s "
            f"({inside:,.0f} past start-up)  wrk {tool:>10,.0f} rows/s  ratio {ratio:.2f}  "
            f"rerun after a kill at {figures['killed_after']}/{FILES} files "
            f"{rerun:.2f} x a full run"
        )
        lines.append(f"  {'PASS' if ratio >= 0.8 else 'MISS'}  {model}: job >= 0.8 x wrk")
    return lines
