"""Requests of a job to a server or a cluster's balancer
(:mod:`~mmserver.commands.transform.connections`).

A payload goes to DJL's path, ``POST /predictions/NAME[/VERSION]``. A busy server (503, 429)
or a connection that fails is tried again, up to :data:`ATTEMPTS` times, after the
``Retry-After`` it gave or a growing pause; an unknown model (404) or a TLS certificate that
cannot be verified stops the job; any other refusal (a record the model cannot read, the
model's own error, a timeout) fails the payload's file with the server's message.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from urllib.parse import quote

from mmserver.commands.transform.connections import (
    Exchanges,
    Unreachable,
    Untrusted,
    open_exchanges,
)
from mmserver.commands.transform.failures import FileFailed, TransformError
from mmserver.errors import answer_message
from mmserver.ops.traces import TRACEPARENT

#: Tries of one payload while the server is busy or cannot be reached.
ATTEMPTS = 8
_RETRIED = frozenset({429, 503})


def model_path(model: str) -> str:
    """``/predictions/NAME`` or ``/predictions/NAME/VERSION`` for ``--model``."""
    name, _, version = model.strip().partition("/")
    path = "/predictions/" + quote(name, safe="")
    return path + "/" + quote(version, safe="") if version else path


def _message(status: int, body: bytes) -> str:
    return answer_message(body, 500) or f"status {status}"


class Sender:
    """Sends payloads to ``url``; at most ``concurrency`` connections; with ``token``, each with
    ``Authorization: Bearer <token>``; with ``traceparent``, each with that header. An async
    context manager: the connections are closed on exit."""

    def __init__(
        self,
        url: str,
        model: str,
        accept: str,
        concurrency: int,
        timeout: float,
        token: str = "",
        traceparent: str | None = None,
    ):
        self.base = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if traceparent is not None:  # the server's spans of its requests go under the job's
            self._headers[TRACEPARENT] = traceparent
        self.path = model_path(model)
        self.model = model
        self.accept = accept
        self._concurrency = concurrency
        self._timeout = timeout
        self._exchanges: Exchanges | None = None

    async def __aenter__(self) -> Sender:
        self._exchanges = open_exchanges(self.base, self._concurrency, self._timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._exchanges is not None:
            await self._exchanges.close()

    async def send(self, body: bytes, content_type: str) -> tuple[bytes, str]:
        """The answer to ``body``: its bytes and its ``Content-Type``. Raises
        :class:`FileFailed` for a refused payload, :class:`TransformError` when the job cannot
        go on (unknown model, server unreachable or busy after every attempt)."""
        assert self._exchanges is not None, "used outside its async with"
        headers = {"Content-Type": content_type, "Accept": self.accept, **self._headers}
        pause = 0.1
        for attempt in range(1, ATTEMPTS + 1):
            try:
                answer = await self._exchanges.request("POST", self.path, body, headers)
            except TimeoutError:
                raise FileFailed(f"no answer from {self.base} in {self._timeout:g} s") from None
            except Untrusted as exc:
                hint = (
                    "; if a private CA signed it, name a file with that CA's certificate in "
                    "SSL_CERT_FILE"
                    if exc.unknown_issuer
                    else ""
                )
                raise TransformError(
                    f"{self.base}: its TLS certificate cannot be verified ({exc}){hint}"
                ) from None
            except Unreachable as exc:
                if attempt == ATTEMPTS:
                    raise TransformError(f"{self.base} cannot be reached: {exc}") from None
                wait = pause
            else:
                if answer.status == 200:
                    return answer.body, answer.headers.get("content-type", "")
                if answer.status == 404:
                    raise TransformError(
                        f"model {self.model!r} at {self.base}: {_message(404, answer.body)}"
                    )
                if answer.status in (401, 403):
                    raise TransformError(
                        f"model {self.model!r} at {self.base}: the server refused the job's "
                        f"credentials ({answer.status}: {_message(answer.status, answer.body)}); "
                        "give --token (or MMSERVER_TOKEN) a token that may call the model"
                    )
                if answer.status not in _RETRIED or attempt == ATTEMPTS:
                    raise FileFailed(
                        f"the server answered {answer.status}: "
                        f"{_message(answer.status, answer.body)}"
                    )
                wait = _retry_after(answer.headers.get("retry-after"), pause)
            await asyncio.sleep(wait)
            pause = min(pause * 2, 5.0)
        raise AssertionError("unreachable")


def _retry_after(value: str | None, default: float) -> float:
    try:
        return min(max(float(value or ""), 0.0), 30.0)
    except ValueError:
        return default
