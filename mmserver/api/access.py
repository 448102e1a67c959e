"""Who may change the server's models, whatever the transport: the management token, checked
on an HTTP header or gRPC's ``authorization`` metadata, and the refusal at start of a
configuration that would expose the management calls."""

from __future__ import annotations

import hmac

from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError, Unauthorized


def management_open(config: ServerConfig) -> bool:
    """Whether state-changing management calls are allowed without a token."""
    if config.management_token:
        return False
    return config.is_loopback or config.insecure_management


def check_security(config: ServerConfig) -> None:
    """Refuse (:class:`ConfigError`) a configuration that would expose the management API on a
    non-loopback address with no token, unless ``insecure_management`` says so."""
    if not config.is_loopback and not config.management_token and not config.insecure_management:
        raise ConfigError(
            f"refusing to serve on {config.host}: a non-loopback address needs a management "
            "token (--management-token or MMSERVER_MANAGEMENT_TOKEN) for POST, PUT and DELETE "
            "on /models and the /v2/repository load and unload calls; pass "
            "--insecure-management to serve it without one"
        )


def check_authorization(config: ServerConfig, authorization: str | None) -> None:
    """Raise :class:`Unauthorized` unless a management call with this ``Authorization`` value
    (an HTTP header, gRPC's ``authorization`` metadata; ``None``: none) may change the
    server's models."""
    if management_open(config):
        return
    token = config.management_token
    if not token:
        raise Unauthorized(
            "management calls on a non-loopback address need a management token, and the "
            "server has none configured"
        )
    scheme, _, credentials = (authorization or "").partition(" ")
    # Header bytes that are not UTF-8 arrive as surrogates: they compare as their bytes.
    offered = credentials.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(offered, token.encode()):
        raise Unauthorized(
            "this management call needs the header 'Authorization: Bearer <management token>'"
        )
