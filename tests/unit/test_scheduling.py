"""The scheduling rules as tables: lanes, admission into a backend's pipe, measured cost, and
start-time fair queuing across models."""

from __future__ import annotations

import math

import pytest

from mmserver.policy.scheduling import (
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
    ("current", "hold", "expected"),
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
def test_lane_for(current: str, hold: float | None, expected: str) -> None:
    assert lane_for(current, hold, 2 * MS) == expected


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


def test_cost_averages_per_batch_per_row_and_hold() -> None:
    cost = Cost()
    assert cost.estimate == math.inf
    cost.observe(cpu_seconds=0.010, wall_seconds=0.004, rows=10)  # computed in threads
    assert (cost.per_batch, cost.per_row, cost.hold) == (0.010, 0.001, 0.010)
    cost.observe(cpu_seconds=0.0, wall_seconds=0.020, rows=1)  # waited on something
    assert cost.hold == pytest.approx(0.010 + 0.2 * (0.020 - 0.010))
    assert cost.per_batch == pytest.approx(0.8 * 0.010)
    assert cost.per_row == pytest.approx(0.8 * 0.001)
    assert (cost.batches, cost.cpu_seconds) == (2, 0.010)
    assert cost.estimate == cost.hold


def test_a_remembered_cost_is_the_first_estimate() -> None:
    assert Cost(0.028).estimate == 0.028


def test_a_probe_is_the_first_estimate_and_batches_average_into_it() -> None:
    cost = Cost()
    cost.set_probe(0.010)
    assert cost.estimate == 0.010 and cost.per_batch is None
    cost.observe(cpu_seconds=0.020, wall_seconds=0.020, rows=1)
    assert cost.estimate == pytest.approx(0.012) and cost.per_batch == 0.020


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
        lane.charge(tag, models[name])
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
        lane.charge(lane.tag(busy), busy)
    # The model that was idle starts at the lane's clock, not 100 batches ahead of the other.
    assert lane.tag(idle) == lane.vtime
    assert lane.tag(busy) - lane.tag(idle) == pytest.approx(MS)


def _batches(cost: Cost, fixed: float, per_row: float, sizes: list[int]) -> None:
    for rows in sizes:
        held = fixed + per_row * rows
        cost.observe(cpu_seconds=held, wall_seconds=held, rows=rows)


def test_a_popular_cheap_model_is_judged_by_its_one_row_batch() -> None:
    """Batches of 1 to 64 rows of a model costing 0.3 ms plus 0.05 ms a row: its batches hold a
    process up to 3.5 ms, yet a one-row batch would take 0.35 ms, and that chooses its lane."""
    cost = Cost()
    _batches(cost, 0.3 * MS, 0.05 * MS, [1, 8, 64, 32, 2, 48, 16, 64, 4, 64] * 20)
    assert cost.estimate > 2 * MS  # the batches themselves hold a process long
    assert cost.single == pytest.approx(0.35 * MS, rel=0.01)
    assert lane_for(LIGHT, cost.single, 2 * MS) == LIGHT


@pytest.mark.parametrize(
    ("fixed", "per_row", "sizes", "single"),
    [
        (20 * MS, 0.0, [1, 4, 2, 8] * 20, 20 * MS),  # a fixed cost: heavy whatever the size
        (0.0, 5 * MS, [1, 4, 2, 8] * 20, 5 * MS),  # costly rows
        (0.2 * MS, 1 * MS, [1] * 50, 1.2 * MS),  # one row at a time: the hold itself
        (0.0, 0.1 * MS, [10] * 50, 0.1 * MS),  # one size: a row's share of the hold
    ],
)
def test_one_row_hold(fixed: float, per_row: float, sizes: list[int], single: float) -> None:
    cost = Cost()
    _batches(cost, fixed, per_row, sizes)
    assert cost.single == pytest.approx(single, rel=0.01)


def test_one_row_hold_before_batches_and_with_a_probe() -> None:
    assert Cost().single == math.inf
    assert Cost(hold=3 * MS).single == 3 * MS  # remembered from an earlier load
    cost = Cost()
    cost.set_probe(20 * MS)  # a 20 ms model whose batches keep ten rows
    assert cost.single == 20 * MS
    _batches(cost, 20 * MS, 0.0, [10] * 50)
    assert cost.single == pytest.approx(20 * MS)


def test_one_slow_first_batch_does_not_outweigh_the_probe() -> None:
    """A light model's first batch preempted in a busy process (4 ms by the wall clock, where
    the probe's row took 0.05 ms) moves the one-row hold by its weight, not past the heavy
    threshold; a heavy model's probe keeps it heavy."""
    light = Cost()
    light.set_probe(0.05 * MS)
    light.observe(cpu_seconds=4 * MS, wall_seconds=4 * MS, rows=1)
    assert light.single == pytest.approx(0.05 * MS + 0.2 * (4 - 0.05) * MS)
    assert lane_now(LIGHT, light.single, 2 * MS, 0.0, -math.inf) == LIGHT
    heavy = Cost()
    heavy.set_probe(20 * MS)
    heavy.observe(cpu_seconds=20 * MS, wall_seconds=21 * MS, rows=1)
    assert lane_now(LIGHT, heavy.single, 2 * MS, 0.0, -math.inf) == HEAVY


@pytest.mark.parametrize(
    ("hold", "in_lane", "expected"),
    [
        (20 * MS, 0.0, True),  # clearly heavy: at once
        (0.4 * MS, 0.0, True),  # clearly light: at once
        (2.5 * MS, 0.0, False),  # near the threshold: not right after a move
        (0.9 * MS, 3.0, False),
        (2.5 * MS, LANE_DWELL_S, True),  # ... but once it has stayed a while
        (0.9 * MS, math.inf, True),  # never moved
    ],
)
def test_may_move(hold: float, in_lane: float, expected: bool) -> None:
    assert may_move(hold, 2 * MS, in_lane) == expected


NOW = 1000.0
NEVER = -math.inf


@pytest.mark.parametrize(
    ("current", "hold", "moved_at", "expected"),
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
def test_lane_now(current: str, hold: float, moved_at: float, expected: str) -> None:
    assert lane_now(current, hold, 2 * MS, NOW, moved_at) == expected


def test_lane_now_without_a_heavy_lane() -> None:
    assert lane_now(LIGHT, 5.0, 0.0, NOW, NEVER) == LIGHT
