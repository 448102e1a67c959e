"""Running the server: one process, aiohttp on uvloop, backend processes beside it.

Shutdown order (SIGTERM or SIGINT), written once in :meth:`Server.shutdown`:

1. report not ready (``/ping`` answers 503) and answer new requests 503 at once; the listener
   stays open meanwhile, because closing it resets every connection still waiting in the
   kernel's accept queue, and those clients have sent their requests;
2. drain: with a ``state_dir``, the warm set is written first, while every model is still
   loaded (:mod:`mmserver.lifecycle.warmset`); every accepted request is answered, up to
   ``drain_timeout`` seconds; what is left then is answered 503; then the workers and the
   backend processes stop. Asynchronous requests
   (:mod:`mmserver.asynchronous`) are neither accepted nor started from step 1; running ones
   end within the same drain, the others stay in the journal for the next start;
3. stop listening, and close the HTTP connections once their responses are written; the gRPC
   port (``grpc_port``) likewise: its calls were answered (503 ones ``UNAVAILABLE``) during the
   drain, and it stops once their answers are sent;
4. flush the logs (and send the traces' last spans: aiohttp's clean-up, in step 3).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

import prometheus_client
from aiohttp import web

from mmserver import errors
from mmserver.api.access import check_security
from mmserver.api.connections import HttpRunner
from mmserver.api.peers import adopt_rollouts
from mmserver.api.web import STATE
from mmserver.app import build_app
from mmserver.config.server import ServerConfig
from mmserver.lifecycle.record import ModelStatus
from mmserver.manager.wlm import WorkLoadManager
from mmserver.opening import open_store
from mmserver.ops import heap, logs
from mmserver.ops.metrics import Metrics

if TYPE_CHECKING:
    from mmserver.api.grpc.service import GrpcServer

log = logging.getLogger("mmserver")


class Server:
    """The composition root: store, metrics, WorkLoadManager and the HTTP app, on one port."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics(
            model_label=config.metrics_model_label, tenant_label=bool(config.tenants.strip())
        )
        self.store = open_store(config, in_use=self._holds_files)
        self.wlm = WorkLoadManager(config, self.store, self.metrics)
        self.app = build_app(config, self.wlm, self.metrics)
        self._runner: HttpRunner | None = None
        self.grpc: GrpcServer | None = None
        self.stopped = asyncio.Event()

    def _holds_files(self, name: str) -> bool:
        # Asked from the store's threads: status() only reads a dict and an attribute.
        return self.wlm.status(name) in _HOLDING_FILES

    def claim(self) -> None:
        """Hold the folders this server must have alone (its ``state_dir``); raises
        :class:`~mmserver.errors.ConfigError` if another process holds one."""
        runner = self.app[STATE].asynchronous
        if runner is not None:
            runner.claim()

    async def start(self) -> None:
        self.claim()  # before anything starts (nothing if :func:`_serve` did already)
        peers = self.app[STATE].peers
        if peers is not None:  # a new instance: the versions' rollouts its peers have
            await adopt_rollouts(peers, self.wlm.versions.state_file)
        await self.wlm.start()
        runner = self.app[STATE].asynchronous
        if runner is not None:
            await runner.start()  # after the WorkLoadManager: its requests go there
        self._runner = HttpRunner(
            self.app,
            handle_signals=False,
            shutdown_timeout=self.config.drain_timeout,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.port, backlog=1024, reuse_address=True
        )
        await site.start()
        tracing = self.app[STATE].tracing
        if tracing is not None:
            log.info("tracing requests with OpenTelemetry (sampler %s)", tracing.describe())
        tenants = self.app[STATE].tenants
        if tenants is not None:
            tenants.watch()
            log.info(
                "serving %d tenants from %s (read again on SIGHUP and when it changes)",
                len(tenants.tenants.by_name),
                tenants.path,
            )
        config = self.config
        if config.grpc_port:
            # Imported only here: grpcio and the messages cost a start a few tenths of a second.
            from mmserver.api.grpc.service import GrpcServer

            self.grpc = GrpcServer(self.app[STATE], config.grpc_port)
            await self.grpc.start()
            log.info(
                "mmserver serving gRPC (Open Inference Protocol) on %s:%d",
                config.host,
                self.grpc.port,
            )
        log.info(
            "mmserver listening on http://%s:%d (model store %s, %d backend process(es) from "
            "%s, memory budget %d MiB from %s, at most %d connections)",
            config.host,
            config.port,
            self.store.root,
            config.backend_processes,
            config.backend_processes_source(),
            self.wlm.room.budget.value,
            self.wlm.room.budget.source,
            self._runner.policy.max_connections,
        )

    async def shutdown(self) -> None:
        """Stop in the order of the module docstring."""
        log.info(
            "shutting down: draining accepted requests (up to %.0f s)", self.config.drain_timeout
        )
        state = self.app[STATE]
        if state.tenants is not None:
            state.tenants.stop()
        runner = state.asynchronous
        if runner is not None:
            runner.close()  # no asynchronous request accepted or started from now on
        self.wlm.begin_shutdown()
        if self._runner is not None:
            # Kept-alive connections close once idle, busy ones after their answer (which says
            # Connection: close): clients, and a balancer, take their next requests elsewhere.
            self._runner.drain()
        drain = self.config.drain_timeout
        if runner is not None:
            # Running asynchronous requests end as the pools drain; the rest stay queued.
            await asyncio.gather(runner.stop(drain), self.wlm.stop(drain))
        else:
            await self.wlm.stop(drain)
        if self.grpc is not None:
            await self.grpc.stop(_GRPC_GRACE)
        if self._runner is not None:
            await self._runner.cleanup()  # stops the site, then closes connections
            access = self.app[STATE].access_log
            if access is not None:
                access.flush()  # the last loop turn's lines
        log.info("mmserver stopped")
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.stopped.set()


#: Seconds the gRPC calls still running after the drain (answered, their answers being sent)
#: get before they are cancelled.
_GRPC_GRACE = 5.0

#: The states in which a model may still read its files (a new worker loads them again).
_HOLDING_FILES = (ModelStatus.LOADING, ModelStatus.READY, ModelStatus.UNLOADING)


async def _serve(config: ServerConfig) -> None:
    server = Server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    tenants = server.app[STATE].tenants
    if tenants is not None:
        loop.add_signal_handler(signal.SIGHUP, tenants.reload, "SIGHUP")
    server.claim()  # a folder in use ends the start here, with nothing to stop
    try:
        await server.start()
        # Loads and requests no longer stall behind full collections (mmserver.ops.heap).
        frozen = heap.tune_collector()
        log.info(
            "garbage collector: youngest generation every %d allocations, middle every %d of "
            "its collections; %d start-up objects frozen",
            heap.YOUNG_OBJECTS,
            heap.MIDDLE_COLLECTIONS,
            frozen,
        )
        await stop.wait()
    finally:
        await server.shutdown()


def run(config: ServerConfig, early: Sequence[logging.LogRecord] = ()) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code. ``early``: records logged
    while the configuration was read, written now in the log's format."""
    logs.setup(config.log_level, config.log_format)
    logs.replay(early)
    # Large freed blocks go back to the system, so churn does not raise the RSS (mmserver.ops.heap).
    heap.fix_mmap_threshold()
    # The *_created series double a scrape's size and nobody graphs them.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        check_security(config)
    except errors.ConfigError as exc:
        log.error("%s", exc.message)
        return 2
    import uvloop

    try:
        uvloop.run(_serve(config))
    except errors.ConfigError as exc:
        log.error("%s", exc.message)
        return 2
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", config.host, config.port, exc)
        return 1
    return 0
