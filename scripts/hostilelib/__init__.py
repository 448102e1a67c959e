"""Hostile clients replayed against a running server (``scripts/hostile``).

Each module of this package holds cases in ``CASES``: a name and a :class:`Case`, whose ``run``
takes the parsed arguments and returns a :class:`Verdict`: whether the server held, and what it
did, in a line. Every case is bounded in connections (``--connections``) and seconds
(``--seconds``), talks only to ``--url``, and checks afterwards that the server still answers
``/ping``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    held: bool
    what: str


@dataclass(frozen=True)
class Case:
    description: str
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, Verdict]]
