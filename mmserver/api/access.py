"""Who may change the server's models, whatever the transport: the management token, checked
on an HTTP header or gRPC's ``authorization`` metadata, and the refusal at start of a
configuration that would expose the management calls; on a server with tenants, who may see
which models (:func:`viewer`, :func:`check_visible`) and ``/metrics`` (:func:`check_metrics`)."""

from __future__ import annotations

from mmserver.config.server import ServerConfig
from mmserver.errors import ConfigError, Unauthorized
from mmserver.tenancy.gate import (
    OPERATOR,
    AccessDenied,
    NotAuthenticated,
    TenantGate,
    bearer_token,
    same_token,
)
from mmserver.tenancy.tenants import Tenant


def management_open(config: ServerConfig) -> bool:
    """Whether state-changing management calls are allowed without a token: on a loopback
    address, unless the server has tenants (they call on the same port, and one must not
    unload or rescale another's model), or with ``insecure_management``."""
    if config.management_token:
        return False
    return (config.is_loopback and not config.tenants.strip()) or config.insecure_management


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
            "management calls on a non-loopback address, or on a server with tenants, need a "
            "management token, and the server has none configured"
        )
    if not same_token(bearer_token(authorization), token):
        raise Unauthorized(
            "this management call needs the header 'Authorization: Bearer <management token>'"
        )


def viewer(gate: TenantGate | None, authorization: str | None) -> Tenant | None:
    """Who asks for a listing or a model's metadata: ``None`` on a server without tenants
    (everyone sees every model), otherwise the tenant of the bearer token or the operator
    (:data:`~mmserver.tenancy.gate.OPERATOR`); :class:`NotAuthenticated` for anyone else."""
    if gate is None:
        return None
    caller = gate.bearer(authorization)
    if caller is None:
        raise NotAuthenticated(
            "this server serves tenants: send 'Authorization: Bearer <your token>' to see its "
            "models"
        )
    return caller


def check_visible(gate: TenantGate | None, caller: Tenant | None, name: str) -> None:
    """Raise :class:`AccessDenied` unless ``caller`` (:func:`viewer`) may see model ``name``."""
    if gate is not None and caller is not None and not gate.may_see(caller, name):
        raise AccessDenied(f"tenant {caller.name} may not see model {name.partition('/')[0]}")


def shows_paths(caller: Tenant | None) -> bool:
    """Whether ``caller`` is shown a model's location on the server's disk (``modelUrl``): on
    a server without tenants everyone is, with tenants only the operator."""
    return caller is None or caller is OPERATOR


def check_metrics(config: ServerConfig, gate: TenantGate | None, authorization: str | None) -> None:
    """``/metrics`` of a server with tenants takes the management token or ``metrics_token``
    (it names every tenant's models); without tenants it is open."""
    if gate is None:
        return
    offered = bearer_token(authorization)
    if same_token(offered, config.management_token) or same_token(offered, config.metrics_token):
        return
    raise NotAuthenticated(
        "/metrics of a server with tenants needs 'Authorization: Bearer <management token or "
        "metrics_token>'"
    )
