"""Asynchronous inference (SageMaker's ``InvokeEndpointAsync``): requests journaled before they
are accepted, run through the WorkLoadManager where real-time traffic leaves room, answered into
an output location (DESIGN §17).

- :mod:`mmserver.asynchronous.journal` — the durable queue: SQLite in WAL mode in ``state_dir``;
- :mod:`mmserver.asynchronous.locations` — inputs read from, and answers written to, ``s3://``
  objects and local files;
- :mod:`mmserver.asynchronous.runner` — accepting, dispatching, running and ending requests.
"""

from mmserver.asynchronous.journal import Invocation, State
from mmserver.asynchronous.runner import AsyncInference, AsyncRequest

__all__ = ["AsyncInference", "AsyncRequest", "Invocation", "State"]
