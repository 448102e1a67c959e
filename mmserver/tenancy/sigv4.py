"""AWS Signature Version 4 on the SageMaker paths, verified as AWS verifies it, so boto3 and the
SageMaker SDK call with a tenant's access keys unmodified.

The canonical request and the string to sign are botocore's own (:class:`botocore.auth.
SigV4Auth`, the code that signed the request), built from what the request carried: its method,
its target as sent, the headers it names in ``SignedHeaders`` and its body (whose SHA-256 also
has to match an ``X-Amz-Content-SHA256`` header). Any region is taken; the service must be
``sagemaker``; ``X-Amz-Date`` must be within 15 minutes of the server's clock. The signing key
derived from a secret, a day, a region and the service is kept (:class:`SigningKeys`): a request
then costs one HMAC besides the canonical form.

Refusals are SageMaker's (403, the code in ``x-amzn-ErrorType``, which botocore raises):
``MissingAuthenticationTokenException`` (no signature), ``IncompleteSignatureException`` (a
malformed one), ``UnrecognizedClientException`` (an access key id no tenant has) and
``InvalidSignatureException`` (a wrong secret, another service, a stale date, a changed body).
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import time
from collections.abc import Callable

from mmserver.errors import Forbidden
from mmserver.tenancy.tenants import Tenant, Tenants

SCHEME = "AWS4-HMAC-SHA256"
SERVICE = "sagemaker"
#: How far ``X-Amz-Date`` may be from the server's clock, as AWS allows.
MAX_SKEW_S = 15 * 60
#: Signing keys kept at most (then all are forgotten and derived again).
_KEYS_KEPT = 4096

#: A request header's value by its lower-case name (``None``: absent).
Header = Callable[[str], "str | None"]


class SignatureRefused(Forbidden):
    """A SageMaker path's request whose signature is missing, malformed or wrong: 403 with the
    code AWS gives that case."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.amzn_error_type = code


class SigningKeys:
    """The derived signing keys (secret, day, region, service: the four HMACs of SigV4's key)
    of the requests seen, kept so a request costs one HMAC more than its canonical form."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str, str], bytes] = {}

    def key(self, secret: str, day: str, region: str) -> bytes:
        kept = self._keys.get((secret, day, region))
        if kept is not None:
            return kept
        key = ("AWS4" + secret).encode()
        for part in (day, region, SERVICE, "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        if len(self._keys) >= _KEYS_KEPT:
            self._keys.clear()
        self._keys[(secret, day, region)] = key
        return key


def _fields(authorization: str) -> dict[str, str]:
    """``Credential=...``, ``SignedHeaders=...``, ``Signature=...`` of an Authorization value
    past its scheme."""
    out: dict[str, str] = {}
    for part in authorization.split(","):
        name, eq, value = part.strip().partition("=")
        if eq:
            out[name] = value
    return out


def verify(
    tenants: Tenants,
    keys: SigningKeys,
    method: str,
    target: str,
    header: Header,
    body: bytes,
    now: float | None = None,
) -> Tenant:
    """The tenant whose access key signed this request (``target``: the path and query as
    sent); raises :class:`SignatureRefused` as the module docstring says."""
    authorization = header("authorization") or ""
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme != SCHEME:
        raise SignatureRefused(
            "MissingAuthenticationTokenException",
            "Missing Authentication Token: sign the request with AWS Signature Version 4 "
            "(boto3 with the tenant's access key) or send 'Authorization: Bearer <token>'",
        )
    fields = _fields(rest)
    credential = fields.get("Credential", "").split("/")
    signed = fields.get("SignedHeaders", "")
    offered = fields.get("Signature", "")
    amz_date = header("x-amz-date") or ""
    if len(credential) != 5 or not signed or not offered or not amz_date:
        raise SignatureRefused(
            "IncompleteSignatureException",
            "the Authorization header needs Credential, SignedHeaders and Signature, and the "
            "request an X-Amz-Date header",
        )
    key_id, day, region, service, terminator = credential
    tenant = tenants.by_key.get(key_id)
    if tenant is None:
        raise SignatureRefused(
            "UnrecognizedClientException", "The security token included in the request is invalid."
        )
    if service != SERVICE or terminator != "aws4_request":
        raise SignatureRefused(
            "InvalidSignatureException",
            f"Credential should be scoped to correct service: '{SERVICE}'.",
        )
    try:
        signed_at = calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        raise SignatureRefused(
            "IncompleteSignatureException",
            f"X-Amz-Date {amz_date[:40]!r} is not of the form YYYYMMDDTHHMMSSZ",
        ) from None
    now = time.time() if now is None else now
    if abs(now - signed_at) > MAX_SKEW_S or day != amz_date[:8]:
        raise SignatureRefused(
            "InvalidSignatureException",
            f"Signature expired: {amz_date} is not within 15 minutes of the server's time "
            f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))} (or its credential's day "
            "differs from it)",
        )
    names = signed.split(";")
    if "host" not in names or "x-amz-date" not in names:
        raise SignatureRefused(
            "InvalidSignatureException", "SignedHeaders must include host and x-amz-date"
        )
    headers: dict[str, str] = {}
    for name in names:
        value = header(name)
        if value is None:
            raise SignatureRefused(
                "InvalidSignatureException",
                f"the signed header {name[:60]!r} is not in the request",
            )
        headers[name] = value
    claimed = headers.get("x-amz-content-sha256")
    if claimed is not None and claimed != hashlib.sha256(body).hexdigest():
        raise SignatureRefused(
            "InvalidSignatureException", "X-Amz-Content-SHA256 is not the SHA-256 of the body"
        )
    # Imported at the first signed request: botocore's signer costs a server's start 0.1 s.
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest

    request = AWSRequest(
        method=method, url=f"http://{headers['host']}{target}", headers=headers, data=body
    )
    request.context["timestamp"] = amz_date
    signer = SigV4Auth(None, SERVICE, region)
    canonical = signer.canonical_request(request)
    string_to_sign = signer.string_to_sign(request, canonical)
    secret = tenant.access_keys[key_id]
    expected = hmac.new(keys.key(secret, day, region), string_to_sign.encode(), hashlib.sha256)
    if not hmac.compare_digest(
        expected.hexdigest().encode(), offered.encode("utf-8", "surrogateescape")
    ):
        raise SignatureRefused(
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method.",
        )
    return tenant
