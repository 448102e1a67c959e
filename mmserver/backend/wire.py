"""What crosses the pipe between the frontend and a backend process.

Each process is connected by one ``AF_UNIX`` stream socket (``multiprocessing.Pipe``); a message
is one frame (:mod:`mmserver.procs.framing`) holding a pickle: ``(op, ...)`` from the frontend,
``(OK, result)`` or ``(ERR, error class name, message, the model the message names or None)``
back. A batch travels as its requests' bodies, undecoded, and comes back as one encoded answer
per request. ``(MANY, [message, ...])`` holds the messages the frontend wrote in one turn of its
event loop, in order; the process answers each with a reply of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserver.backend.batching import Answer
from mmserver.config.model import ModelConfig
from mmserver.ops.traces import BackendTimes

LOAD, PREDICT, UNLOAD, PING = 0, 1, 2, 3
OK, ERR = 0, 1
MANY = 9


@dataclass(frozen=True)
class LoadSpec:
    """What a slot needs to load (and, after a restart, reload) one model."""

    key: str
    model_dir: Path
    config: ModelConfig


@dataclass(frozen=True)
class LoadInfo:
    """What loading a model in a slot reported: the memory one copy of it takes there (0 when
    it was loaded already), the CPU seconds of one prediction of a probe row (``None`` when
    the model could not be probed: a custom handler, or a model that does not say its width),
    and the model's :func:`~mmserver.execution.predictor.signature` (``None`` when loaded
    already)."""

    memory_bytes: int
    probe_seconds: float | None = None
    #: The default handler's family and predict paths (``EstimatorPredictor.describe``),
    #: pickled: the frontend keeps them for the describe call and reads them only then, so a
    #: loaded model holds one object for them, not a dozen.
    paths: bytes | None = None
    signature: dict[str, Any] | None = None
    #: The seconds the load held the process (wall time; 0 when loaded already).
    seconds: float = 0.0
    #: The warnings raised while the model loaded (a pickle of another scikit-learn version,
    #: say), each ``Category: message`` once.
    warnings: tuple[str, ...] = ()


#: A batch's answers (one per request), the CPU and wall seconds they took (the wall time less
#: what the batch spent waiting for a CPU; both the wall time when the CPU clock was not read:
#: :data:`~mmserver.policy.scheduling.CPU_CLOCK_ABOVE_S`), the rows predicted, the predict
#: path they took (``own`` for a custom handler), and the batch's times in the process (its pid,
#: when it began, when the model's last call ended, when the answers were encoded), which the
#: frontend turns into spans for a sampled request's trace.
BatchResult = tuple[list[Answer], float, float, int, str, BackendTimes]
