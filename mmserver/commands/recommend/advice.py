"""The recommendation from the search's results: the setting to use, what one instance serves at
the target p99, and the instances a target throughput needs (here, and estimated for machines of
other CPU counts); as text and as JSON."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from mmserver.commands.recommend.search import SettingResult

#: Settings within this share of the best throughput count as equal; the cheaper one wins.
TIE = 0.05
#: The CPU counts of the estimate for other machines.
OTHER_CPUS = (2, 4, 8, 16, 32, 64)
#: Other programs' median CPU use during the runs (% of one core) above which the figures are
#: said to be disturbed (as scripts/bench says it).
DISTURBED_PERCENT = 25.0


@dataclass(frozen=True)
class Advice:
    model: str
    p99_ms: float
    target_rps: float | None
    cpus: int
    generator: str
    results: list[SettingResult]

    @property
    def chosen(self) -> SettingResult | None:
        """The highest throughput at the target; among those within :data:`TIE` of it, the
        least CPU a request, then the fewest workers."""
        met = [r for r in self.results if r.best is not None]
        if not met:
            return None
        top = max(r.best.rps for r in met if r.best)
        close = [r for r in met if r.best and r.best.rps >= (1 - TIE) * top]
        return min(
            close,
            key=lambda r: (
                r.best.cpu_ms_per_request if r.best and r.best.cpu_ms_per_request else math.inf,
                r.setting.max_workers,
                -r.best.rps if r.best else 0.0,
            ),
        )

    @property
    def other_cpu_percent(self) -> float:
        """Other programs' median CPU use over every run, in % of one core."""
        return statistics.median(
            [run.other_cpu_percent for r in self.results for run in r.runs] or [0.0]
        )

    def instances(self, rps: float) -> int | None:
        """Instances like this machine for ``target_rps``."""
        if not self.target_rps or rps <= 0:
            return None
        return math.ceil(self.target_rps / rps)

    def by_cpus(self, rps: float) -> dict[int, int]:
        """Instances for ``target_rps`` on machines of each CPU count, taking one instance's
        throughput to grow in proportion to its CPUs (an estimate)."""
        if not self.target_rps or rps <= 0:
            return {}
        return {n: math.ceil(self.target_rps / (rps * n / self.cpus)) for n in OTHER_CPUS}

    def to_json(self) -> dict[str, Any]:
        chosen = self.chosen
        out: dict[str, Any] = {
            "model": self.model,
            "p99_target_ms": self.p99_ms,
            "target_rps": self.target_rps,
            "cpus": self.cpus,
            "load_generator": self.generator,
            "other_cpu_percent": self.other_cpu_percent,
            "settings": [r.to_json() for r in self.results],
            "recommendation": None,
        }
        if chosen is not None and chosen.best is not None:
            best = chosen.best
            cpu_ms = best.cpu_ms_per_request
            out["recommendation"] = {
                **chosen.setting.to_json(),
                "serving_properties": chosen.setting.properties(),
                "server_options": list(chosen.setting.server_args),
                "rps_per_instance": best.rps,
                "p99_ms": best.p99_ms,
                "cpu_ms_per_request": cpu_ms,
                "memory_bytes": chosen.memory_bytes,
                "instances": self.instances(best.rps),
                "instances_by_cpus_estimate": {
                    str(k): v for k, v in self.by_cpus(best.rps).items()
                },
                "cpus_busy_at_target": self.target_rps * cpu_ms / 1e3
                if self.target_rps and cpu_ms
                else None,
            }
        return out

    def table(self) -> str:
        head = (
            f"{'setting':<48} {'req/s at p99':>12} {'p99 ms':>7} {'CPU ms/req':>10} "
            f"{'memory/copy':>11}  lane"
        )
        lines = [head]
        for r in self.results:
            best = r.best
            rps = f"{best.rps:,.0f}" if best else "none"
            p99 = f"{best.p99_ms:.1f}" if best and best.p99_ms is not None else "-"
            cpu_ms = (
                f"{best.cpu_ms_per_request:.2f}"
                if best and best.cpu_ms_per_request is not None
                else "-"
            )
            memory = _mib(r.memory_bytes)
            note = f"  ({r.note})" if r.note else ""
            lines.append(
                f"{r.setting.label:<48} {rps:>12} {p99:>7} {cpu_ms:>10} {memory:>11}  "
                f"{r.lane or '-'}{note}"
            )
        return "\n".join(lines)

    def text(self) -> str:
        """The table and the recommendation, as printed."""
        lines = [
            f"{self.model}: p99 <= {self.p99_ms:g} ms; this machine: {self.cpus} CPUs; "
            f"load from {self.generator} on this machine",
            "",
            self.table(),
            "",
        ]
        other = self.other_cpu_percent
        if other > DISTURBED_PERCENT:
            lines += [
                f"WARNING: other programs kept the machine {other:.0f} % of a core busy during "
                "the runs (median): the figures are disturbed; run again on a quiet machine.",
                "",
            ]
        chosen = self.chosen
        if chosen is None or chosen.best is None:
            lines.append(self._unmet())
            return "\n".join(lines)
        best = chosen.best
        lines.append(f"Recommended serving.properties for {self.model}:")
        lines.extend(f"  {line}" for line in chosen.setting.properties())
        if chosen.setting.server_args:
            options = " ".join(chosen.setting.server_args)
            lines.append(
                f"and a server with one lane: mmserver serve {options} "
                "(server-wide: every model then runs in the same backends at the same priority)"
            )
        p99 = f" (measured {best.p99_ms:.1f} ms)" if best.p99_ms is not None else ""
        lines.append(
            f"{best.rps:,.0f} req/s per instance at p99 <= {self.p99_ms:g} ms{p99} on this "
            f"machine ({self.cpus} CPUs)"
        )
        count = self.instances(best.rps)
        if count is not None and self.target_rps:
            lines.append(f"{self.target_rps:,.0f} req/s: {count} instances like this one")
            estimate = ", ".join(f"{n} CPUs: {k}" for n, k in self.by_cpus(best.rps).items())
            lines.append(
                "Estimate for other machines (an estimate: throughput taken to grow in "
                f"proportion to the CPUs, maxWorkers with them): {estimate}"
            )
            if best.cpu_ms_per_request:
                busy = self.target_rps * best.cpu_ms_per_request / 1e3
                lines.append(
                    f"CPU: {best.cpu_ms_per_request:.2f} ms a request, {busy:,.1f} CPUs busy at "
                    f"{self.target_rps:,.0f} req/s"
                )
        return "\n".join(lines)

    def _unmet(self) -> str:
        runs = [(run, r) for r in self.results for run in r.runs if run.p99_ms is not None]
        text = (
            f"No setting kept p99 <= {self.p99_ms:g} ms with every request answered at any load "
            "tried: nothing to recommend."
        )
        if runs:
            run, r = min(runs, key=lambda pair: pair[0].p99_ms or math.inf)
            rate = f"{run.offered_rps:,.0f} req/s offered" if run.offered_rps else "closed loop"
            text += (
                f" The lowest p99 seen was {run.p99_ms:.1f} ms ({r.setting.label}, {rate}, "
                f"{run.errors} errors)."
            )
        return text


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"
