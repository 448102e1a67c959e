"""Closed-loop users: each sends a request, waits for its answer, and sends the next one.

The users share one aiohttp session with one kept-alive connection each. Two kinds of run:

- :func:`closed_loop` runs for a time: a warm-up (requests sent then are not measured), then a
  measured window; a request is measured when it is sent inside the window, and counts for
  throughput when its answer arrives inside it. No new request is sent after the window; those
  in flight then are awaited (each bounded by a timeout);
- :func:`closed_loop_list` sends a given list of requests (so two runs touch the same models),
  all measured, and stops early when a time limit passes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

HEADERS = {"Content-Type": "application/json"}
INSTANCE_HEADER = "X-Mmserver-Instance"


@dataclass
class LoadResult:
    """What one run measured."""

    seconds: float
    latencies: list[float] = field(default_factory=list)  # s, requests sent in the window
    completed: int = 0  # answered 200 inside the window
    errors: Counter[str] = field(default_factory=Counter)  # status or exception: count
    by_instance: Counter[str] = field(default_factory=Counter)  # X-Mmserver-Instance: count
    by_model_instance: Counter[tuple[str, str]] = field(default_factory=Counter)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")

    @property
    def throughput(self) -> float:
        return self.completed / self.seconds

    def instances_serving(self, model: str) -> int:
        return sum(1 for (m, _), n in self.by_model_instance.items() if m == model and n)


async def closed_loop(
    url: str,
    users: int,
    duration: float,
    warmup: float,
    choose: Callable[[random.Random], tuple[str, float]],
    expect: Callable[[float], float],
    seed: int = 1,
    timeout: float = 30.0,
) -> LoadResult:
    """``users`` users against ``url`` for ``warmup`` + ``duration`` seconds. Each request is
    ``POST /predictions/{model}`` with body ``[[x]]``, where ``(model, x) = choose(rng)``; user
    ``u`` has its own ``rng`` seeded from ``seed`` and ``u``, so runs with the same seed send
    the same requests in the same order. An answer other than ``expect(x)`` is an error."""
    connector = aiohttp.TCPConnector(limit=users)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    result = LoadResult(seconds=duration)
    start = time.perf_counter() + warmup
    end = start + duration

    async def user(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while (sent := time.perf_counter()) < end:
            model, x = choose(rng)
            instance, error = await _send(session, url, model, x, expect(x))
            answered = time.perf_counter()
            if sent < start:
                continue
            if error:
                result.errors[error] += 1
                continue
            result.latencies.append(answered - sent)
            result.by_instance[instance] += 1
            result.by_model_instance[(model, instance)] += 1
            if answered <= end:
                result.completed += 1

    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        await asyncio.gather(*(user(session, random.Random(seed * 7919 + u)) for u in range(users)))
    return result


async def closed_loop_list(
    url: str,
    users: int,
    models: list[str],
    time_limit: float,
    x: float,
    expected: float,
    timeout: float = 30.0,
) -> LoadResult:
    """``users`` users sending ``POST /predictions/{model}`` with body ``[[x]]`` for each model
    of ``models`` in order, until the list is done or ``time_limit`` s have passed; an answer
    other than ``expected`` is an error. ``seconds`` is the time the run took."""
    connector = aiohttp.TCPConnector(limit=users)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    result = LoadResult(seconds=0.0)
    todo = iter(models)
    start = time.perf_counter()
    give_up = start + time_limit

    async def user(session: aiohttp.ClientSession) -> None:
        for model in todo:
            sent = time.perf_counter()
            if sent > give_up:
                return
            instance, error = await _send(session, url, model, x, expected)
            if error:
                result.errors[error] += 1
                continue
            result.latencies.append(time.perf_counter() - sent)
            result.completed += 1
            result.by_instance[instance] += 1
            result.by_model_instance[(model, instance)] += 1

    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        await asyncio.gather(*(user(session) for _ in range(users)))
    result.seconds = time.perf_counter() - start
    return result


async def _send(
    session: aiohttp.ClientSession, url: str, model: str, x: float, expected: float
) -> tuple[str, str]:
    """(the instance that answered, the error: "", the status, the exception's name, or
    "wrong answer" when the prediction is not within 0.05 of ``expected``)."""
    try:
        async with session.post(
            f"{url}/predictions/{model}", data=f"[[{x!r}]]", headers=HEADERS
        ) as response:
            body = await response.read()
            status = response.status
            instance = response.headers.get(INSTANCE_HEADER, "")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return "", type(exc).__name__
    if status != 200:
        return instance, str(status)
    return instance, "" if _answer_ok(body, expected) else "wrong answer"


def _answer_ok(body: bytes, expected: float) -> bool:
    try:
        (prediction,) = json.loads(body)["predictions"]
        return abs(float(prediction) - expected) < 0.05
    except (ValueError, KeyError, TypeError):
        return False
