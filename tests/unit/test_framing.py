"""Frames on a process's pipe (:mod:`mmserver.framing`): what the backend's reader knows of
the frames already received, which decides whether a reply waits for the next one."""

from __future__ import annotations

import pickle
import socket

from mmserver.framing import FrameReader, frame, send_frame


def test_the_reader_knows_whether_a_whole_frame_is_waiting() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = FrameReader(ours)
        assert not reader.has_frame()
        first, second = frame((1, "a")), frame((2, "b" * 100))
        send_frame(theirs, first + second + [second[0], second[1][:10]])
        assert reader.read() == first[1]  # one recv brings every frame sent
        assert reader.has_frame()
        assert pickle.loads(reader.read() or b"") == (2, "b" * 100)
        assert not reader.has_frame()  # the third has only begun
        theirs.sendall(second[1][10:])
        assert pickle.loads(reader.read() or b"") == (2, "b" * 100)
        assert not reader.has_frame()
