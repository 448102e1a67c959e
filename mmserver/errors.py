"""The error tree of mmserver.

Every failure a client can see is an :class:`MMServerError`. Each class carries its HTTP status,
the ``x-amzn-ErrorType`` that the SageMaker paths send (so ``boto3`` raises the matching
exception), and a message that says what went wrong and what to do. The HTTP layer converts them
in one place; nothing else picks status codes.

::

    MMServerError                       500 InternalFailure
    ├── InvalidInput                    400 ValidationError   bad body, features, name
    │   └── InvalidModelName            400 ValidationError
    ├── ModelNotReady                   400 ValidationError   V2 model ready: not loaded
    ├── ModelNotFound                   404 ValidationError
    ├── NotFound                        404 ValidationError   unknown path
    ├── MethodNotAllowed                405
    ├── ModelExists                     409
    ├── RequestTooLarge                 413 ValidationError
    ├── UnsupportedMediaType            415 ValidationError
    ├── Unauthorized                    401
    ├── Forbidden                       403                   model url outside allowed roots
    ├── ModelError                      424 ModelError        the model's own code raised
    ├── ModelLoadError                  500 InternalFailure   the model failed to load
    │   ├── ConfigError                 500                   bad serving.properties
    │   └── UnsafeArchive               500                   refused archive
    ├── BackendDied                     500 InternalFailure
    ├── ServiceUnavailable              503 ServiceUnavailable
    │   ├── QueueFull                   503 (Retry-After)
    │   ├── NoCapacity                  503                   nothing evictable
    │   └── ShuttingDown                503
    ├── PredictTimeout                  504 ServiceUnavailable
    │   └── ClientGone                  504                   dropped before compute
    └── InsufficientMemory              507                   management load refused
"""

from __future__ import annotations


class MMServerError(Exception):
    """Base of every error a client can see."""

    status_code: int = 500
    error_type: str = "InternalFailure"
    amzn_error_type: str | None = "InternalFailure"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        """Extra response headers this error asks for (besides the error type)."""
        return {}

    def to_dict(self) -> dict[str, object]:
        return {"code": self.status_code, "type": self.error_type, "message": self.message}


class InvalidInput(MMServerError):
    status_code = 400
    error_type = "InvalidInput"
    amzn_error_type = "ValidationError"


class InvalidModelName(InvalidInput):
    error_type = "InvalidModelName"


class ModelNotReady(MMServerError):
    """The Open Inference Protocol's model readiness: the model exists but is not loaded."""

    status_code = 400
    error_type = "ModelNotReady"
    amzn_error_type = "ValidationError"


class ModelNotFound(MMServerError):
    status_code = 404
    error_type = "ModelNotFound"
    amzn_error_type = "ValidationError"


class NotFound(MMServerError):
    status_code = 404
    error_type = "NotFound"
    amzn_error_type = "ValidationError"


class MethodNotAllowed(MMServerError):
    status_code = 405
    error_type = "MethodNotAllowed"
    amzn_error_type = None


class ModelExists(MMServerError):
    status_code = 409
    error_type = "ModelExists"
    amzn_error_type = None


class RequestTooLarge(MMServerError):
    status_code = 413
    error_type = "RequestTooLarge"
    amzn_error_type = "ValidationError"


class UnsupportedMediaType(MMServerError):
    status_code = 415
    error_type = "UnsupportedMediaType"
    amzn_error_type = "ValidationError"


class Unauthorized(MMServerError):
    status_code = 401
    error_type = "Unauthorized"
    amzn_error_type = None

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="mmserver-management"'}


class Forbidden(MMServerError):
    status_code = 403
    error_type = "Forbidden"
    amzn_error_type = None


class ModelError(MMServerError):
    """The model's own code raised while predicting."""

    status_code = 424
    error_type = "ModelError"
    amzn_error_type = "ModelError"


class ModelLoadError(MMServerError):
    """The model could not be loaded; the message says why."""

    status_code = 500
    error_type = "ModelLoadError"
    amzn_error_type = "InternalFailure"


class ConfigError(ModelLoadError):
    """A configuration value is invalid; the message names the file, the key and the value."""

    error_type = "ConfigError"


class UnsafeArchive(ModelLoadError):
    error_type = "UnsafeArchive"


class BackendDied(MMServerError):
    status_code = 500
    error_type = "BackendDied"
    amzn_error_type = "InternalFailure"


class ServiceUnavailable(MMServerError):
    status_code = 503
    error_type = "ServiceUnavailable"
    amzn_error_type = "ServiceUnavailable"


class QueueFull(ServiceUnavailable):
    error_type = "QueueFull"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class NoCapacity(ServiceUnavailable):
    error_type = "NoCapacity"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class ShuttingDown(ServiceUnavailable):
    error_type = "ShuttingDown"


class PredictTimeout(MMServerError):
    status_code = 504
    error_type = "PredictTimeout"
    amzn_error_type = "ServiceUnavailable"


class ClientGone(PredictTimeout):
    error_type = "ClientGone"


class InsufficientMemory(MMServerError):
    status_code = 507
    error_type = "InsufficientMemory"
    amzn_error_type = None


def from_name(kind: str, message: str) -> MMServerError:
    """The error named ``kind`` (a class of this module) with ``message``: how an error raised in
    a backend process is rebuilt on the frontend. An unknown name becomes :class:`ModelError`."""
    cls = globals().get(kind)
    if not (isinstance(cls, type) and issubclass(cls, MMServerError)):
        cls = ModelError
    return cls(message)
