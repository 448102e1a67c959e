"""The trials of a grid: a server per lane (started over the store, or the one at the URL), the
model loaded once on each, every setting of that lane searched on it.

The lane is a server-wide option, so each lane of the grid has a server of its own. A model that
ran in the light lane in every trial of the default lanes is not tried again with one lane:
there it would run in that same light lane.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmserver.commands.recommend.payloads import sample_body
from mmserver.commands.recommend.progress import Progress
from mmserver.commands.recommend.search import (
    RUN_OVERHEAD_S,
    Plan,
    SettingResult,
    runs_per_setting,
    search,
)
from mmserver.commands.recommend.settings import LANES, Setting
from mmserver.commands.recommend.target import Target

#: Seconds a run lasts at most, however long the budget.
MAX_RUN_S = 10


@dataclass(frozen=True)
class Trials:
    """What to run, where, and by when."""

    model: str
    settings: list[Setting]
    p99_ms: float
    steps: int
    deadline: float
    use_wrk: bool
    model_store: Path | None = None  # else url
    url: str = ""
    body: str | None = None  # None: made from the model's inputs
    #: More options of the server this command starts (the store's trust).
    server_args: tuple[str, ...] = ()

    def open(self, lane: str) -> Target:
        if self.model_store is not None:
            return Target.start(self.model_store, (*LANES[lane], *self.server_args))
        return Target.at(self.url)


def run(
    trials: Trials,
    progress: Progress,
    say: Callable[[str], None],
    finish: Callable[[Target, list[SettingResult]], None] | None = None,
) -> list[SettingResult]:
    """Every setting's result, in the grid's order. ``finish`` is called with the last lane's
    server and every result before that server is closed (to apply the chosen setting there)."""
    per_setting = runs_per_setting(trials.steps)
    lanes = list(dict.fromkeys(s.lane for s in trials.settings))
    results: list[SettingResult] = []
    startup_s = 0.0
    for index, lane in enumerate(lanes):
        settings = [s for s in trials.settings if s.lane == lane]
        ran = {r.lane for r in results if r.lane}
        if lane == "one" and ran == {"light"}:
            for setting in settings:
                results.append(
                    SettingResult(setting, note="skipped: it ran in the light lane, as with one")
                )
                progress.count += per_setting - 1
                progress.step(f"{setting.label}: skipped")
            continue
        if trials.model_store is not None:
            say(
                f"starting mmserver over {trials.model_store} ({lane} lane{'s' * (lane == 'auto')})"
            )
        opened = time.monotonic()
        target = trials.open(lane)
        try:
            body = trials.body
            if body is None:
                body = sample_body(target.inputs(trials.model))
            target.load(trials.model, body.encode())
            startup_s = startup_s or time.monotonic() - opened
            for setting in settings:
                # Each further lane's server takes about as long to start and load the model.
                reserve = 1.5 * startup_s * (len(lanes) - 1 - index)
                plan = _plan(trials, body, len(trials.settings) - len(results), reserve)
                before = progress.count
                results.append(search(target, setting, plan, progress.step))
                # A setting cut short counts its runs as done, so the bar reaches its end.
                progress.count = before + per_setting - 1
                progress.step(f"{setting.label}: done")
            if finish is not None and index == len(lanes) - 1:
                finish(target, results)
        finally:
            target.close()
    return results


def _plan(trials: Trials, body: str, settings_left: int, reserve_s: float) -> Plan:
    """The run length that fits the runs of ``settings_left`` settings into the time left but
    ``reserve_s`` (worked out again before each setting, so the time a setting leaves unused by
    stopping early lengthens the runs of the next)."""
    runs = settings_left * runs_per_setting(trials.steps)
    left = trials.deadline - time.monotonic() - reserve_s
    run_s = max(1, min(MAX_RUN_S, math.floor(left / runs - RUN_OVERHEAD_S)))
    return Plan(
        trials.model, body, trials.p99_ms, run_s, trials.steps, trials.deadline, trials.use_wrk
    )
