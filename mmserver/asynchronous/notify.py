"""Notifications of ended asynchronous requests: a JSON POST to ``async_notify_url`` with the
fields of SageMaker's asynchronous inference notification, retried with backoff.

Delivery is at least once while the server runs: an attempt that fails to connect, times out or
is answered 429 or 5xx is tried again after each of :data:`RETRY_DELAYS_S`; another 4xx is not
(the receiver refuses it). A request that ended just before a crash may be notified again by the
next start. Notifications are sent by tasks the :class:`Notifier` owns; :meth:`Notifier.close`
gives those still trying a few seconds, then cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

import aiohttp

from mmserver.asynchronous.journal import Invocation, State

log = logging.getLogger(__name__)

#: Seconds before each retry of a notification.
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
#: Seconds one attempt may take.
ATTEMPT_TIMEOUT_S = 5.0
#: Seconds :meth:`Notifier.close` waits for notifications still being sent.
CLOSE_WAIT_S = 2.0

_STATUS = {State.DONE: "Completed", State.FAILED: "Failed", State.EXPIRED: "Expired"}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def notification(
    invocation: Invocation,
    state: State,
    ended_at: float,
    content_type: str | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """The notification of ``invocation`` ended in ``state`` at ``ended_at``: SageMaker's
    fields (``invocationStatus`` ``Completed``, ``Failed`` or ``Expired``)."""
    request: dict[str, Any] = {
        "endpointName": invocation.model,
        "inputLocation": invocation.input,
    }
    for key, value in (
        ("contentType", invocation.content_type),
        ("accept", invocation.accept),
        ("customAttributes", invocation.custom_attributes),
    ):
        if value is not None:
            request[key] = value
    response: dict[str, Any]
    if state is State.DONE:
        response = {"outputLocation": invocation.output}
        if content_type is not None:
            response["contentType"] = content_type
    else:
        response = {"failureLocation": invocation.failure}
    message: dict[str, Any] = {
        "eventVersion": "1.0",
        "eventSource": "aws:sagemaker",
        "eventName": "InferenceResult",
        "eventTime": _time(ended_at),
        "receivedTime": _time(invocation.accepted_at),
        "inferenceId": invocation.id,
        "invocationStatus": _STATUS[state],
        "requestParameters": request,
        "responseParameters": response,
    }
    if error is not None:
        message["failureReason"] = error
    return message


class Notifier:
    """Sends notifications to one URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Notifications delivered, and given up on.
        self.delivered = 0
        self.dropped = 0

    def send(self, message: dict[str, Any]) -> None:
        """Send ``message`` in a task of its own, retried as the module docstring says."""
        task = asyncio.get_running_loop().create_task(
            self._deliver(message), name=f"mmserver-async-notify-{message['inferenceId']}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, message: dict[str, Any]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S)
            )
        reason = ""
        for delay in (0.0, *RETRY_DELAYS_S):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with self._session.post(self.url, json=message) as response:
                    await response.read()
                    if response.status < 300:
                        self.delivered += 1
                        return
                    reason = f"answered {response.status}"
                    if 400 <= response.status < 500 and response.status != 429:
                        break
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
        self.dropped += 1
        log.warning(
            "the notification of asynchronous request %s was not delivered to %s: %s",
            message["inferenceId"],
            self.url,
            reason,
        )

    async def close(self) -> None:
        """Give the notifications still being sent :data:`CLOSE_WAIT_S`, cancel the rest."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
