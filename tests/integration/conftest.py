"""Fixtures of the HTTP-level tests: a server over a real WorkLoadManager on a loopback port
(defined in :mod:`tests.integration.harness`)."""

from tests.integration.harness import gate, serve, server, store_names, store_root
from tests.integration.test_grpc import grpc_serve

__all__ = ["gate", "grpc_serve", "serve", "server", "store_names", "store_root"]
