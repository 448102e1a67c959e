"""Jobs, the bounded queue, batch collection, and answering a batch where the model runs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mmserver import errors
from mmserver.batching import Job, JobQueue, answer_batch, partition_live, split
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


async def test_take_gives_up_to_count_jobs_in_order() -> None:
    queue = JobQueue(10)
    jobs = [job([[float(i)]]) for i in range(5)]
    for j in jobs:
        queue.put(j)
    assert queue.take(2) == jobs[:2]
    assert queue.oldest_enqueued_at() == jobs[2].enqueued_at
    assert queue.take(8) == jobs[2:]
    assert queue.take(3) == [] and len(queue) == 0


async def test_a_closed_queue_refuses_new_jobs_and_still_gives_its_own() -> None:
    queue = JobQueue(10)
    queued = job([[1.0]])
    queue.put(queued)
    queue.close()
    with pytest.raises(errors.ShuttingDown):
        queue.put(job([[2.0]]))
    assert queue.closed and queue.take(4) == [queued]


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
