"""Frames on a process's pipe (:mod:`mmserver.procs.framing`): the backend's reader takes the frames
one recv brought one at a time, and a frame split across reads whole."""

from __future__ import annotations

import pickle
import socket

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
