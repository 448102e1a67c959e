"""The models of one backend slot (:class:`mmserver.backend.child.Models`): which batches it
times by the CPU clock, so that the frontend's lanes see CPU time, not a busy machine's wall
time (:mod:`mmserver.policy.scheduling`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mmserver.backend.child import Models, rss_bytes
from mmserver.backend.wire import LoadSpec
from mmserver.config.server import ModelConfig, load_model_config
from mmserver.config.trust import Trust
from mmserver.policy.scheduling import CPU_CLOCK_ABOVE_S
from tests.behaviour_models import make_sleeping_dir
from tests.models import make_linear_model

TRUSTED = ModelConfig(trust=Trust(full=True, because="trusted_models=*"))
ROW = (b"[[1.5]]", "application/json", None)


class Clock:
    """A CPU clock that advances 50 µs a reading, whatever the wall clock does."""

    def __init__(self) -> None:
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.now += 50e-6
        self.readings += 1
        return self.now


def test_an_unprobed_models_first_batch_is_timed_by_the_cpu_clock(tmp_path: Path) -> None:
    """A custom handler cannot be probed at load: its first batch's cost is what the frontend
    first knows of it, so it is CPU time, not the wall time a sleep (or a preemption) makes."""
    folder = make_sleeping_dir(tmp_path / "sleepy", 4 * CPU_CLOCK_ABOVE_S)
    clock = Clock()
    models = Models(clock=clock)
    info = models.load(LoadSpec("sleepy#1", folder, load_model_config(folder, TRUSTED)))
    assert info.probe_seconds is None
    answers, cpu, held, rows, _, _ = models.predict("sleepy#1", [ROW])
    assert json.loads(answers[0]) == {"predictions": [3.0]}
    assert rows == 1
    assert clock.readings == 2
    assert cpu < CPU_CLOCK_ABOVE_S < held


def test_a_probed_models_short_batch_reads_no_cpu_clock(tmp_path: Path) -> None:
    """A model probed at load is known: its short batches report their wall time (the clock
    costs a system call twice a batch)."""
    folder = tmp_path / "linear"
    make_linear_model(folder)
    clock = Clock()
    models = Models(clock=clock)
    info = models.load(LoadSpec("linear#1", folder, ModelConfig()))
    assert info.probe_seconds is not None
    answers, cpu, held, _, _, _ = models.predict("linear#1", [ROW])
    assert json.loads(answers[0])["predictions"] == [pytest.approx(4.0, abs=0.05)]
    assert clock.readings == 0
    assert cpu == held


def test_rss_is_read_of_the_process_that_asks_also_after_a_fork() -> None:
    """The process's resident size is read from a file opened once per process: a forked child
    (a backend from the fork server) reads its own, not the parent's it inherited."""
    page = os.sysconf("SC_PAGE_SIZE")

    def statm() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * page

    assert abs(rss_bytes() - statm()) < 64 * page  # opened here
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grows by 64 MiB, which only its own file shows
        try:
            before = rss_bytes()
            grown = bytearray(64 << 20)
            grown[::page] = b"x" * len(grown[::page])
            os.write(write, json.dumps([before, rss_bytes(), statm()]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        before, after, own = json.loads(fh.read())
    os.waitpid(pid, 0)
    assert after - before >= 60 << 20
    assert abs(after - own) < 4 << 20
