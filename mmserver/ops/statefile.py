"""A file of the server's state folder written whole: a reader (the next start, an operator)
sees the old file or the new one, never a part (the rollouts of :mod:`mmserver.lifecycle.versions`,
the warm set of :mod:`mmserver.lifecycle.warmfile`). Blocking: called in a thread."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made if needed): a temporary file beside it,
    synced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
