"""The tenants file, the tenants' limits and AWS Signature Version 4 as the server checks them:
requests signed by botocore itself, then changed one part at a time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from mmserver.errors import ConfigError
from mmserver.tenancy import sigv4
from mmserver.tenancy.gate import OPERATOR, Limits, TenantGate, Throttled
from mmserver.tenancy.tenants import parse_tenants, token_digest

GOOD = """\
tenants:
  acme:
    models: ["acme-*", "shared-[0-9]"]
    access_keys: {AKIAACME00000001: "acme-secret"}
    tokens: ["tok-acme-1"]
    requests_per_second: 50
    burst: 100
    max_concurrent: 16
  beta:
    models: ["beta-*"]
    tokens: ["tok-beta-1"]
    priority: low
"""


def test_a_good_file_is_read() -> None:
    tenants = parse_tenants(GOOD, "tenants.yaml")
    acme = tenants.by_name["acme"]
    assert tenants.by_token[token_digest("tok-acme-1")] is acme
    assert tenants.by_key["AKIAACME00000001"] is acme
    assert (acme.rate, acme.burst, acme.max_concurrent) == (50.0, 100.0, 16)
    assert acme.may_invoke("acme-7") and acme.may_invoke("shared-3")
    assert not acme.may_invoke("beta-1") and not acme.may_invoke("shared-10")
    beta = tenants.by_name["beta"]
    assert (beta.rate, beta.burst, beta.max_concurrent, beta.priority) == (0.0, 0.0, 0, "low")


def test_burst_defaults_to_the_rate() -> None:
    text = 'tenants: {a: {models: ["a-*"], tokens: ["tok-aaaa-1"], requests_per_second: 5}}'
    assert parse_tenants(text, "t.json").by_name["a"].burst == 5.0


def test_a_hostile_file_is_refused_with_every_fault_and_its_line() -> None:
    text = """\
tenants:
  acme:
    models: ["acme-*", "acme-[", "../etc/*"]
    tokenz: ["tok-acme-1"]
    tokens: ["tok-beta-1", "short"]
    requests_per_second: -1
    max_concurrent: 2.5
    priority: urgent
  beta:
    models: ["beta-*"]
    tokens: ["tok-beta-1", "the-management-token"]
    access_keys: {lowercase: "x"}
    burst: 3
  management:
    models: ["*"]
    tokens: ["tok-mgmt-1"]
extra: 1
"""
    with pytest.raises(ConfigError) as caught:
        parse_tenants(text, "tenants.yaml", management_token="the-management-token")
    message = caught.value.message
    expected = [
        "line 3: tenant acme: model pattern 'acme-[' leaves a [ open",
        "line 3: tenant acme: model pattern '../etc/*' holds a character no model name has",
        "line 4: tenant acme: unknown key 'tokenz'; did you mean 'tokens'?",
        "line 5: tenant acme: a token is at least 8 printable ASCII characters",
        "line 6: tenant acme: requests_per_second must be a number above 0, not '-1'",
        "line 7: tenant acme: max_concurrent must be a whole number above 0, not '2.5'",
        "line 8: tenant acme: priority must be one of high, normal, low, not 'urgent'",
        "line 11: tenant beta: a token of tenant acme too",
        "line 11: tenant beta: a token may not be the management token",
        "line 12: tenant beta: access key id 'lowercase' is not 16 to 128",
        "line 13: tenant beta: burst needs requests_per_second",
        "tenant management: the name is the management token's caller's",
        "line 17: unknown key 'extra'; the keys are tenants",
    ]
    for part in expected:
        assert part in message, part


def test_a_file_that_is_not_yaml_names_its_line() -> None:
    with pytest.raises(ConfigError, match=r"t.yaml, line 2: not valid YAML"):
        parse_tenants("tenants:\n  a: {models: [x}\n", "t.yaml")


def test_a_tenant_nobody_can_call_as_is_refused() -> None:
    with pytest.raises(ConfigError, match="neither access_keys nor tokens"):
        parse_tenants('tenants: {a: {models: ["a-*"]}}', "t.yaml")


def test_a_duplicate_key_is_refused() -> None:
    text = 'tenants:\n  a: {models: ["a-*"], tokens: ["tok-aaaa-1"]}\n  a: {models: ["b"]}\n'
    with pytest.raises(ConfigError, match="line 3: tenants: 'a' is given twice"):
        parse_tenants(text, "t.yaml")


# -- limits --------------------------------------------------------------------------------------


def test_the_bucket_holds_burst_requests_then_says_when_to_retry() -> None:
    tenant = parse_tenants(
        'tenants: {a: {models: ["a-*"], tokens: ["tok-aaaa-1"], requests_per_second: 0.5, '
        "burst: 2}}",
        "t.yaml",
    ).by_name["a"]
    limits = Limits(tenant)
    limits.take("a")
    limits.take("a")
    with pytest.raises(Throttled) as caught:
        limits.take("a")
    assert caught.value.status_code == 429
    assert caught.value.amzn_error_type == "ThrottlingException"
    assert caught.value.headers() == {"Retry-After": "2"}  # one token at 0.5/s
    assert "over its rate of 0.5 requests per second (burst 2)" in caught.value.message


def test_requests_in_flight_are_bounded_and_released() -> None:
    tenant = parse_tenants(
        'tenants: {a: {models: ["a-*"], tokens: ["tok-aaaa-1"], max_concurrent: 1}}', "t.yaml"
    ).by_name["a"]
    limits = Limits(tenant)
    limits.take("a")
    with pytest.raises(Throttled, match="1 requests in flight, its max_concurrent"):
        limits.take("a")
    limits.release()
    limits.take("a")


def test_the_operator_sees_every_model() -> None:
    assert OPERATOR.may_invoke("anything-at-all")


# -- SigV4 ---------------------------------------------------------------------------------------

TENANTS = parse_tenants(GOOD, "tenants.yaml")
KEY = "AKIAACME00000001"


def signed(
    body: bytes = b"[[1.0]]",
    *,
    key: str = KEY,
    secret: str = "acme-secret",
    service: str = "sagemaker",
    region: str = "eu-west-3",
    path: str = "/endpoints/my%20endpoint/invocations",
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The headers botocore signs a SageMaker Runtime request with (``extra`` ones too)."""
    request = AWSRequest(
        method="POST",
        url=f"http://127.0.0.1:8080{path}",
        data=body,
        headers={
            "Content-Type": "application/json",
            "X-Amzn-SageMaker-Target-Model": "acme-1.tar.gz",
            **(extra or {}),
        },
    )
    SigV4Auth(Credentials(key, secret), service, region).add_auth(request)
    headers = {k.lower(): v for k, v in request.headers.items()}
    headers["host"] = "127.0.0.1:8080"
    return headers


def check(
    headers: dict[str, str],
    body: bytes = b"[[1.0]]",
    path: str = "/endpoints/my%20endpoint/invocations",
    now: float | None = None,
) -> object:
    return sigv4.verify(TENANTS, sigv4.SigningKeys(), "POST", path, headers.get, body, now)


def refused(headers: dict[str, str], **kwargs: object) -> sigv4.SignatureRefused:
    with pytest.raises(sigv4.SignatureRefused) as caught:
        check(headers, **kwargs)  # type: ignore[arg-type]
    assert caught.value.status_code == 403
    return caught.value


def test_a_request_botocore_signed_is_the_tenant_of_its_key() -> None:
    assert check(signed()) is TENANTS.by_name["acme"]


def test_the_signing_key_is_derived_once_a_day_and_region() -> None:
    keys = sigv4.SigningKeys()
    first = keys.key("acme-secret", "20261202", "eu-west-3")
    assert keys.key("acme-secret", "20261202", "eu-west-3") is first
    assert keys.key("acme-secret", "20261203", "eu-west-3") != first


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"secret": "wrong"}, "InvalidSignatureException"),
        ({"key": "AKIAUNKNOWN00001"}, "UnrecognizedClientException"),
        ({"service": "s3"}, "InvalidSignatureException"),
    ],
)
def test_a_wrong_credential_is_refused_with_aws_code(change: dict[str, str], code: str) -> None:
    assert refused(signed(**change)).amzn_error_type == code


def test_a_changed_body_path_or_header_is_refused() -> None:
    headers = signed()
    assert refused(headers, body=b"[[2.0]]").amzn_error_type == "InvalidSignatureException"
    other = "/endpoints/other/invocations"
    assert refused(headers, path=other).amzn_error_type == "InvalidSignatureException"
    changed = {**headers, "x-amzn-sagemaker-target-model": "beta-1"}
    assert refused(changed).amzn_error_type == "InvalidSignatureException"


def test_a_claimed_payload_hash_must_be_the_bodys() -> None:
    # botocore signs the claimed hash in place of the body's: the claim must be checked.
    headers = signed(extra={"X-Amz-Content-SHA256": "0" * 64})
    assert "not the SHA-256 of the body" in refused(headers).message


def test_a_stale_signature_is_refused() -> None:
    later = time.time() + 16 * 60
    error = refused(signed(), now=later)
    assert error.amzn_error_type == "InvalidSignatureException"
    assert error.message.startswith("Signature expired")
    assert check(signed(), now=time.time() + 14 * 60) is TENANTS.by_name["acme"]


def test_no_signature_or_half_a_signature() -> None:
    assert refused({"host": "h"}).amzn_error_type == "MissingAuthenticationTokenException"
    half = {"host": "h", "authorization": "AWS4-HMAC-SHA256 Credential=x"}
    assert refused(half).amzn_error_type == "IncompleteSignatureException"


def test_a_reload_keeps_the_requests_in_flight_that_the_old_file_admitted(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants: {a: {models: ["a-*"], tokens: ["tok-aaaa-1"], max_concurrent: 1}}')
    gate = TenantGate(path)
    first = gate.admit(gate.tenants.by_name["a"], "a-1")
    assert first is not None
    path.write_text('tenants: {a: {models: ["a-*"], tokens: ["tok-aaaa-1"], max_concurrent: 2}}')
    assert gate.reload("test")
    tenant = gate.tenants.by_name["a"]
    assert gate.admit(tenant, "a-1") is not None  # 2 in flight: the first one still counts
    with pytest.raises(Throttled, match="2 requests in flight"):
        gate.admit(tenant, "a-1")
    first(None)  # the answer admitted under the old file gives its place back
    assert gate.admit(tenant, "a-1") is not None
