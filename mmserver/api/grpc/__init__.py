"""The Open Inference Protocol over gRPC (grpc.aio on the server's loop), on its own port:
:mod:`~mmserver.api.grpc.service` (the service, through the data plane) and
:mod:`~mmserver.api.grpc.tensors` (tensors to and from protobuf). It imports nothing of aiohttp."""
