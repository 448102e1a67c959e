"""The door every inference request of a server with tenants passes: who calls
(:meth:`TenantGate.authenticate`), and whether it may call this model now
(:meth:`TenantGate.admit`).

Who calls:

- ``Authorization: Bearer <token>``: the tenant with that token, or the operator for the
  management token (every model, no limits);
- on the SageMaker paths, AWS Signature Version 4 (:mod:`mmserver.tenancy.sigv4`);
- anything else is refused: 401 with ``WWW-Authenticate: Bearer`` (DJL, V2, gRPC's
  ``UNAUTHENTICATED``), SageMaker's 403 codes on its paths.

Whether it may: the model's name matches one of the tenant's patterns (otherwise 403,
``AccessDeniedException``); the tenant's token bucket has a token (``requests_per_second``,
``burst``) and it has fewer than ``max_concurrent`` requests in flight (otherwise 429 with
``Retry-After``, ``ThrottlingException`` on the SageMaker paths, which botocore retries by its
own policy). A request holds its place until its answer is settled, however it ends.

A 429 for a tenant's limits is sent after :data:`THROTTLE_HOLD_S`, and its connection reads
nothing else meanwhile (every door: the lean path, aiohttp, gRPC, ``InvokeEndpointAsync``). A
client that retries at once, without the wait ``Retry-After`` asks for, then sends one request per
hold and connection: a flood costs the server a few answers a second, not every answer its event
loop can make, so the other tenants' requests are not slowed by it. The answer is held, rather
than sent at once with the connection's next read delayed, because a proxy in front (the chart's
HAProxy) gives an idle connection to its next client, who would wait for another's limits.

The file is read again on SIGHUP and when it changes (looked at every second); a file that is
refused keeps the tenants in force and logs every fault with its line. A tenant whose limits are
unchanged by a reload keeps its bucket and its requests in flight.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from mmserver.errors import ConfigError, Forbidden, InvalidModelName, TooManyRequests, Unauthorized
from mmserver.store.names import normalize_name
from mmserver.tenancy import sigv4
from mmserver.tenancy.tenants import RESERVED, Tenant, Tenants, parse_tenants, token_digest

log = logging.getLogger("mmserver.tenants")

#: The caller of the management token: every model, no limits. Its requests are counted under
#: the ``tenant`` label ``management`` (which no tenant of the file may be called).
OPERATOR = Tenant(RESERVED, ("*",), {})
#: Seconds a 429 for a tenant's limits is held before it is sent (see the module docstring).
THROTTLE_HOLD_S = 0.25
#: The ``tenant`` label of a request no caller was found for.
NOBODY = "-"
#: Seconds between looks at the file's modification time.
WATCH_S = 1.0
#: Authorization values, and model names per tenant, remembered at most (then forgotten).
_KEPT = 4096


class NotAuthenticated(Unauthorized):
    """A request on a tenant's door without a token the server knows."""

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="mmserver"'}


class AccessDenied(Forbidden):
    """A tenant's request for a model outside its patterns."""

    amzn_error_type = "AccessDeniedException"


class Throttled(TooManyRequests):
    """A tenant over its rate or its ``max_concurrent``."""


class Limits:
    """One tenant's token bucket and its requests in flight."""

    __slots__ = ("burst", "in_flight", "max_concurrent", "rate", "stamp", "tokens")

    def __init__(self, tenant: Tenant) -> None:
        self.in_flight = 0
        self.stamp = time.monotonic()
        self.tokens = tenant.burst
        self.configure(tenant)

    def configure(self, tenant: Tenant) -> None:
        """Take ``tenant``'s limits (a reload): the requests in flight stay counted, since
        their answers release this object; the bucket keeps its tokens up to the new burst."""
        self.rate, self.burst, self.max_concurrent = (
            tenant.rate,
            tenant.burst,
            tenant.max_concurrent,
        )
        self.tokens = min(self.tokens, self.burst)

    def take(self, name: str) -> None:
        """Take one request's place, or raise :class:`Throttled`."""
        if self.max_concurrent and self.in_flight >= self.max_concurrent:
            raise Throttled(
                f"tenant {name} has {self.in_flight} requests in flight, its max_concurrent; "
                "retry when one is answered"
            )
        if self.rate:
            now = time.monotonic()
            tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if tokens < 1.0:
                self.tokens = tokens
                wait = max(1, math.ceil((1.0 - tokens) / self.rate))
                raise Throttled(
                    f"tenant {name} is over its rate of {self.rate:g} requests per second "
                    f"(burst {self.burst:g}); retry in {wait} s",
                    retry_after=wait,
                )
            self.tokens = tokens - 1.0
        self.in_flight += 1

    def release(self, _: object = None) -> None:
        """A request's place is free (its answer settled); takes a future's done callback."""
        self.in_flight -= 1


class TenantGate:
    """The tenants in force, their limits, and their file's watch."""

    def __init__(self, path: str | Path, management_token: str = "") -> None:
        self.path = Path(path).expanduser()
        self.management_token = management_token
        self.keys = sigv4.SigningKeys()
        self._limits: dict[str, Limits] = {}
        #: The caller of each ``Authorization`` value a bearer token was found for: a request
        #: then costs a dictionary lookup (forgotten when the file is read again).
        self._known: dict[str, Tenant] = {}
        self._seen: tuple[int, int, int] | None = None
        self._watch: asyncio.TimerHandle | None = None
        self.tenants = self._read()  # a refused file stops the start (ConfigError)
        self._apply(self.tenants)

    # -- the file ---------------------------------------------------------------------------

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> Tenants:
        self._seen = self._stamp()
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the tenants file {self.path}: {exc}") from None
        return parse_tenants(text, str(self.path), self.management_token)

    def _apply(self, tenants: Tenants) -> None:
        kept = self._limits
        limits: dict[str, Limits] = {}
        for tenant in tenants:
            if not (tenant.rate or tenant.max_concurrent):
                continue
            old = kept.get(tenant.name)
            if old is None:
                limits[tenant.name] = Limits(tenant)
            else:
                old.configure(tenant)
                limits[tenant.name] = old
        self._limits = limits
        self._known.clear()  # a token of the old file may be none of the new one's
        self.tenants = tenants

    def reload(self, why: str) -> bool:
        """Read the file again (``why``: what asked, for the log); a refused file keeps the
        tenants in force. Whether the new file is in force."""
        try:
            tenants = self._read()
        except ConfigError as exc:
            log.error("%s: the tenants in force are kept. %s", why, exc.message)
            return False
        self._apply(tenants)
        log.info(
            "tenants file %s read again (%s): %d tenants", self.path, why, len(tenants.by_name)
        )
        return True

    def watch(self) -> None:
        """Look at the file every :data:`WATCH_S` seconds and read it again when it changed."""
        self._watch = asyncio.get_running_loop().call_later(WATCH_S, self._look)

    def _look(self) -> None:
        if self._stamp() != self._seen:
            self.reload("the file changed")
        self.watch()

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- requests ---------------------------------------------------------------------------

    def bearer(self, authorization: str | None) -> Tenant | None:
        """The caller of an ``Authorization`` value if it is a bearer token the server knows
        (the management token: :data:`OPERATOR`)."""
        offered = bearer_token(authorization)
        if offered is None:
            return None
        if same_token(offered, self.management_token):
            return OPERATOR
        return self.tenants.by_token.get(token_digest(offered))

    def authenticate(
        self,
        sagemaker: bool,
        method: str,
        target: str | bytes,
        header: sigv4.Header,
        body: bytes,
    ) -> Tenant:
        """The caller of a request (see the module docstring); ``sagemaker``: it came on a
        SageMaker path, where SigV4 is taken and the refusals are SageMaker's."""
        authorization = header("authorization")
        if authorization is not None:
            known = self._known.get(authorization)
            if known is not None:
                return known
        caller = self.bearer(authorization)
        if caller is not None:
            assert authorization is not None
            known_values = self._known
            if len(known_values) >= _KEPT:
                known_values.clear()
            known_values[authorization] = caller
            return caller
        if sagemaker:
            if (authorization or "").strip()[:7].lower() == "bearer ":
                raise sigv4.SignatureRefused(
                    "UnrecognizedClientException", "the bearer token is not one the server knows"
                )
            if isinstance(target, bytes):
                target = target.decode("ascii", "surrogateescape")
            return sigv4.verify(self.tenants, self.keys, method, target, header, body)
        if authorization:
            raise NotAuthenticated("the bearer token is not one the server knows")
        raise NotAuthenticated(
            "this server serves tenants: send 'Authorization: Bearer <your token>'"
        )

    def admit(self, caller: Tenant, name: str) -> Callable[[object], None] | None:
        """Let ``caller`` call model ``name`` (``NAME``, ``NAME/2``, ``NAME.tar.gz``) now, or
        raise (:class:`AccessDenied`, :class:`Throttled`); what to call once its answer is
        settled (``None``: nothing)."""
        if caller is OPERATOR:
            return None
        seen = caller.seen
        allowed = seen.get(name)
        if allowed is None:
            allowed = caller.may_invoke(_model(name))
            if len(seen) >= _KEPT:
                seen.clear()
            seen[name] = allowed
        if not allowed:
            raise AccessDenied(f"tenant {caller.name} may not invoke model {_model(name)}")
        limits = self._limits.get(caller.name)
        if limits is None:
            return None
        limits.take(caller.name)
        return limits.release

    def may_see(self, caller: Tenant, name: str) -> bool:
        """Whether ``caller`` is shown model ``name`` in listings and metadata."""
        if caller is OPERATOR:
            return True
        try:
            return caller.may_invoke(_model(name))
        except InvalidModelName:
            return False


def _model(name: str) -> str:
    """The model a request's name is of (``NAME/2`` and ``NAME.tar.gz``: ``NAME``); raises
    :class:`InvalidModelName`."""
    return normalize_name(name.partition("/")[0])


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` value (an HTTP header, gRPC's
    metadata), as bytes (header bytes that are not UTF-8 arrive as surrogates: they compare as
    their bytes); ``None`` for any other value."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip().encode("utf-8", "surrogateescape")


def same_token(offered: bytes | None, token: str) -> bool:
    """Whether ``offered`` (:func:`bearer_token`) is the configured ``token`` (an empty one is
    nobody's), compared in constant time."""
    return bool(token) and offered is not None and hmac.compare_digest(offered, token.encode())
