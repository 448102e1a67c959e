"""What a person watching a job sees: a progress bar on a terminal (records, MB, files, rate,
time left), plain progress lines otherwise, and a summary at the end.

:class:`Tally` holds the counts; :func:`line` and :func:`summary` render them (pure, the clock
passed in); :class:`Display` writes them while the job runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TextIO

from mmserver.commands.transform.options import MIB

#: Seconds between two redraws of the bar, and between two plain lines.
BAR_EVERY_S = 0.2
LINE_EVERY_S = 10.0
BAR_WIDTH = 24


@dataclass
class Tally:
    """A job's counts; ``total_bytes`` is the listed inputs' size (0: unknown)."""

    started: float
    total_files: int
    total_bytes: int
    files_done: int = 0
    files_failed: int = 0
    files_resumed: int = 0
    records: int = 0
    records_resumed: int = 0
    bytes_done: int = 0
    records_failed: int = 0

    def rate(self, now: float) -> float:
        """Records a second this run sent (resumed ones aside)."""
        elapsed = max(now - self.started, 1e-9)
        return (self.records - self.records_resumed) / elapsed


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    minutes, whole = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{whole:02d}" if hours else f"{minutes}:{whole:02d}"


def line(tally: Tally, now: float, bar: bool) -> str:
    """One progress line (with a bar when ``bar``)."""
    files = tally.files_done + tally.files_failed
    share = tally.bytes_done / tally.total_bytes if tally.total_bytes else files / tally.total_files
    share = min(max(share, 0.0), 1.0)
    elapsed = now - tally.started
    fresh = share - _resumed_share(tally)
    left = elapsed * (1.0 - share) / fresh if fresh > 0 and elapsed > 0 else None
    parts = [
        f"{share:4.0%}",
        f"{tally.records:,} records",
        f"{tally.bytes_done / MIB:,.1f}/{tally.total_bytes / MIB:,.1f} MB"
        if tally.total_bytes
        else f"{tally.bytes_done / MIB:,.1f} MB",
        f"{files}/{tally.total_files} files"
        + (f" ({tally.files_failed} failed)" if tally.files_failed else ""),
        f"{tally.rate(now):,.0f} records/s",
        f"{_duration(left)} left" if left is not None else "-:-- left",
    ]
    text = "  ".join(parts)
    if bar:
        filled = int(share * BAR_WIDTH)
        return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "] " + text
    return text


def _resumed_share(tally: Tally) -> float:
    if not tally.total_bytes:
        return tally.files_resumed / tally.total_files
    return (
        0.0
        if not tally.records
        else (tally.records_resumed / tally.records) * (tally.bytes_done / tally.total_bytes)
    )


def summary(tally: Tally, now: float) -> str:
    """The job's summary, printed at its end."""
    elapsed = now - tally.started
    written = tally.files_done
    text = (
        f"{written} of {tally.total_files} files written, {tally.files_failed} failed; "
        f"{tally.records:,} records ({tally.records_failed:,} in failed files) in "
        f"{_duration(elapsed)} ({elapsed:.1f} s), {tally.rate(now):,.0f} records/s"
    )
    if tally.files_resumed or tally.records_resumed:
        text += (
            f"; continued an earlier run: {tally.files_resumed} files and "
            f"{tally.records_resumed:,} records were already done"
        )
    return text


class Display:
    """Writes progress to ``stream`` every so often while :meth:`run` runs (a task the job
    owns and cancels), as a bar redrawn in place or as plain lines; nothing for ``none``."""

    def __init__(self, tally: Tally, stream: TextIO, mode: str) -> None:
        if mode == "auto":
            mode = "bar" if stream.isatty() else "lines"
        self.tally = tally
        self.stream = stream
        self.mode = mode

    async def run(self) -> None:
        if self.mode == "none":
            return
        loop = asyncio.get_running_loop()
        every = BAR_EVERY_S if self.mode == "bar" else LINE_EVERY_S
        while True:  # until the job cancels it
            await asyncio.sleep(every)
            self.show(loop.time())

    def show(self, now: float) -> None:
        if self.mode == "bar":
            self.stream.write("\r" + line(self.tally, now, bar=True) + "\x1b[K")
        elif self.mode == "lines":
            self.stream.write(line(self.tally, now, bar=False) + "\n")
        self.stream.flush()

    def finish(self, now: float) -> None:
        """The last progress and the summary."""
        if self.mode != "none":
            self.show(now)
            if self.mode == "bar":
                self.stream.write("\n")
        self.stream.write(summary(self.tally, now) + "\n")
        self.stream.flush()
