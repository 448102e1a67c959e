"""What an ``InvokeEndpointAsync`` call asks for (:class:`AsyncRequest`, from its headers) and
the checks of its values: each refusal is an :class:`~mmserver.errors.InvalidInput` (400)
naming the header, before anything is written."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from mmserver import errors
from mmserver.ops.traces import TRACEPARENT, TRACESTATE

#: SageMaker's defaults and bounds for a request's TTL and invocation timeout (seconds).
DEFAULT_TTL_S = 21600
MAX_TTL_S = 21600
DEFAULT_TIMEOUT_S = 900
MAX_TIMEOUT_S = 3600

_PREFIX = "X-Amzn-SageMaker-"
TTL_HEADER = _PREFIX + "RequestTTLSeconds"
TIMEOUT_HEADER = _PREFIX + "InvocationTimeoutSeconds"
EXTENSION_HEADER = _PREFIX + "S3OutputPathExtension"
FILENAME_HEADER = _PREFIX + "Filename"
#: The 202's headers: where the answer, or the failure, will be written.
OUTPUT_LOCATION = _PREFIX + "OutputLocation"
FAILURE_LOCATION = _PREFIX + "FailureLocation"

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_PART = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")


@dataclass(frozen=True, slots=True)
class AsyncRequest:
    """What an ``InvokeEndpointAsync`` call asks for, as its headers say it."""

    model: str
    input_location: str | None
    content_type: str | None = None
    accept: str | None = None
    custom_attributes: str | None = None
    inference_id: str | None = None
    ttl: str | None = None
    timeout: str | None = None
    output_extension: str | None = None
    filename: str | None = None
    #: The W3C Trace Context of the call (its ``traceparent`` and ``tracestate`` headers): the
    #: journal keeps the trace it continues, and its run continues it in turn.
    traceparent: str | None = None
    tracestate: str | None = None

    def ttl_s(self) -> float:
        return _seconds(self.ttl, DEFAULT_TTL_S, MAX_TTL_S, TTL_HEADER)

    def timeout_s(self) -> float:
        return _seconds(self.timeout, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, TIMEOUT_HEADER)

    def checked_id(self) -> str:
        """The request's inference id, or a new one (a UUID) when it sent none."""
        inference_id = (self.inference_id or "").strip() or str(uuid.uuid4())
        if not _ID.fullmatch(inference_id):
            raise errors.InvalidInput(
                f"inference id {inference_id[:80]!r}: use 1 to 64 letters, digits, '.', '_', "
                "':' and '-', starting with a letter or digit"
            )
        return inference_id

    def extension(self) -> str | None:
        """The folder under the output and failure paths it asks for, if any."""
        return _part(self.output_extension, EXTENSION_HEADER)

    def checked_filename(self) -> str | None:
        """The name it asks its answer be given, if any."""
        return _part(self.filename, FILENAME_HEADER)

    @classmethod
    def from_headers(cls, model: str, header: Callable[[str], str | None]) -> AsyncRequest:
        """The request for ``model`` whose headers ``header`` gives by name (``None``: not
        sent), as boto3's ``invoke_endpoint_async`` names them."""
        return cls(
            model=model,
            input_location=header(_PREFIX + "InputLocation"),
            content_type=header(_PREFIX + "Content-Type"),
            accept=header(_PREFIX + "Accept"),
            custom_attributes=header(_PREFIX + "Custom-Attributes"),
            inference_id=header(_PREFIX + "Inference-Id"),
            ttl=header(TTL_HEADER),
            timeout=header(TIMEOUT_HEADER),
            output_extension=header(EXTENSION_HEADER),
            filename=header(FILENAME_HEADER),
            traceparent=header(TRACEPARENT),
            tracestate=header(TRACESTATE),
        )

    def check_attributes(self) -> None:
        if self.custom_attributes is not None and len(self.custom_attributes) > 1024:
            raise errors.InvalidInput(f"{_PREFIX}Custom-Attributes is over 1024 characters")


def _seconds(text: str | None, default: int, most: int, header: str) -> float:
    if text is None or not text.strip():
        return float(default)
    try:
        value = int(text.strip())
    except ValueError:
        raise errors.InvalidInput(f"{header}={text[:40]!r} is not a whole number") from None
    if not 1 <= value <= most:
        raise errors.InvalidInput(f"{header}={value} must be between 1 and {most}")
    return float(value)


def _part(text: str | None, header: str) -> str | None:
    """A relative path of safe names (``None`` for none)."""
    if text is None or not text.strip():
        return None
    text = text.strip().strip("/")
    if not _PART.fullmatch(text) or any(p in (".", "..") for p in text.split("/")):
        raise errors.InvalidInput(
            f"{header}={text[:80]!r}: use letters, digits, '.', '_', '-' and '/' between names"
        )
    return text
