"""The two ways a transform goes wrong::

TransformError          the job cannot go on (bad options, no input, unknown model,
│                       server unreachable); the command exits 2 with the message
└── FileFailed          one input file cannot be transformed (an unreadable record, a
                        record over the payload limit, a refused request); it gets a
                        ``.error`` beside its output, and the job goes on unless
                        ``--on-error fail``
"""

from __future__ import annotations


class TransformError(Exception):
    """The job cannot go on; ``message`` says what failed and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FileFailed(TransformError):
    """One input file cannot be transformed."""
