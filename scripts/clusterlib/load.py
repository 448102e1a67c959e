"""Closed-loop users: each sends a request, waits for its answer, and sends the next one.

The users are the package's load generator's (:func:`mmserver.commands.loadtest.users.closed_loop`),
one kept-alive connection each. Two kinds of run:

- :func:`closed_loop` runs for a time: a warm-up (requests sent then are not measured), then a
  measured window; a request is measured when it is sent inside the window, and counts for
  throughput when its answer arrives inside it. No new request is sent after the window; those
  in flight then are awaited (each bounded by a timeout);
- :func:`closed_loop_list` sends a given list of requests (so two runs touch the same models),
  all measured, and stops early when a time limit passes.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mmserver.commands.loadtest import users as load_users

HEADERS = {"Content-Type": "application/json"}
INSTANCE_HEADER = "X-Mmserver-Instance"
#: The count's bound of a timed run: far above what its users send in its time.
MAX_REQUESTS = 10_000_000


@dataclass
class LoadResult:
    """What one run measured."""

    seconds: float
    latencies: list[float] = field(default_factory=list)  # s, requests sent in the window
    completed: int = 0  # answered 200 inside the window
    errors: Counter[str] = field(default_factory=Counter)  # status or connection error: count
    by_instance: Counter[str] = field(default_factory=Counter)  # X-Mmserver-Instance: count
    by_model_instance: Counter[tuple[str, str]] = field(default_factory=Counter)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")

    @property
    def throughput(self) -> float:
        return self.completed / self.seconds

    def instances_serving(self, model: str) -> int:
        return sum(1 for (m, _), n in self.by_model_instance.items() if m == model and n)

    def add(self, model: str, outcome: load_users.Outcome, expected: float) -> bool:
        """Count one request's outcome; whether it was answered right."""
        error = _error(outcome, expected)
        if error:
            self.errors[error] += 1
            return False
        instance = outcome.header(INSTANCE_HEADER)
        self.latencies.append(outcome.seconds)
        self.by_instance[instance] += 1
        self.by_model_instance[(model, instance)] += 1
        return True


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
    host, port = load_users.loopback(url)
    result = LoadResult(seconds=duration)
    start = time.perf_counter() + warmup
    end = start + duration

    def next_request(rng: random.Random) -> tuple[bytes, tuple[str, float]]:
        model, x = choose(rng)
        return _request(host, port, model, x), (model, x)

    def answered(sent: tuple[str, float], outcome: load_users.Outcome) -> None:
        model, x = sent
        if outcome.sent < start:
            return
        if result.add(model, outcome, expect(x)) and outcome.answered <= end:
            result.completed += 1

    await load_users.closed_loop(
        url,
        users,
        next_request,
        answered,
        duration_s=warmup + duration,
        max_requests=MAX_REQUESTS,
        timeout_s=timeout,
        seed=seed,
    )
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
    host, port = load_users.loopback(url)
    result = LoadResult(seconds=0.0)
    todo = iter(models)

    def next_request(rng: random.Random) -> tuple[bytes, str] | None:
        model = next(todo, None)
        return None if model is None else (_request(host, port, model, x), model)

    def answered(model: str, outcome: load_users.Outcome) -> None:
        if result.add(model, outcome, expected):
            result.completed += 1

    start = time.perf_counter()
    await load_users.closed_loop(
        url,
        users,
        next_request,
        answered,
        duration_s=time_limit,
        max_requests=len(models),
        timeout_s=timeout,
    )
    result.seconds = time.perf_counter() - start
    return result


def _request(host: str, port: int, model: str, x: float) -> bytes:
    body = f"[[{x!r}]]".encode()
    return load_users.request("POST", f"/predictions/{model}", body, HEADERS, host=host, port=port)


def _error(outcome: load_users.Outcome, expected: float) -> str:
    """ "" for a right answer; else the connection error, the status, or "wrong answer" when
    the prediction is not within 0.05 of ``expected``."""
    if outcome.error:
        return outcome.error
    if outcome.status != 200:
        return str(outcome.status)
    return "" if _answer_ok(outcome.body, expected) else "wrong answer"


def _answer_ok(body: bytes, expected: float) -> bool:
    try:
        (prediction,) = json.loads(body)["predictions"]
        return abs(float(prediction) - expected) < 0.05
    except (ValueError, KeyError, TypeError):
        return False
