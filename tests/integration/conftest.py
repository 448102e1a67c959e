"""Fixtures of the HTTP-level tests: a server over a real WorkLoadManager on a loopback port
(defined in :mod:`tests.integration.harness`)."""

from tests.integration.harness import gate, serve, server, store_names, store_root

__all__ = ["gate", "serve", "server", "store_names", "store_root"]
