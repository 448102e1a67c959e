"""Frames on a process's pipe (:mod:`mmserver.procs.framing`): the backend's reader takes the frames
one recv brought one at a time, and a frame split across reads whole."""

from __future__ import annotations

import pickle
import socket

import pytest

from mmserver.procs.framing import FrameReader, frame, send_frame


def test_the_reader_takes_frames_whole_across_reads() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = FrameReader(ours)
        first, second = frame((1, "a")), frame((2, "b" * 100))
        send_frame(theirs, first + second + [second[0], second[1][:10]])
        assert reader.read() == first[1]  # one recv brings every frame sent
        assert pickle.loads(reader.read() or b"") == (2, "b" * 100)
        theirs.sendall(second[1][10:])
        assert pickle.loads(reader.read() or b"") == (2, "b" * 100)


def test_replies_of_a_process_running_a_models_code_are_read_as_data_only() -> None:
    import os
    import pickle

    import numpy as np

    from mmserver.backend.wire import OK, LoadInfo
    from mmserver.procs.replies import data_loads

    info = LoadInfo(
        2**20,
        0.001,
        pickle.dumps({"family": "sklearn", "ms": np.float64(0.5)}),
        {"platform": "python", "n_features": np.int64(3), "outputs": [{"name": "predict"}]},
        0.25,
        ("UserWarning: pickled by another version",),
    )
    reply = (OK, info)
    assert data_loads(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)) == reply
    assert data_loads(info.paths or b"") == {"family": "sklearn", "ms": 0.5}
    answers = (OK, ([b'{"predictions": [1.0]}', ("ModelError", "bad row")], 0.1, 0.1, 2, "own"))
    assert data_loads(pickle.dumps(answers)) == answers

    class Hostile:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match=r"names posix\.system, which replies"):
        data_loads(pickle.dumps((OK, Hostile())))
