"""Jobs, the bounded queue, batch collection, and answering a batch where the model runs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mmserver import errors
from mmserver.batching import Job, JobQueue, answer_batch, collect_batch, partition_live, split
from mmserver.codecs import make_request
from tests.models import outputs, rows


def job(values: list[list[float]], enqueued_at: float = 0.0, deadline: float = 1e9,
        gone: bool = False) -> Job:
    future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    return Job(rows(values), future, enqueued_at, deadline,
               (lambda: True) if gone else None)


async def test_full_queue_refuses_at_once() -> None:
    queue = JobQueue(2)
    queue.put(job([[1.0]]))
    queue.put(job([[2.0]]))
    with pytest.raises(errors.QueueFull) as info:
        queue.put(job([[3.0]]))
    assert info.value.status_code == 503
    assert info.value.headers() == {"Retry-After": "1"}
    assert "2 jobs waiting" in info.value.message
    assert len(queue) == 2


async def test_get_waits_for_a_put_and_times_out_empty() -> None:
    queue = JobQueue(10)
    waiting = asyncio.ensure_future(queue.get(None))
    await asyncio.sleep(0)
    first = job([[1.0]])
    queue.put(first)
    assert await waiting is first
    assert await queue.get(0.001) is None


async def test_close_wakes_waiters_and_refuses_new_jobs() -> None:
    queue = JobQueue(10)
    waiting = asyncio.ensure_future(queue.get(None))
    await asyncio.sleep(0)
    queue.close()
    assert await waiting is None
    with pytest.raises(errors.ShuttingDown):
        queue.put(job([[1.0]]))


async def test_cancelled_waiter_passes_its_wake_up_on() -> None:
    queue = JobQueue(10)
    a = asyncio.ensure_future(queue.get(None))
    b = asyncio.ensure_future(queue.get(None))
    await asyncio.sleep(0)
    queued = job([[1.0]])
    queue.put(queued)  # wakes a
    a.cancel()
    await asyncio.gather(a, return_exceptions=True)
    assert await asyncio.wait_for(b, 1) is queued


async def test_collect_takes_what_is_queued_up_to_batch_size() -> None:
    queue = JobQueue(10)
    jobs = [job([[float(i)]]) for i in range(5)]
    for j in jobs[1:]:
        queue.put(j)
    batch = [jobs[0]]
    await collect_batch(queue, batch, 3, 10.0, lambda: 0.0)
    assert batch == jobs[:3]
    assert len(queue) == 2


async def test_collect_stops_at_the_delay_after_the_first_job() -> None:
    queue = JobQueue(10)
    first = job([[1.0]], enqueued_at=100.0)
    batch = [first]
    # The clock already says the delay has passed: no wait, the batch goes as it is.
    await collect_batch(queue, batch, 8, 0.05, lambda: 100.06)
    assert batch == [first]


async def test_collect_waits_within_the_delay_for_more_jobs() -> None:
    loop = asyncio.get_running_loop()
    queue = JobQueue(10)
    first = job([[1.0]], enqueued_at=loop.time())
    second = job([[2.0]])
    loop.call_soon(queue.put, second)
    batch = [first]
    await collect_batch(queue, batch, 2, 5.0, loop.time)
    assert batch == [first, second]


async def test_batch_size_one_never_waits() -> None:
    queue = JobQueue(10)
    batch = [job([[1.0]])]
    await collect_batch(queue, batch, 1, 100.0, lambda: 0.0)
    assert len(batch) == 1


async def test_partition_answers_expired_and_gone_jobs() -> None:
    live = job([[1.0]])
    expired = job([[2.0]], deadline=5.0)
    gone = job([[3.0]], gone=True)
    answered = job([[4.0]])
    answered.answer("done")
    assert partition_live([live, expired, gone, answered], now=10.0) == [live]
    with pytest.raises(errors.PredictTimeout):
        expired.future.result()
    with pytest.raises(errors.ClientGone) as info:
        gone.future.result()
    assert info.value.status_code == 504


def test_a_batch_is_one_call_and_each_request_gets_its_own_rows_back() -> None:
    calls: list[np.ndarray] = []

    def predict(batch: np.ndarray) -> np.ndarray:
        calls.append(batch)
        return batch[:, 0] * 10

    answers = answer_batch(
        [rows([[1.0], [2.0]]), rows([[3.0]]), rows([[4.0], [5.0], [6.0]])], predict, 1, "m"
    )
    assert len(calls) == 1 and calls[0].shape == (6, 1)
    assert [outputs(a) for a in answers] == [[10.0, 20.0], [30.0], [40.0, 50.0, 60.0]]
    assert split(["a", "b", "c"], [2, 1]) == [["a", "b"], ["c"]]


def test_a_bad_request_is_answered_alone_and_its_batch_goes_on() -> None:
    def predict(batch: np.ndarray) -> np.ndarray:
        return batch.sum(axis=1)

    answers = answer_batch(
        [
            rows([[1.0, 2.0]]),
            make_request(b"[[1, ", None, None),
            rows([[1.0, 2.0, 3.0]]),
            make_request(b"3,4\n", "text/csv", "text/csv"),
        ],
        predict, 2, "pair",
    )
    assert outputs(answers[0]) == [3.0]
    assert answers[1][0] == "InvalidInput" and "not valid JSON" in answers[1][1]
    assert answers[2] == ("InvalidInput", "model pair expects 2 feature(s) per row, got 3")
    assert answers[3] == b"7.0\n"


def test_without_a_known_width_each_width_is_its_own_call() -> None:
    widths: list[int] = []

    def predict(batch: np.ndarray) -> np.ndarray:
        widths.append(batch.shape[1])
        return batch.sum(axis=1)

    answers = answer_batch([rows([[1.0]]), rows([[1.0, 2.0]]), rows([[5.0]])], predict, None, "m")
    assert sorted(widths) == [1, 2]
    assert [outputs(a) for a in answers] == [[1.0], [3.0], [5.0]]


def test_a_model_error_is_the_whole_batch_s() -> None:
    def predict(batch: np.ndarray) -> list[float]:
        return [1.0]  # one output for two rows

    with pytest.raises(errors.ModelError, match="returned 1 outputs for 2 rows"):
        answer_batch([rows([[1.0]]), rows([[2.0]])], predict, 1, "m")


async def test_split_refuses_a_wrong_number_of_outputs() -> None:
    with pytest.raises(errors.ModelError, match="returned 2 outputs for 3 rows"):
        split([1, 2], [1, 2])
