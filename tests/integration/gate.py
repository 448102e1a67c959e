"""A gate that test models wait at, so a test can hold a prediction running.

The in-process backend (``backend_processes=0``) runs model code in threads of the test process,
so a model's ``model.py`` can import this module and wait at :data:`current`. Each test gets a
fresh gate (the ``gate`` fixture), opened at teardown so no thread stays blocked.
"""

from __future__ import annotations

import threading


class Gate:
    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.passed = 0
        self._open = threading.Event()

    def pass_through(self) -> None:
        """Called by a model for each batch: announce it, then wait until the gate opens."""
        self.entered.release()
        if not self._open.wait(30):
            raise TimeoutError("the test never opened the gate")
        self.passed += 1

    def wait_entered(self, timeout: float = 10.0) -> bool:
        return self.entered.acquire(timeout=timeout)

    def open(self) -> None:
        self._open.set()


current = Gate()


def reset() -> Gate:
    global current
    current.open()
    current = Gate()
    return current
