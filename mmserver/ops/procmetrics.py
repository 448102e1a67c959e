"""``process_*`` series of the server's own processes, by role: the frontend and each backend
process, read with psutil at each scrape.

Prometheus' usual process families (``process_resident_memory_bytes``,
``process_cpu_seconds_total``, ``process_open_fds``) with two labels: ``role`` (``frontend``,
``backend``) and ``process`` (``frontend``, ``backend light 0``, ``backend heavy 2``: the name
``ps`` shows after ``mmserver:``). A backend process replaced after a crash keeps its name; its
CPU counter starts again from zero, which Prometheus' ``rate`` takes as a counter reset.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import psutil
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: A process to report: its role, its name and its pid.
Member = tuple[str, str, int]

_FAMILIES = (
    ("process_resident_memory_bytes", "gauge", "Resident memory of the process in bytes."),
    ("process_cpu_seconds_total", "counter", "User and system CPU time of the process in seconds."),
    ("process_open_fds", "gauge", "Open file descriptors of the process."),
)


class ProcessMetrics(Collector):
    """The processes to report (the frontend always; the backends as the server sets them) and
    their figures, read when a scrape asks."""

    def __init__(self) -> None:
        self._members: Sequence[Member] = (("frontend", "frontend", os.getpid()),)
        self._processes: dict[int, psutil.Process] = {}

    def set_backends(self, backends: Sequence[tuple[str, int]]) -> None:
        """The backend processes that run now, each ``(name, pid)`` (from the event loop)."""
        self._members = (self._members[0], *(("backend", n, p) for n, p in backends))

    def sample(self) -> list[tuple[str, str, tuple[float, float, float]]]:
        """``(role, name, resident bytes, CPU seconds, open files)`` of each process that runs;
        one that has just ended is left out."""
        rows = []
        members = self._members
        alive = {pid for _, _, pid in members}
        for pid in [p for p in self._processes if p not in alive]:
            del self._processes[pid]
        for role, name, pid in members:
            process = self._processes.get(pid)
            try:
                if process is None:
                    process = self._processes[pid] = psutil.Process(pid)
                with process.oneshot():
                    rss = process.memory_info().rss
                    times = process.cpu_times()
                    fds = process.num_fds()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._processes.pop(pid, None)
                continue
            rows.append((role, name, (float(rss), times.user + times.system, float(fds))))
        return rows

    def render(self, out: list[str]) -> None:
        """The families in the text format, appended to ``out``."""
        rows = self.sample()
        for column, (name, kind, help_text) in enumerate(_FAMILIES):
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            out.extend(
                f'{name}{{role="{role}",process="{process}"}} {values[column]!r}\n'
                for role, process, values in rows
            )

    def collect(self) -> Iterator[Metric]:
        rows = self.sample()
        for column, (name, kind, help_text) in enumerate(_FAMILIES):
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(
                    name.removesuffix("_total"), help_text, labels=("role", "process")
                )
            else:
                family = GaugeMetricFamily(name, help_text, labels=("role", "process"))
            for role, process, values in rows:
                family.add_metric([role, process], values[column])
            yield family
