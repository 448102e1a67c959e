"""The settings a recommendation tries and writes: one model's ``batch_size``,
``max_batch_delay`` and ``maxWorkers``, as the management API sets them and as
``serving.properties`` lines; and the lane, a server-wide option (:data:`LANES`).

The trials set ``minWorkers`` equal to ``maxWorkers`` so that every run measures the workers the
setting allows, not the scaling rule's ramp up to them; the written lines leave ``minWorkers``
as the model's folder has it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmserver.config.model import PROPERTIES_FILE, ModelConfig
from mmserver.store.properties import parse_properties

#: Every spelling of the keys :meth:`Setting.properties` writes (``ModelConfig``'s ``keys``), so
#: that the lines written replace the folder's own, whichever spelling it used.
_FIELDS = ("batch_size", "max_batch_delay", "max_workers")
WRITTEN_KEYS: frozenset[str] = frozenset(
    key
    for name, field in ModelConfig.__dataclass_fields__.items()
    if name in _FIELDS
    for key in field.metadata["keys"]
)


#: The lanes a recommendation can try, and the server options of each: ``auto`` is the server's
#: default (a model whose requests cost more than ``heavy_batch_ms`` moves to the heavy lane, at
#: a lower CPU priority); ``one`` serves every model in one lane (``--heavy-processes 0``).
LANES: dict[str, tuple[str, ...]] = {"auto": (), "one": ("--heavy-processes", "0")}


@dataclass(frozen=True, order=True)
class Setting:
    """One point of the grid."""

    batch_size: int
    max_batch_delay: int  # ms
    max_workers: int
    lane: str = "auto"  # a key of LANES

    @property
    def label(self) -> str:
        label = (
            f"batch {self.batch_size}, delay {self.max_batch_delay} ms, workers {self.max_workers}"
        )
        return label + (", one lane" if self.lane == "one" else "")

    @property
    def server_args(self) -> tuple[str, ...]:
        """The options of ``mmserver serve`` its lane needs."""
        return LANES[self.lane]

    def query(self) -> dict[str, str]:
        """The parameters of ``PUT /models/{model}`` that apply it."""
        return {
            "batch_size": str(self.batch_size),
            "max_batch_delay": str(self.max_batch_delay),
            "min_worker": str(self.max_workers),
            "max_worker": str(self.max_workers),
        }

    def properties(self) -> list[str]:
        """Its ``serving.properties`` lines."""
        return [
            f"batch_size={self.batch_size}",
            f"max_batch_delay={self.max_batch_delay}",
            f"maxWorkers={self.max_workers}",
        ]

    def to_json(self) -> dict[str, int | str]:
        return {
            "batch_size": self.batch_size,
            "max_batch_delay": self.max_batch_delay,
            "max_workers": self.max_workers,
            "lane": self.lane,
        }


def grid(
    batch_sizes: Sequence[int],
    delays: Sequence[int],
    workers: Sequence[int],
    lanes: Sequence[str] = ("auto",),
) -> list[Setting]:
    """Every combination, except a delay with ``batch_size=1`` (a batch of one never waits);
    the lanes in the order of :data:`LANES` (each lane is a server of its own)."""
    settings = {
        Setting(b, d if b > 1 else 0, w, lane)
        for b, d, w, lane in itertools.product(batch_sizes, delays, workers, lanes)
    }
    return sorted(settings, key=lambda s: (list(LANES).index(s.lane), s))


def write_properties(folder: Path, setting: Setting) -> Path:
    """Write ``setting``'s lines into ``folder/serving.properties``: its other lines are kept,
    lines of the same keys (in any spelling) are replaced. Returns the file."""
    path = folder / PROPERTIES_FILE
    kept: list[str] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            keys = parse_properties(line) if line.strip() else {}
            if not WRITTEN_KEYS.intersection(keys):
                kept.append(line)
    lines = [*kept, "# Written by mmserver recommend:", *setting.properties()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
