"""A progress bar on a terminal, plain lines otherwise (a log, a pipe, CI)."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

WIDTH = 24


class Progress:
    """``total`` steps; :meth:`step` after each, with what it did. Time left is estimated from
    the steps so far, and never past ``deadline`` (``time.monotonic()``)."""

    def __init__(self, total: int, deadline: float, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.deadline = deadline
        self.stream = stream or sys.stderr
        self.count = 0
        self.started = time.monotonic()
        self.tty = self.stream.isatty()

    def step(self, text: str) -> None:
        self.count = min(self.total, self.count + 1)
        now = time.monotonic()
        per_step = (now - self.started) / self.count
        left = min(per_step * (self.total - self.count), max(0.0, self.deadline - now))
        clock = f"{int(left) // 60}:{int(left) % 60:02d} left"
        if not self.tty:
            print(f"[{self.count}/{self.total}] {text}", file=self.stream, flush=True)
            return
        filled = WIDTH * self.count // self.total
        bar = "#" * filled + "." * (WIDTH - filled)
        line = f"[{bar}] {self.count}/{self.total} {clock}  {text}"
        columns = shutil.get_terminal_size((100, 20)).columns
        self.stream.write("\r\x1b[K" + line[: columns - 1])
        self.stream.flush()

    def finish(self) -> None:
        """End the bar's line (a terminal's next output starts on a line of its own)."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
