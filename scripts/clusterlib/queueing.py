"""What queueing theory expects of the routing experiment, by simulation: the figures the
measured ones are compared with.

The model: ``instances`` FIFO queues, each with ``concurrency`` servers (an instance running
that many predictions at once); ``users`` closed-loop users with no think time; service times
lognormal (median and p99 given, capped as the experiment's model caps them). RANDOM sends each
request to a uniformly drawn instance; LEAST_OUTSTANDING_REQUESTS to one with the fewest
requests (running and waiting), ties broken at random. No network, no server overhead: the
gap between these figures and the measured ones is what the real stack adds.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

Z99 = 2.3263


@dataclass(frozen=True)
class Expected:
    p50_ms: float
    p99_ms: float
    throughput_per_instance: float


def simulate(
    instances: int,
    users: int,
    least_outstanding: bool,
    median_ms: float,
    p99_ms: float,
    concurrency: int = 1,
    completions: int = 200_000,
    cap_s: float = 5.0,
    seed: int = 1,
) -> Expected:
    """Run the model until ``completions`` requests are answered; the first 5 % are the
    start-up and are not measured. Each instance runs ``concurrency`` predictions at once."""
    rng = random.Random(seed)
    mu = math.log(median_ms / 1000)
    sigma = math.log(p99_ms / median_ms) / Z99
    waiting: list[deque[float]] = [deque() for _ in range(instances)]  # arrival times
    running = [0] * instances
    ends: list[tuple[float, int, float]] = []  # (prediction ends, instance, arrival time)
    latencies: list[float] = []

    def begin(now: float, instance: int, arrived: float) -> None:
        running[instance] += 1
        heapq.heappush(ends, (now + min(rng.lognormvariate(mu, sigma), cap_s), instance, arrived))

    def arrive(now: float) -> None:
        if least_outstanding:
            load = [running[i] + len(waiting[i]) for i in range(instances)]
            least = min(load)
            instance = rng.choice([i for i in range(instances) if load[i] == least])
        else:
            instance = rng.randrange(instances)
        if running[instance] < concurrency:
            begin(now, instance, now)
        else:
            waiting[instance].append(now)

    for _ in range(users):
        arrive(0.0)
    now, warm = 0.0, 0.0
    skip = completions // 20
    while len(latencies) < completions:
        now, instance, arrived = heapq.heappop(ends)
        latencies.append(now - arrived)
        if len(latencies) == skip:
            warm = now
        running[instance] -= 1
        if waiting[instance]:
            begin(now, instance, waiting[instance].popleft())
        arrive(now)
    kept = np.array(latencies[skip:])
    return Expected(
        p50_ms=float(np.percentile(kept, 50)) * 1000,
        p99_ms=float(np.percentile(kept, 99)) * 1000,
        throughput_per_instance=len(kept) / (now - warm) / instances,
    )
