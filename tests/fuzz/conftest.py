"""Property-based tests (hypothesis) of everything that parses outside input: request bodies,
``serving.properties``, model names, and the inference paths over HTTP.

Each property says: any input yields a result or one of the documented errors, never an
unhandled exception and never a 500. No example database is kept (nothing is written into the
repository); a failure prints the seed and the blob that reproduce it.

The HTTP-level tests use the fixtures of :mod:`tests.integration.harness`.
"""

from tests.integration.harness import serve, server, store_root

__all__ = ["serve", "server", "store_root"]
