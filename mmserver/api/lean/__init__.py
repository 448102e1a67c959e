"""The lean HTTP path: plain inference requests parsed with httptools and answered from their
future's callback, without aiohttp's request machinery. :mod:`~mmserver.api.lean.connection` (the
protocol of a connection and its hand-over to aiohttp), :mod:`~mmserver.api.lean.front` (the
server's lean connections: their routes, idle sweep and drain),
:mod:`~mmserver.api.lean.answer` (an answer written in request order),
:mod:`~mmserver.api.lean.asynchronous` (SageMaker's ``InvokeEndpointAsync``) and
:mod:`~mmserver.api.lean.flow` (reading paused and resumed)."""
