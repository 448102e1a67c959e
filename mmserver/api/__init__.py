"""The HTTP layer: thin aiohttp handlers over the WorkLoadManager (DESIGN §8).

- :mod:`mmserver.api.inference` — ``/ping`` and the four inference paths (DJL and SageMaker);
- :mod:`mmserver.api.management` — ``/models`` (list, describe, register, rescale, unload) and
  ``/metrics``;
- :mod:`mmserver.api.v2` — the Open Inference Protocol (KServe V2 REST) under ``/v2``: health,
  metadata, inference and the model repository extension;
- :mod:`mmserver.api.middleware` — the one place where errors become HTTP responses, and the
  management token check;
- :mod:`mmserver.api.grpc.service` — the Open Inference Protocol over gRPC, on its own port
  (``grpc_port``), through the same data plane (:mod:`mmserver.api.dataplane`).

Handlers find their collaborators in :data:`STATE` on the application; there are no module-level
singletons.
"""
