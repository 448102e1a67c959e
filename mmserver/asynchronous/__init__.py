"""Asynchronous inference (SageMaker's ``InvokeEndpointAsync``): requests journaled before they
are accepted, run through the WorkLoadManager where real-time traffic leaves room, answered into
an output location (DESIGN §17).

- :mod:`mmserver.asynchronous.journal` — the durable queue: SQLite in WAL mode in ``state_dir``;
- :mod:`mmserver.asynchronous.locations` — inputs read from, and answers written to, ``s3://``
  objects and local files;
- :mod:`mmserver.asynchronous.requests` — what a call asks for, and the checks of its headers;
- :mod:`mmserver.asynchronous.writer` — the journal's thread: local file work and group commit;
- :mod:`mmserver.asynchronous.admission` — real time first: when asynchronous work may run;
- :mod:`mmserver.asynchronous.computing` — an answer computed through the WorkLoadManager;
- :mod:`mmserver.asynchronous.pieces` — large line-based inputs in pieces, answers joined;
- :mod:`mmserver.asynchronous.notify` — the webhook notification of ended requests;
- :mod:`mmserver.asynchronous.runner` — a request's life: :class:`AsyncInference` composes its
  stages, one module each, in the order a request goes through them, and starts and stops them:

  - :mod:`mmserver.asynchronous.accepting` — a call checked and journaled before its 202;
  - :mod:`mmserver.asynchronous.dispatching` — the queue, and when a queued request starts;
  - :mod:`mmserver.asynchronous.running` — a started request run through the WorkLoadManager;
  - :mod:`mmserver.asynchronous.settling` — its answer or failure written, its row ended, the
    notification sent.
"""

from mmserver.asynchronous.journal import Invocation, State
from mmserver.asynchronous.requests import AsyncRequest
from mmserver.asynchronous.runner import AsyncInference

__all__ = ["AsyncInference", "AsyncRequest", "Invocation", "State"]
