"""The scheduling rules as tables: lanes, admission into a backend's pipe, measured cost, and
start-time fair queuing across models."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmserver.policy.scheduling import (
    CPU_CLOCK_ABOVE_S,
    HEAVY,
    LANE_DWELL_S,
    LIGHT,
    PIPELINE_BUDGET_S,
    Cost,
    Lane,
    RunQueue,
    admits,
    lane_bounds,
    lane_for,
    lane_now,
    may_move,
)

MS = 0.001


@pytest.mark.parametrize(
    ("current", "cost", "expected"),
    [
        (LIGHT, None, LIGHT),  # unknown cost: stays
        (HEAVY, None, HEAVY),
        (LIGHT, 0.05 * MS, LIGHT),
        (LIGHT, 2.0 * MS, LIGHT),  # at the threshold: not above it
        (LIGHT, 2.1 * MS, HEAVY),
        (LIGHT, 28 * MS, HEAVY),
        (HEAVY, 1.5 * MS, HEAVY),  # between half and the threshold: stays (hysteresis)
        (HEAVY, 1.0 * MS, HEAVY),
        (HEAVY, 0.9 * MS, LIGHT),
    ],
)
def test_lane_for(current: str, cost: float | None, expected: str) -> None:
    assert lane_for(current, cost, 2 * MS) == expected


def test_lane_for_with_no_threshold_never_moves() -> None:
    assert lane_for(LIGHT, 1.0, 0.0) == LIGHT
    assert lane_bounds(LIGHT, 0.0) == (-math.inf, math.inf)


def test_lane_bounds() -> None:
    assert lane_bounds(LIGHT, 2 * MS) == (-math.inf, 2 * MS)
    assert lane_bounds(HEAVY, 2 * MS) == (1 * MS, math.inf)


@pytest.mark.parametrize(
    ("inflight", "pipe", "estimate", "expected"),
    [
        (0, 0.0, math.inf, True),  # an idle process takes anything
        (0, 0.0, 0.5, True),
        (1, 0.1 * MS, 0.1 * MS, True),  # cheap behind cheap
        (3, 0.5 * MS, 0.5 * MS, True),  # exactly the budget
        (3, 0.5 * MS, 0.6 * MS, False),
        (1, 0.1 * MS, 28 * MS, False),  # nothing long goes behind anything
        (1, 28 * MS, 0.1 * MS, False),  # nothing goes behind something long
        (1, math.inf, 0.1 * MS, False),  # nor behind a load or an unmeasured model
        (1, 0.1 * MS, math.inf, False),
    ],
)
def test_admits(inflight: int, pipe: float, estimate: float, expected: bool) -> None:
    assert PIPELINE_BUDGET_S == 1 * MS
    assert admits(inflight, pipe, estimate) is expected


def test_cost_averages_per_batch_and_hold() -> None:
    cost = Cost()
    assert cost.estimate == math.inf and cost.single == math.inf
    cost.observe(cpu_seconds=0.010, wall_seconds=0.004, rows=10)  # computed in threads
    assert (cost.per_batch, cost.hold, cost.single) == (0.010, 0.010, 0.010)
    assert cost.per_row == pytest.approx(0.001)  # one size: a row's share
    cost.observe(cpu_seconds=0.0, wall_seconds=0.020, rows=1)  # waited on something
    assert cost.hold == pytest.approx(0.010 + 0.2 * (0.020 - 0.010))
    assert cost.per_batch == pytest.approx(0.8 * 0.010)
    assert (cost.batches, cost.cpu_seconds) == (2, 0.010)
    assert cost.estimate == cost.hold
    # What a request costs is CPU time: the wait is in the hold only.
    assert cost.single < 0.010


#: A batch: CPU seconds, how its wall time compares (equal: the CPU clock was not read), rows,
#: requests, and what it was charged; or a probe row's seconds.
_batches = st.one_of(
    st.tuples(
        st.one_of(
            st.floats(1e-6, 0.05),
            # At the bound of a batch whose CPU time is not known, and just past it.
            st.sampled_from([CPU_CLOCK_ABOVE_S, math.nextafter(CPU_CLOCK_ABOVE_S, 1.0)]),
        ),
        st.sampled_from([1.0, 1.0, 1.3, 0.7]),
        st.sampled_from([0, 1, 1, 1, 2, 7]),
        st.sampled_from([0, 1, 1, 1, 2, 3]),
        st.one_of(st.none(), st.floats(0.0, 0.01)),
    ),
    st.floats(1e-6, 0.01),
)


@settings(max_examples=300, deadline=None, database=None)
@example(  # one-row batches, one whose CPU time is not known, then a larger one
    known=None,
    batches=[(1e-4, 1.0, 1, 1, None), (9e-4, 1.0, 1, 1, 1e-4), (2e-4, 1.3, 7, 2, 2e-4)],
)
@given(known=st.one_of(st.none(), st.floats(1e-6, 0.05)), batches=st.lists(_batches, max_size=40))
def test_the_short_way_of_one_row_batches_gives_the_general_numbers(
    known: float | None, batches: list[tuple[float, float, int, int, float | None] | float]
) -> None:
    """A model whose batches are all one request of one row has its averages and fit updated
    the short way; every number comes out as the general way makes it, bit for bit, and a
    larger batch later carries on from the same state."""
    short, general = Cost(known), Cost(known)
    general._unit = False  # the general way from the start
    for batch in batches:
        for cost in (short, general):
            if isinstance(batch, float):
                cost.set_probe(batch)
            else:
                cpu, wall, rows, requests, charged = batch
                cost.observe(cpu, cpu * wall, rows, requests, charged)
        for name in Cost.__slots__:
            if name != "_unit":
                assert getattr(short, name) == getattr(general, name), name
        assert short.charge(3) == general.charge(3)


def test_a_remembered_cost_is_the_first_estimate() -> None:
    cost = Cost(0.028)
    assert (cost.estimate, cost.single, cost.charge(1)) == (0.028, 0.028, 0.028)


def test_a_probe_is_the_first_estimate_and_batches_average_into_it() -> None:
    cost = Cost()
    cost.set_probe(0.010)
    assert cost.estimate == 0.010 and cost.single == 0.010 and cost.per_batch is None
    cost.observe(cpu_seconds=0.020, wall_seconds=0.0201, rows=1)
    assert cost.estimate == pytest.approx(0.01202) and cost.per_batch == 0.020
    assert cost.single == pytest.approx(0.012)


def test_a_batch_whose_cpu_clock_was_not_read_and_ran_long_is_not_counted() -> None:
    """The backend reports a short batch's wall time as its CPU time (the two equal). One that
    ran long all the same (preempted by another program) says nothing of the model's CPU: it is
    left out, unless nothing else is known of the model."""
    cost = Cost()
    cost.set_probe(0.2 * MS)
    cost.observe(cpu_seconds=9 * MS, wall_seconds=9 * MS, rows=1)
    assert cost.single == 0.2 * MS and cost.cpu_seconds == 9 * MS and cost.batches == 1
    cost.observe(cpu_seconds=0.4 * MS, wall_seconds=0.4 * MS, rows=1)  # short: counted
    assert cost.single == pytest.approx(0.2 * MS + 0.2 * 0.2 * MS)
    unknown = Cost()  # a handler with no probe: its first batch is all there is
    unknown.observe(cpu_seconds=30 * MS, wall_seconds=30 * MS, rows=1)
    assert unknown.single == 30 * MS


def test_a_batch_whose_cpu_time_is_not_known_still_counts_its_rows() -> None:
    """Its CPU time is left out, but its rows count: a request's share of the mean batch
    follows the rows per request."""
    cost = Cost()
    cost.observe(cpu_seconds=0.4 * MS, wall_seconds=0.4 * MS, rows=4)  # short: known
    assert cost.single == pytest.approx(0.4 * MS)  # one request of four rows
    cost.observe(cpu_seconds=9 * MS, wall_seconds=9 * MS, rows=1)  # long, unread: not known
    assert cost.rows_per_request == pytest.approx(3.4)
    assert cost.single == pytest.approx(0.4 * MS * 3.4 / 4)


def test_run_queue_orders_by_tag_then_arrival() -> None:
    queue: RunQueue[str] = RunQueue()
    for tag, item in ((2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "first")):
        queue.push(tag, item)
    assert queue.peek() == (0.5, "first")
    assert [queue.pop_first()[1] for _ in range(len(queue))] == ["first", "a", "b", "c"]
    assert not queue
    queue.push(1.0, "x")
    assert queue.pop_first() == (1.0, "x") and not queue


def _serve(costs: dict[str, float], batches: int) -> list[str]:
    """Run ``batches`` batches on one slot, every model always having one more to run: the
    order start-time fair queuing gives them."""
    lane = Lane(LIGHT)
    models = {name: Cost(hold) for name, hold in costs.items()}
    queue: RunQueue[str] = RunQueue()
    for name, cost in models.items():
        queue.push(lane.tag(cost), name)
    order = []
    for _ in range(batches):
        tag, name = queue.pop_first()
        lane.charge(tag, models[name], models[name].charge(1))
        order.append(name)
        queue.push(lane.tag(models[name]), name)
    return order


def test_fair_queuing_shares_time_not_turns() -> None:
    # A 4 ms model and a 0.1 ms one, both with deep queues: the cheap one runs 40 batches for
    # every batch of the expensive one, so each gets half of the time.
    order = _serve({"costly": 4 * MS, "cheap": 0.1 * MS}, 164)
    assert order.count("costly") == 4
    assert order[0] == "costly" and "costly" not in order[1:40]


def test_fair_queuing_of_equal_models_is_round_robin() -> None:
    assert _serve({"a": MS, "b": MS, "c": MS}, 6) == ["a", "b", "c", "a", "b", "c"]


def test_an_idle_model_earns_no_credit() -> None:
    lane = Lane(LIGHT)
    busy, idle = Cost(MS), Cost(MS)
    for _ in range(100):
        lane.charge(lane.tag(busy), busy, busy.charge(1))
    # The model that was idle starts at the lane's clock, not 100 batches ahead of the other.
    assert lane.tag(idle) == lane.vtime
    assert lane.tag(busy) - lane.tag(idle) == pytest.approx(MS)


def _batches(
    cost: Cost, fixed: float, per_row: float, sizes: list[int], rows_per_request: int = 1
) -> None:
    """Batches of ``sizes`` requests of ``rows_per_request`` rows each, costing ``fixed`` plus
    ``per_row`` a row of CPU time (read from the CPU clock: a wall time a little longer)."""
    for requests in sizes:
        rows = requests * rows_per_request
        cpu = fixed + per_row * rows
        cost.observe(cpu, cpu * 1.01, rows, requests)


def test_a_popular_cheap_model_is_judged_by_its_request() -> None:
    """Batches of 1 to 64 one-row requests of a model costing 0.3 ms plus 0.05 ms a row: its
    batches take up to 3.5 ms, yet a request alone would take 0.35 ms, and that chooses its
    lane."""
    cost = Cost()
    _batches(cost, 0.3 * MS, 0.05 * MS, [1, 8, 64, 32, 2, 48, 16, 64, 4, 64] * 20)
    assert cost.per_batch is not None and cost.per_batch > 2 * MS
    assert cost.single == pytest.approx(0.35 * MS, rel=0.01)
    assert lane_for(LIGHT, cost.single, 2 * MS) == LIGHT


@pytest.mark.parametrize(
    ("fixed", "per_row", "sizes", "rows", "single"),
    [
        (20 * MS, 0.0, [1, 4, 2, 8] * 20, 1, 20 * MS),  # a fixed cost: heavy whatever the size
        (0.0, 5 * MS, [1, 4, 2, 8] * 20, 1, 5 * MS),  # costly rows
        (0.2 * MS, 1 * MS, [1] * 50, 1, 1.2 * MS),  # one request at a time: the batch itself
        (0.0, 0.1 * MS, [10] * 50, 1, 0.1 * MS),  # one size: a request's share of the batch
        # Requests of 1,000 cheap rows are charged for 1,000 rows, alone or batched.
        (0.2 * MS, 0.04 * MS, [1] * 50, 1000, 40.2 * MS),
        (0.2 * MS, 0.04 * MS, [1, 3, 2, 1, 4] * 10, 1000, 40.2 * MS),
        (0.2 * MS, 0.04 * MS, [2] * 50, 1000, 40.1 * MS),  # one size: a request's share
    ],
)
def test_request_cost(
    fixed: float, per_row: float, sizes: list[int], rows: int, single: float
) -> None:
    cost = Cost()
    _batches(cost, fixed, per_row, sizes, rows)
    assert cost.rows_per_request == pytest.approx(rows)
    assert cost.single == pytest.approx(single, rel=0.01)


def test_request_cost_before_batches_and_with_a_probe() -> None:
    assert Cost().single == math.inf
    assert Cost(3 * MS).single == 3 * MS  # remembered from an earlier load
    cost = Cost()
    cost.set_probe(20 * MS)  # a 20 ms model whose batches keep ten requests
    assert cost.single == 20 * MS
    _batches(cost, 20 * MS, 0.0, [10] * 50)
    assert cost.single == pytest.approx(20 * MS, rel=0.01)


def test_the_charge_is_a_batch_at_its_size() -> None:
    """A batch is charged the fixed part and its rows, not the mean batch: four requests of
    1,000 rows cost about four of one; a model with only a fixed cost is charged that at any
    size; nothing known yet: the pipeline budget."""
    rows = Cost()
    _batches(rows, 0.2 * MS, 0.04 * MS, [1, 3, 2, 1, 4] * 10, 1000)
    assert rows.charge(1) == pytest.approx(40.2 * MS, rel=0.01)
    assert rows.charge(4) == pytest.approx(160.2 * MS, rel=0.01)
    fixed = Cost()
    _batches(fixed, 20 * MS, 0.0, [1, 4, 2, 8] * 20)
    assert fixed.charge(1) == pytest.approx(fixed.charge(8)) == pytest.approx(20 * MS)
    assert Cost().charge(3) == PIPELINE_BUDGET_S


def test_a_batch_is_charged_in_the_end_what_it_took() -> None:
    lane = Lane(LIGHT)
    cost = Cost(1 * MS)
    tag = lane.tag(cost)
    charged = cost.charge(2)
    lane.charge(tag, cost, charged)
    assert cost.vfinish == tag + 2 * MS
    cost.observe(cpu_seconds=5 * MS, wall_seconds=5.1 * MS, rows=2, requests=2, charged=charged)
    assert cost.vfinish == pytest.approx(tag + 5 * MS)


def test_one_slow_first_batch_does_not_outweigh_the_probe() -> None:
    """A light model's first batch slowed by a busy machine is left out (its CPU clock was not
    read); one whose CPU time was read moves the cost by its weight, not past the heavy
    threshold; a heavy model's probe keeps it heavy."""
    light = Cost()
    light.set_probe(0.05 * MS)
    light.observe(cpu_seconds=4 * MS, wall_seconds=4 * MS, rows=1)
    assert light.single == 0.05 * MS
    light.observe(cpu_seconds=4 * MS, wall_seconds=4.1 * MS, rows=1)
    assert light.single == pytest.approx(0.05 * MS + 0.2 * (4 - 0.05) * MS)
    assert lane_now(LIGHT, light.single, 2 * MS, 0.0, -math.inf) == LIGHT
    heavy = Cost()
    heavy.set_probe(20 * MS)
    heavy.observe(cpu_seconds=20 * MS, wall_seconds=21 * MS, rows=1)
    assert lane_now(LIGHT, heavy.single, 2 * MS, 0.0, -math.inf) == HEAVY


#: A batch as a backend reports it: CPU seconds, wall seconds, rows, requests.
Batch = tuple[float, float, int, int]


def _lanes(probe: float | None, batches: list[Batch], every_s: float) -> tuple[str, list[float]]:
    """Run ``batches``, one every ``every_s`` seconds, through a model's cost and lane as its
    pool does (in the light lane at first; its probe, if any, timed at load): its lane at the
    end and when it moved."""
    cost, lane, moved_at, moves = Cost(), LIGHT, -math.inf, []
    if probe is not None:
        cost.set_probe(probe)
        lane = lane_now(lane, cost.single, 2 * MS, 0.0, moved_at)
    for i, (cpu, wall, rows, requests) in enumerate(batches):
        now = i * every_s
        cost.observe(cpu, wall, rows, requests)
        moved = lane_now(lane, cost.single, 2 * MS, now, moved_at)
        if moved != lane:
            lane, moved_at = moved, now
            moves.append(now)
    return lane, moves


def _backend(
    cpus: list[float], walls: list[float], rows: list[int], requests: list[int]
) -> list[Batch]:
    """The batches as a backend reports them: a batch after a short one (wall time at most
    :data:`CPU_CLOCK_ABOVE_S`) has its wall time reported as its CPU time."""
    out: list[Batch] = []
    long = False
    for cpu, wall, n, k in zip(cpus, walls, rows, requests, strict=True):
        out.append((cpu, wall, n, k) if long else (wall, wall, n, k))
        long = wall > CPU_CLOCK_ABOVE_S
    return out


def _noise(i: int) -> float:
    """A deterministic factor between 0.8 and 1.2."""
    return 0.8 + 0.4 * ((i * 7919) % 101) / 100


def test_a_model_of_only_large_requests_goes_heavy_and_stays() -> None:
    """Requests of 1,000 rows of a model whose one row costs 0.04 ms (its probe: 0.05 ms), one to
    four to a batch, 20 % noise, five minutes at ten batches a second: it moves once, to the
    heavy lane, and stays there."""
    sizes = [1 + (i * 37) % 4 for i in range(3000)]
    cpus = [(0.2 + 40 * k) * MS * _noise(i) for i, k in enumerate(sizes)]
    batches = _backend(cpus, [c * 1.05 for c in cpus], [1000 * k for k in sizes], sizes)
    lane, moves = _lanes(0.05 * MS, batches, 0.1)
    assert lane == HEAVY and moves == [0.1]  # its first batch's CPU time was not read


def test_a_cheap_model_whose_batches_grow_stays_light() -> None:
    """One-row requests of a 0.3 ms + 0.05 ms a row model, its batches growing from 1 to 64
    requests as its traffic rises (3.5 ms each), then falling again: it never moves."""
    sizes = [min(64, 1 + i // 10) for i in range(700)] + [max(1, 64 - i // 10) for i in range(700)]
    cpus = [(0.3 + 0.05 * k) * MS * _noise(i) for i, k in enumerate(sizes)]
    batches = _backend(cpus, cpus, sizes, sizes)
    assert _lanes(0.3 * MS, batches, 0.05) == (LIGHT, [])


def test_a_busy_machine_does_not_move_a_cheap_model() -> None:
    """A 0.2 ms model on a machine another program keeps busy: a third of its batches are
    preempted, their wall time 3 to 30 ms, their CPU time unchanged. It stays light; a lane
    decided on wall time would have moved it."""
    walls = [(3 + i % 28) * MS if i % 3 == 0 else 0.2 * MS * _noise(i) for i in range(3000)]
    cpus = [0.2 * MS * _noise(i) for i in range(3000)]
    batches = _backend(cpus, walls, [1] * 3000, [1] * 3000)
    assert _lanes(0.2 * MS, batches, 0.02) == (LIGHT, [])
    by_wall = [(wall, wall * 1.01, n, k) for _, wall, n, k in batches]
    assert _lanes(0.2 * MS, by_wall, 0.02)[1]


def test_a_cost_near_the_threshold_moves_a_model_at_most_once_a_minute() -> None:
    """A model whose requests take 0.8 ms then 3 ms of CPU, by turns of five seconds, for ten
    minutes: near the threshold, it moves at most once per :data:`LANE_DWELL_S`."""
    cpus = [(0.8 if (i // 50) % 2 else 3.0) * MS for i in range(6000)]
    batches = [(c, c * 1.01, 1, 1) for c in cpus]
    _, moves = _lanes(None, batches, 0.1)
    assert moves and all(b - a >= LANE_DWELL_S for a, b in itertools.pairwise(moves))
    assert len(moves) <= 600 / LANE_DWELL_S + 1


@pytest.mark.parametrize(
    ("cost", "in_lane", "expected"),
    [
        (20 * MS, 0.0, True),  # clearly heavy: at once
        (0.4 * MS, 0.0, True),  # clearly light: at once
        (2.5 * MS, 0.0, False),  # near the threshold: not right after a move
        (0.9 * MS, 3.0, False),
        (2.5 * MS, LANE_DWELL_S, True),  # ... but once it has stayed a while
        (0.9 * MS, math.inf, True),  # never moved
    ],
)
def test_may_move(cost: float, in_lane: float, expected: bool) -> None:
    assert may_move(cost, 2 * MS, in_lane) == expected


NOW = 1000.0
NEVER = -math.inf


@pytest.mark.parametrize(
    ("current", "cost", "moved_at", "expected"),
    [
        (LIGHT, 0.5 * MS, NEVER, LIGHT),  # cheap: stays
        (LIGHT, 2.0 * MS, NEVER, LIGHT),  # at the threshold: not above it
        (LIGHT, 2.5 * MS, NEVER, HEAVY),  # never moved: moves
        (LIGHT, 2.5 * MS, NOW - 1.0, LIGHT),  # near the threshold, just moved: stays a while
        (LIGHT, 2.5 * MS, NOW - LANE_DWELL_S, HEAVY),  # ... then moves
        (LIGHT, 20 * MS, NOW, HEAVY),  # clearly heavy: at once, even right after a move
        (HEAVY, 1.5 * MS, NEVER, HEAVY),  # between half and the threshold: stays
        (HEAVY, 0.9 * MS, NEVER, LIGHT),
        (HEAVY, 0.9 * MS, NOW - 3.0, HEAVY),  # near the threshold, just moved
        (HEAVY, 0.4 * MS, NOW, LIGHT),  # clearly light: at once
        (HEAVY, 30 * MS, NOW, HEAVY),  # where it belongs, however recently it came
    ],
)
def test_lane_now(current: str, cost: float, moved_at: float, expected: str) -> None:
    assert lane_now(current, cost, 2 * MS, NOW, moved_at) == expected


def test_lane_now_without_a_heavy_lane() -> None:
    assert lane_now(LIGHT, 5.0, 0.0, NOW, NEVER) == LIGHT
