"""The error tree of mmserver.

Every failure a client can see is an :class:`MMServerError`. Each class carries its HTTP status,
the ``x-amzn-ErrorType`` that the SageMaker paths send (so ``boto3`` raises the matching
exception), and a message that says what went wrong and what to do. The HTTP layer converts them
in one place; nothing else picks status codes. The ``type`` of an error body is the simple name of
the Java exception DJL Serving answers the same failure with (:data:`DJL_TYPES`), so clients
written against DJL read the same names.

::

    MMServerError                       500 InternalFailure
    ├── InvalidInput                    400 ValidationError   bad body, features, name
    │   ├── InvalidModelName            400 ValidationError
    │   └── InputMissing                400 ValidationError   async input cannot be read
    ├── ModelNotReady                   400 ValidationError   V2 model ready: not loaded
    ├── ModelNotFound                   404 ValidationError
    ├── NotFound                        404 ValidationError   unknown path
    ├── MethodNotAllowed                405
    ├── ModelExists                     409
    ├── RequestTimeout                  408 ValidationError   body not sent in time
    ├── RequestTooLarge                 413 ValidationError
    ├── UnsupportedMediaType            415 ValidationError
    ├── Unauthorized                    401
    ├── Forbidden                       403                   model url outside allowed roots
    ├── ModelError                      424 ModelError        the model's own code raised
    ├── ModelLoadError                  500 InternalFailure   the model failed to load
    │   ├── UntrustedModel              500                   files need more trust than given
    │   ├── ConfigError                 500                   bad serving.properties
    │   ├── EnvironmentFailed           500                   requirements not installable
    │   └── UnsafeArchive               500                   refused archive
    ├── BackendDied                     500 InternalFailure
    ├── ServiceUnavailable              503 ServiceUnavailable
    │   ├── QueueFull                   503 (Retry-After)
    │   ├── NoCapacity         (R)      503                   nothing evictable
    │   ├── ShuttingDown       (R)      503
    │   └── WorkersStopped              503                   the model's maxWorkers is 0
    ├── TooManyRequests                 429 ThrottlingException  async queue full (Retry-After)
    ├── ClientClosed                    499                   left while sending its request
    ├── PredictTimeout                  504 ServiceUnavailable
    │   └── ClientGone                  504                   dropped before compute
    └── InsufficientMemory     (R)      507                   management load refused

(R): also a :class:`ResourceError`: the server lacks room, or is stopping. A load that ends with
one is not the model's failure: it is not remembered against the model.

Who an error is about follows from its class, never from a flag or its message: a request's
own fault is an :class:`InvalidInput` (a parameter of a management call included, whatever
checks it); a model's, a :class:`ModelLoadError` (its ``serving.properties`` a
:class:`ConfigError`); the server's resources, a :class:`ResourceError`.
"""

from __future__ import annotations

import json

#: The longest error message: every error body and the log lines that quote one stay bounded.
MAX_MESSAGE = 4096


class MMServerError(Exception):
    """Base of every error a client can see.

    ``model`` is set when the message begins by naming the model it is about ("model NAME
    ..."): whoever reports the error further (the loader) then does not name the model again.
    It crosses the pipe from a backend process with the class and the message."""

    status_code: int = 500
    amzn_error_type: str | None = "InternalFailure"
    model: str | None = None

    def __init__(self, message: str, *, model: str | None = None) -> None:
        if len(message) > MAX_MESSAGE:
            # A model's exception, an archive's member name: text from outside is bounded.
            cut = MAX_MESSAGE - 60
            message = f"{message[:cut]}... ({len(message)} characters, shortened)"
        super().__init__(message)
        self.message = message
        if model is not None:
            self.model = model

    def headers(self) -> dict[str, str]:
        """Extra response headers this error asks for (besides the error type)."""
        return {}

    @property
    def error_type(self) -> str:
        """The ``type`` of this error's body: DJL's Java exception for it (:data:`DJL_TYPES`)."""
        return djl_type(type(self))

    def to_dict(self) -> dict[str, object]:
        return {"code": self.status_code, "type": self.error_type, "message": self.message}


class ResourceError(MMServerError):
    """The server cannot do it now for want of a resource (room for another model, or its own
    life: it is stopping); nothing is wrong with the request or the model."""


class InvalidInput(MMServerError):
    status_code = 400
    amzn_error_type = "ValidationError"


class InvalidModelName(InvalidInput):
    """A model name that is not ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""


class InputMissing(InvalidInput):
    """The input an asynchronous request named cannot be read (it does not exist, or is not a
    file): said in its failure object."""


class ModelNotReady(MMServerError):
    """The Open Inference Protocol's model readiness: the model exists but is not loaded."""

    status_code = 400
    amzn_error_type = "ValidationError"


class ModelNotFound(MMServerError):
    status_code = 404
    amzn_error_type = "ValidationError"


class NotFound(MMServerError):
    status_code = 404
    amzn_error_type = "ValidationError"


class MethodNotAllowed(MMServerError):
    status_code = 405
    amzn_error_type = None


class ModelExists(MMServerError):
    status_code = 409
    amzn_error_type = None


class RequestTimeout(MMServerError):
    """The client did not send its request's body within ``body_timeout``."""

    status_code = 408
    amzn_error_type = "ValidationError"


class ClientClosed(MMServerError):
    """The client closed its connection while sending its request: nobody reads an answer,
    and the request is counted under status 499 (as nginx counts it), not as a failure."""

    status_code = 499
    amzn_error_type = None


class RequestTooLarge(MMServerError):
    status_code = 413
    amzn_error_type = "ValidationError"


class UnsupportedMediaType(MMServerError):
    status_code = 415
    amzn_error_type = "ValidationError"


class Unauthorized(MMServerError):
    status_code = 401
    amzn_error_type = None

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="mmserver-management"'}


class Forbidden(MMServerError):
    status_code = 403
    amzn_error_type: str | None = None


class ModelError(MMServerError):
    """The model's own code raised while predicting.

    Its body also has the members of the SageMaker Runtime API's ``ModelError`` shape that the
    container's answer fills, ``OriginalStatusCode`` and ``OriginalMessage``: ``boto3`` puts them
    in the ``response`` of the ``ModelError`` it raises."""

    status_code = 424
    amzn_error_type = "ModelError"

    def to_dict(self) -> dict[str, object]:
        body = super().to_dict()
        body["OriginalStatusCode"] = self.status_code
        body["OriginalMessage"] = self.message
        return body


class ModelLoadError(MMServerError):
    """The model could not be loaded; the message says why. The loader puts "model NAME failed
    to load: " before a message that does not name its model (``model`` unset)."""

    status_code = 500
    amzn_error_type = "InternalFailure"


class UntrustedModel(ModelLoadError):
    """A model's files need more trust than the server's options give them: a pickle global
    outside the allowed types, a custom handler of a model ``trusted_models`` does not name."""


class VersionSkew(ModelLoadError):
    """A pickle made by another minor version of its library than the server's, refused by the
    server's ``on_version_skew`` option."""


class EnvironmentFailed(ModelLoadError):
    """The environment a model's requirement set asks for could not be built: the message names
    the package and the installer's last error line."""


class ConfigError(ModelLoadError):
    """A configuration value is invalid; the message names the file, the key and the value."""


class UnsafeArchive(ModelLoadError):
    """An archive refused for a path, link, device file or size that is not safe."""


class BackendDied(MMServerError):
    status_code = 500
    amzn_error_type = "InternalFailure"


class ServiceUnavailable(MMServerError):
    status_code = 503
    amzn_error_type = "ServiceUnavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}  # a moment, or another instance (a stopping server's)


class QueueFull(ServiceUnavailable):
    """The model's queue holds ``job_queue_size`` jobs."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class TooManyRequests(MMServerError):
    """The server holds ``async_max_queued`` asynchronous requests: the client retries later
    (botocore retries a ``ThrottlingException`` by itself)."""

    status_code = 429
    amzn_error_type = "ThrottlingException"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class NoCapacity(ServiceUnavailable, ResourceError):
    """No loaded model can be evicted to make room for this one. ``room`` says what is loaded
    and what the limits are; the message adds that the client may retry."""

    def __init__(self, room: str) -> None:
        super().__init__(f"{room}; retry later")
        self.room = room


class ShuttingDown(ServiceUnavailable, ResourceError):
    """The server, or the model, is stopping."""


class WorkersStopped(ServiceUnavailable):
    """The model's ``maxWorkers`` is 0 (``PUT /models/NAME?max_worker=0``): it keeps no worker."""


class PredictTimeout(MMServerError):
    status_code = 504
    amzn_error_type = "ServiceUnavailable"


class ClientGone(PredictTimeout):
    """The client left before its request was computed."""


class InsufficientMemory(ResourceError):
    """A management call asked to load a model the server has no room for (DJL's 507)."""

    status_code = 507
    amzn_error_type = None


#: The simple name of the Java exception DJL Serving answers each failure with: the ``type`` of an
#: error body (DJL's ``NettyUtils.sendError`` writes ``t.getClass().getSimpleName()``). A class
#: not listed takes the name of its nearest listed base. Where DJL has no exception of its own
#: for a failure, the name is the one DJL gives the nearest failure: ``BadRequestException``
#: carries any 4xx (DJL's 409 is one), ``EngineException`` is a model its engine could not load
#: or run.
DJL_TYPES: dict[type[MMServerError], str] = {
    MMServerError: "InternalServerException",
    InvalidInput: "BadRequestException",
    ModelNotReady: "WlmException",  # DJL: "Model is not ready"
    ModelNotFound: "ModelNotFoundException",
    NotFound: "ResourceNotFoundException",
    MethodNotAllowed: "MethodNotAllowedException",
    ModelExists: "BadRequestException",  # DJL: BadRequestException(409, "... already registered.")
    RequestTimeout: "BadRequestException",
    ClientClosed: "BadRequestException",
    RequestTooLarge: "BadRequestException",
    UnsupportedMediaType: "BadRequestException",
    Unauthorized: "BadRequestException",
    Forbidden: "BadRequestException",
    ModelError: "TranslateException",  # what DJL's predictor raises when the handler fails
    ModelLoadError: "EngineException",  # DJL: "Failed to loaded model."
    ConfigError: "IllegalConfigurationException",
    UnsafeArchive: "MalformedModelException",
    UntrustedModel: "MalformedModelException",
    VersionSkew: "MalformedModelException",
    BackendDied: "EngineException",  # DJL: "Backend Python process is unrecoverable"
    ServiceUnavailable: "ServiceUnavailableException",
    QueueFull: "WlmCapacityException",  # DJL: "Worker queue capacity exceeded for model"
    TooManyRequests: "WlmCapacityException",
    NoCapacity: "WlmOutOfMemoryException",  # DJL: "No enough memory to load the model."
    ShuttingDown: "WlmShutdownException",
    WorkersStopped: "WlmShutdownException",  # DJL: "All model workers has been shutdown"
    PredictTimeout: "TimeoutException",  # the cause of DJL's predict timing out
    InsufficientMemory: "WlmOutOfMemoryException",
}


def djl_type(cls: type[MMServerError]) -> str:
    """DJL's Java exception name for errors of class ``cls`` (:data:`DJL_TYPES`)."""
    for base in cls.__mro__:
        name = DJL_TYPES.get(base)
        if name is not None:
            return name
    return DJL_TYPES[MMServerError]


def from_name(kind: str, message: str, model: str | None = None) -> MMServerError:
    """The error named ``kind`` (a class of this module) with ``message`` and ``model``: how an
    error raised in a backend process is rebuilt on the frontend. An unknown name becomes
    :class:`ModelError`."""
    cls = globals().get(kind)
    if not (isinstance(cls, type) and issubclass(cls, MMServerError)):
        cls = ModelError
    return cls(message, model=model)


def answer_message(body: bytes | str, limit: int = 200) -> str:
    """The message of one of this server's error answers, as a client reads it (DJL's and
    SageMaker's ``message``, the Open Inference Protocol's ``error``), or the first ``limit``
    characters of the body when it has none."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        found = data.get("message") or data.get("error")
        if found:
            return str(found)
    return text.strip()[:limit]
