"""The stress tools' load, every request recorded: the package's closed-loop users
(:func:`mmserver.commands.loadtest.users.closed_loop`), each answer checked against its model's
baseline.

It measures stability, not speed (``scripts/bench`` does that), so it keeps every status, error
type and latency. Single requests beside the load (learning a model's baseline, checking every
model after the chaos, reading ``/metrics``) go through an aiohttp session of the caller's.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from mmserver.commands.loadtest import users

JSON = {"Content-Type": "application/json"}
_FEATURES = re.compile(r"expects (\d+) feature")


@dataclass
class Outcome:
    """What one request got."""

    model: str
    status: int  # 0: no HTTP answer (connection error or client timeout)
    error: str  # the error body's "type", or the client exception's name; "" on success
    seconds: float
    at: float  # time.monotonic() when it was answered
    wrong: bool = False  # a 200 whose answer differs from the model's baseline
    answer: Any = None  # the wrong answer, to show it


@dataclass
class Record:
    """Every outcome, for reports."""

    outcomes: list[Outcome] = field(default_factory=list)

    def by_status(self, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        counts: Counter[str] = Counter()
        for o in self.outcomes:
            if since <= o.at < until:
                counts[f"{o.status} {o.error}".strip() if o.status != 200 else "200"] += 1
        return counts


def p99(seconds: list[float]) -> float:
    if not seconds:
        return 0.0
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Probes:
    """One request body per model, with the answer the model gave to it (its baseline).

    A model's number of features is learnt from its 400 answer ("expects N feature(s)"), so any
    store can be probed without knowing its models.
    """

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}
        self.answers: dict[str, Any] = {}

    async def learn(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        body = b"[[0.5]]"
        for _ in range(2):
            async with session.post(f"{url}/predictions/{model}", data=body, headers=JSON) as r:
                data = json.loads(await r.read())
                if r.status == 200:
                    self.bodies[model] = body
                    self.answers[model] = data["predictions"]
                    return
                match = _FEATURES.search(data.get("message", "")) if r.status == 400 else None
                if match is None:
                    raise RuntimeError(f"model {model} answered {r.status}: {data}")
                body = json.dumps([[0.5] * int(match.group(1))]).encode()
        raise RuntimeError(f"model {model}: could not find its number of features")

    def body(self, model: str) -> bytes:
        return self.bodies.get(model, b"[[0.5]]")

    def is_right(self, model: str, answer: Any) -> bool:
        expected = self.answers.get(model)
        return expected is None or same(answer, expected)


def same(a: Any, b: Any) -> bool:
    """Equal answers, floats to 1e-9 relative: a row predicted within a batch may differ from
    the same row predicted alone in its last bits (BLAS sums a matrix product differently)."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool):
            return False  # a float is never a boolean
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    equal: bool = a == b
    return equal


def judge(
    model: str, status: int, error: str, raw: bytes, seconds: float, at: float, probes: Probes
) -> Outcome:
    """The outcome of a request to ``model``: answered ``status`` with body ``raw`` (or not
    answered: status 0 and the connection ``error``)."""
    if not status:
        return Outcome(model, 0, error, seconds, at)
    try:
        data = json.loads(raw)
    except ValueError:
        return Outcome(model, status, "NotJSON", seconds, at)
    if status == 200:
        answer = data.get("predictions")
        if probes.is_right(model, answer):
            return Outcome(model, 200, "", seconds, at)
        return Outcome(model, 200, "WrongAnswer", seconds, at, True, answer)
    return Outcome(model, status, str(data.get("type", "?")), seconds, at)


async def one(
    session: aiohttp.ClientSession, url: str, model: str, probes: Probes, timeout: float
) -> Outcome:
    """One request to ``model``, on its own."""
    start = time.monotonic()
    try:
        async with session.post(
            f"{url}/predictions/{model}",
            data=probes.body(model),
            headers=JSON,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            raw = await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        now = time.monotonic()
        return Outcome(model, 0, type(exc).__name__, now - start, now)
    now = time.monotonic()
    return judge(model, status, "", raw, now - start, now, probes)


async def run_load(
    url: str,
    choose: Callable[[], str],
    probes: Probes,
    record: Record,
    *,
    concurrency: int,
    until: float,
    max_requests: int,
    stop: asyncio.Event | None = None,
    timeout: float = 30.0,
) -> None:
    """``concurrency`` users sending one request at a time each, to the model ``choose()``
    picks, until ``until`` (time.monotonic()), ``max_requests`` in all, or ``stop`` is set."""
    host, port = users.loopback(url)

    def next_request(rng: random.Random) -> tuple[bytes, str]:
        model = choose()
        path = f"/predictions/{model}"
        return users.request("POST", path, probes.body(model), JSON, host=host, port=port), model

    def answered(model: str, outcome: users.Outcome) -> None:
        record.outcomes.append(
            judge(
                model,
                outcome.status,
                outcome.error,
                outcome.body,
                outcome.seconds,
                time.monotonic(),
                probes,
            )
        )

    await users.closed_loop(
        url,
        concurrency,
        next_request,
        answered,
        duration_s=max(0.0, until - time.monotonic()),
        max_requests=max_requests,
        timeout_s=timeout,
        stop=stop,
    )


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` as sums per family (labels summed away)."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return sums
