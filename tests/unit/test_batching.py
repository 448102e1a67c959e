"""Jobs, the bounded queue, batch collection, and answering a batch where the model runs."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest

from mmserver import errors
from mmserver.backend.batching import Answer, answer_batch, rows_together, split
from mmserver.codecs.requests import Request, make_request
from mmserver.codecs.schema import Inputs, matrix_inputs
from mmserver.codecs.v2 import v2_request
from mmserver.serving.jobs import Job, JobQueue, partition_live
from tests.models import outputs, rows


def job(
    values: list[list[float]], enqueued_at: float = 0.0, deadline: float = 1e9, gone: bool = False
) -> Job:
    future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    return Job(rows(values), future, enqueued_at, deadline, (lambda: True) if gone else None)


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


async def test_take_holds_at_most_max_bytes_and_a_large_request_goes_alone() -> None:
    queue = JobQueue(20)
    small = [job([[1.0]] * 10) for _ in range(3)]  # 10 rows: 51 bytes each
    size = len(small[0].request[0])
    large = job([[2.0]] * 1000)
    for j in (*small, large, *small):
        queue.put(j)
    assert queue.take(16, max_bytes=2 * size) == small[:2]  # a third would pass the limit
    assert queue.take(16, max_bytes=2 * size) == small[2:]  # the large one does not fit behind
    assert queue.take(16, max_bytes=2 * size) == [large]  # alone, though over the limit
    assert queue.take(16, max_bytes=2 * size) == small[:2]
    assert queue.take(16, max_bytes=0) == small[2:] and len(queue) == 0  # 0: no limit


async def test_a_closed_queue_refuses_new_jobs_and_still_gives_its_own() -> None:
    queue = JobQueue(10)
    queued = job([[1.0]])
    queue.put(queued)
    queue.close()
    with pytest.raises(errors.ShuttingDown):
        queue.put(job([[2.0]]))
    assert queue.closed and queue.take(4) == [queued]


async def test_a_queue_closed_with_a_reason_refuses_with_it_until_reopened() -> None:
    queue = JobQueue(10)
    queue.close(lambda: errors.WorkersStopped("model m has no workers"))
    with pytest.raises(errors.WorkersStopped, match="model m has no workers"):
        queue.put(job([[1.0]]))
    assert len(queue) == 0
    queue.reopen()
    queue.put(job([[2.0]]))
    assert not queue.closed and len(queue) == 1


async def test_partition_answers_expired_and_gone_jobs() -> None:
    live = job([[1.0]])
    expired = job([[2.0]], deadline=5.0)
    gone = job([[3.0]], gone=True)
    answered = job([[4.0]])
    answered.settle(b"done")
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
        predict,
        2,
        "pair",
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


def v2(values: list[list[float]], outputs: list[str] | None = None, id_: str = "") -> Request:
    request: dict[str, object] = {
        "id": id_,
        "inputs": [
            {
                "name": "x",
                "shape": [len(values), len(values[0])],
                "datatype": "FP64",
                "data": values,
            }
        ],
    }
    if outputs is not None:
        request["outputs"] = [{"name": name} for name in outputs]
    return v2_request(json.dumps(request).encode(), None)


def v2_outputs(answer: Answer) -> dict[str, list[object]]:
    assert isinstance(answer, bytes)
    return {o["name"]: o["data"] for o in json.loads(answer)["outputs"]}


def test_v2_requests_share_a_call_per_output_and_get_theirs_back() -> None:
    calls: list[tuple[str | None, list[list[float]]]] = []

    def predict(batch: np.ndarray, output: str | None = None) -> np.ndarray:
        calls.append((output, batch.tolist()))
        return batch[:, 0] * (100 if output == "double" else 10)

    answers = answer_batch(
        [
            v2([[1.0]], id_="a"),
            rows([[2.0]]),
            v2([[3.0], [4.0]], ["double", "predict"], id_="b"),
            v2([[5.0]], ["nope"]),
            v2([[6.0, 7.0]]),
        ],
        predict,
        1,
        "m",
        ("predict", "double"),
    )
    assert sorted(calls, key=str) == sorted(
        [
            (None, [[2.0]]),  # the DJL request: a call of its own
            (None, [[1.0], [3.0], [4.0]]),
            ("double", [[3.0], [4.0]]),
        ],
        key=str,
    )
    assert json.loads(answers[0])["id"] == "a" and v2_outputs(answers[0]) == {"predict": [10.0]}
    assert outputs(answers[1]) == [20.0]
    assert v2_outputs(answers[2]) == {"double": [300.0, 400.0], "predict": [30.0, 40.0]}
    assert answers[3][0] == "InvalidInput" and "no output 'nope'" in answers[3][1]
    assert answers[4] == ("InvalidInput", "model m expects 1 feature(s) per row, got 2")


def _alone_and_together(
    requests: list[Request], inputs: Inputs | int | None
) -> tuple[list[Answer], list[Answer], int]:
    """The answers of ``requests`` as one batch, each request's answer alone, and how many
    calls the batch made to the model."""
    calls = 0

    def predict(batch: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        return np.asarray(batch)[:, 0] * 10 + 1

    together = answer_batch(requests, predict, inputs, "m")
    made = calls
    alone = [answer_batch([r], predict, inputs, "m")[0] for r in requests]
    return together, alone, made


def body(text: str, kind: str | None = None) -> Request:
    return make_request(text.encode(), kind, None)


def test_a_batch_of_json_rows_is_decoded_together_and_answered_as_each_alone() -> None:
    batch = [
        body("[[1]]"),
        body("[[2.5], [-3e2]]"),
        body("[[4]]", "application/json; charset=utf-8"),
        body("[[1e-3],[7],[8]]"),
    ]
    together = rows_together(batch, matrix_inputs(1, missing=False))
    assert together is not None
    matrix, counts = together
    assert matrix.dtype == np.float64 and matrix.flags.c_contiguous
    assert matrix[:, 0].tolist() == [1.0, 2.5, -300.0, 4.0, 0.001, 7.0, 8.0]
    assert counts == [1, 2, 1, 3]
    answers, alone, calls = _alone_and_together(batch, 1)
    assert calls == 1 and answers == alone
    assert [outputs(a) for a in answers][1] == [26.0, -2999.0]


@pytest.mark.parametrize(
    ("bodies", "inputs"),
    [
        # Bodies that would read as others' rows if they were parsed joined: each is its own.
        (["[[1]", "[2]]", "[[3]],[[4]]", "[[5]]", "[[6]],[[7]]"], 1),
        (["[[1]]", "[[true]]", "[[2]]"], 1),  # JSON booleans are not numbers
        (["[[1]]", '[["2"]]'], 1),  # strings
        (["[[1]]", "[[null]]"], matrix_inputs(1, missing=False)),
        (["[[1]]", "[[null]]", "[[NaN]]"], matrix_inputs(1, missing=True)),
        (["[[1]]", "[[NaN]]", "[[Infinity]]"], 1),
        (["[[1]]", "[[1, 2]]"], 1),  # the wrong width
        (["[[1]]", "[[1, 2]]", "[[3]]"], None),  # no known width: one call per width
        (["[[1]]", "[[]]"], None),
        (["[[1]]", "[[[1]]]"], None),  # nested too deep
        (["[[1]]", "[1, 2]"], 2),  # one row, not a list of rows
        (["[[1]]", '{"instances": [[2]]}'], 1),
        (["[[1]]", "[[99999999999999999999999]]"], 1),  # past int64: a float all the same
        (["[[1]]", " [[2]]"], 1),
        (["[[1]]", "[[2]]"], replace(matrix_inputs(1, missing=False), sagemaker_xgboost=True)),
    ],
)
def test_a_batch_holding_any_other_body_answers_each_as_alone(
    bodies: list[str], inputs: Inputs | int | None
) -> None:
    batch = [body(b) for b in bodies]
    answers, alone, _ = _alone_and_together(batch, inputs)
    assert answers == alone


def test_bodies_in_utf_16_or_of_other_types_are_not_decoded_together() -> None:
    utf16 = make_request("[[1]]".encode("utf-16"), None, None)
    csv = make_request(b"1\n2\n", "text/csv", None)
    for batch in ([body("[[1]]"), utf16], [body("[[1]]"), csv]):
        assert rows_together(batch, matrix_inputs(1, missing=False)) is None
        answers, alone, _ = _alone_and_together(batch, 1)
        assert answers == alone and all(isinstance(a, bytes) for a in answers)
