"""Models with controllable behaviour, for the WorkLoadManager tests: each is a real model
folder with a ``model.py`` handler, usable in threads and in backend processes alike.

- :func:`make_gated_dir` — answers ``2 * x`` per row, but only once its gate file exists, so a
  test holds a batch "running" for as long as it likes and releases it by creating the file;
- :func:`make_recording_dir` — answers ``2 * x`` and appends each batch's row count to a log;
- :func:`make_gated_recording_dir` — waits for its gate file (at most 120 s), then appends each
  row's value to a log and answers ``2 * x``: the log says which rows were computed, how often;
- :func:`make_raising_dir` — raises ``ValueError`` for any row whose value is negative;
- :func:`make_sleeping_dir` — answers ``2 * x`` after sleeping a fixed time per batch;
- :func:`make_exiting_dir` — ends its backend process with ``os._exit`` on a negative value;
- :func:`make_spinning_dir` — computes for as many CPU milliseconds as the batch's first value
  says, waits at an optional gate file, appends its name to an optional log, answers ``2 * x``;
- :func:`make_row_spinning_dir` — computes for ``row_ms`` CPU milliseconds per row of its batch
  (one row is cheap, a thousand are not), answers ``2 * x``;
- :func:`make_slow_load_dir` — its load writes its process id to a file, then waits until its
  gate file exists, so a test holds the load in a backend process; answers ``2 * x`` (or what
  the ``predict`` it is given answers).
"""

from __future__ import annotations

from pathlib import Path

GATED = """\
import time
from pathlib import Path


def load(model_dir, properties):
    return Path(properties["gate"])


def predict(gate, batch):
    for _ in range(60000):  # at most 60 s
        if gate.exists():
            break
        time.sleep(0.001)
    return [2.0 * float(row[0]) for row in batch]
"""

RECORDING = """\
from pathlib import Path


def load(model_dir, properties):
    return Path(properties["log"])


def predict(log, batch):
    with open(log, "a") as fh:
        fh.write(f"{len(batch)}\\n")
    return [2.0 * float(row[0]) for row in batch]
"""

RAISING = """\
def load(model_dir, properties):
    return None


def predict(model, batch):
    if (batch < 0).any():
        raise ValueError("negative values are not allowed")
    return [2.0 * float(row[0]) for row in batch]
"""


def _write(folder: Path, code: str, properties: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(code)
    lines = [f"{key}={value}" for key, value in properties.items()]
    (folder / "serving.properties").write_text("\n".join(lines) + "\n")
    return folder


def make_gated_dir(folder: Path, gate: Path, **properties: object) -> Path:
    return _write(folder, GATED, {"gate": gate, **properties})


GATED_RECORDING = """\
import time
from pathlib import Path


def load(model_dir, properties):
    return Path(properties["gate"]), Path(properties["log"])


def predict(model, batch):
    gate, log = model
    for _ in range(60000):  # at most 120 s
        if gate.exists():
            break
        time.sleep(0.002)
    with open(log, "a") as fh:
        fh.write("".join(f"{float(row[0])}\\n" for row in batch))
    return [2.0 * float(row[0]) for row in batch]
"""


def make_gated_recording_dir(folder: Path, gate: Path, log: Path, **properties: object) -> Path:
    return _write(folder, GATED_RECORDING, {"gate": gate, "log": log, **properties})


def make_recording_dir(folder: Path, log: Path, **properties: object) -> Path:
    return _write(folder, RECORDING, {"log": log, **properties})


def make_raising_dir(folder: Path, **properties: object) -> Path:
    return _write(folder, RAISING, dict(properties))


SLEEPING = """\
import time


def load(model_dir, properties):
    return float(properties["seconds"])


def predict(seconds, batch):
    time.sleep(seconds)
    return [2.0 * float(row[0]) for row in batch]
"""


def make_sleeping_dir(folder: Path, seconds: float, **properties: object) -> Path:
    """Answers ``2 * x`` per row after sleeping ``seconds`` per batch."""
    return _write(folder, SLEEPING, {"seconds": seconds, **properties})


EXITING = """\
import os


def load(model_dir, properties):
    return None


def predict(model, batch):
    if (batch < 0).any():
        os._exit(3)  # the whole backend process goes, as on a crash in native code
    return [2.0 * float(row[0]) for row in batch]
"""


def make_exiting_dir(folder: Path, **properties: object) -> Path:
    """Answers ``2 * x``, but ends its backend process (``os._exit``) on a negative value."""
    return _write(folder, EXITING, dict(properties))


SPINNING = """\
import time
from pathlib import Path


def load(model_dir, properties):
    gate = properties.get("gate")
    log = properties.get("log")
    if log and properties.get("log_load"):
        with open(log, "a") as fh:
            fh.write("load:" + properties["name"] + "\\n")
    return (properties["name"], Path(gate) if gate else None, Path(log) if log else None)


def predict(model, batch):
    name, gate, log = model
    end = time.thread_time() + float(batch[0][0]) / 1000.0
    while time.thread_time() < end:
        pass
    for _ in range(60000):  # at most 60 s
        if gate is None or gate.exists():
            break
        time.sleep(0.001)
    if log is not None:
        with open(log, "a") as fh:
            fh.write(name + "\\n")
    return [2.0 * float(row[0]) for row in batch]
"""


def make_spinning_dir(
    folder: Path, *, gate: Path | None = None, log: Path | None = None, **properties: object
) -> Path:
    """Computes ``x`` CPU ms for a batch whose first value is ``x``, then waits for ``gate`` (if
    given) to exist, appends the model's name to ``log`` (if given), and answers ``2 * x``.
    With ``log_load=True`` its load appends ``load:<name>`` to ``log`` too."""
    extra: dict[str, object] = {"name": folder.name}
    if gate is not None:
        extra["gate"] = gate
    if log is not None:
        extra["log"] = log
    return _write(folder, SPINNING, {**extra, **properties})


ROW_SPINNING = """\
import time


def load(model_dir, properties):
    return float(properties["row_ms"]) / 1000.0


def predict(row_seconds, batch):
    end = time.thread_time() + row_seconds * len(batch)
    while time.thread_time() < end:
        pass
    return [2.0 * float(row[0]) for row in batch]
"""


def make_row_spinning_dir(folder: Path, row_ms: float, **properties: object) -> Path:
    """:data:`ROW_SPINNING`: ``row_ms`` CPU milliseconds a row."""
    return _write(folder, ROW_SPINNING, {"row_ms": row_ms, **properties})


#: A load that announces itself (writing its process id to the file ``started``) and then waits
#: (up to 30 s) until the file ``gate`` exists.
SLOW_LOAD = """\
import os
import time
from pathlib import Path


def load(model_dir, properties):
    Path(properties["started"]).write_text(str(os.getpid()))
    gate = Path(properties["gate"])
    for _ in range(30000):  # at most 30 s
        if gate.exists():
            break
        time.sleep(0.001)
    return None
"""

#: A load that computes for ``load_ms`` CPU milliseconds.
COSTLY_LOAD = """\
import time


def load(model_dir, properties):
    end = time.thread_time() + float(properties["load_ms"]) / 1000.0
    while time.thread_time() < end:
        pass
    return None
"""

DOUBLING = """
def predict(model, batch):
    return [2.0 * float(row[0]) for row in batch]
"""


def make_slow_load_dir(
    folder: Path, started: Path, gate: Path, predict: str = DOUBLING, **properties: object
) -> Path:
    """:data:`SLOW_LOAD` with ``predict`` (the source of a ``predict(model, batch)``)."""
    return _write(folder, SLOW_LOAD + predict, {"started": started, "gate": gate, **properties})


def make_costly_load_dir(folder: Path, load_ms: float, **properties: object) -> Path:
    """:data:`COSTLY_LOAD` with the doubling ``predict``."""
    return _write(folder, COSTLY_LOAD + DOUBLING, {"load_ms": load_ms, **properties})


def handler_models(store: Path) -> str:
    """The ``trusted_models`` that lets every custom handler of ``store`` run: the names of its
    folders holding Python files (a version's, its model's), comma-separated. The tests' model
    doubles are handlers; their pickles still load restricted."""
    names = []
    for entry in sorted(Path(store).iterdir()) if Path(store).is_dir() else ():
        if entry.is_dir() and (any(entry.glob("*.py")) or any(entry.glob("*/*.py"))):
            names.append(entry.name)
    return ",".join(names)


def trusting(store: Path, options: dict[str, object]) -> dict[str, object]:
    """``options`` of a server over ``store`` with its handlers trusted, in the shared backend
    processes (the tests' doubles stand for any model), unless the test says otherwise."""
    if "trusted_models" in options:
        return options
    return {**options, "trusted_models": handler_models(store), "isolate_trusted": False}
