"""Computing one asynchronous request's answer: its input read (whole, or in pieces for a large
line-based one, :mod:`mmserver.asynchronous.pieces`), submitted through the WorkLoadManager as a
background job when real time leaves room (:class:`~mmserver.asynchronous.admission.Turns`),
and the answer the real-time SageMaker path would give for the same body."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from mmserver.asynchronous.admission import Turns
from mmserver.asynchronous.journal import Invocation
from mmserver.asynchronous.locations import Locations
from mmserver.asynchronous.objectcalls import ObjectCalls
from mmserver.asynchronous.pieces import AnswerJoiner, pieces, splittable
from mmserver.codecs.answers import answer_body
from mmserver.codecs.requests import Request, make_request
from mmserver.config.server import ServerConfig
from mmserver.ops.traces import Trace

if TYPE_CHECKING:
    from mmserver.manager.wlm import WorkLoadManager

#: The most bytes of one piece of a large input: its answer, a few times its size as JSON, is
#: what the frontend holds at a time.
PIECE_BYTES = 1 << 20
#: The most bytes of a local input read in the hand-off that starts its request (the journal's
#: thread, :mod:`mmserver.asynchronous.writer`), rather than in a thread of its own afterwards.
SMALL_INPUT_BYTES = 64 << 10


class Computer:
    """Computes the answers of asynchronous requests."""

    def __init__(
        self,
        wlm: WorkLoadManager,
        locations: Locations,
        objects: ObjectCalls,
        turns: Turns,
        config: ServerConfig,
        state_dir: Path,
    ) -> None:
        self.wlm = wlm
        self.locations = locations
        self.objects = objects
        self.turns = turns
        self.max_request_size = config.max_request_size
        self.staging = state_dir / "answers"
        #: The largest input read whole with the request's start (:meth:`compute`'s
        #: ``body``): one that is never cut in pieces.
        self.small_input = min(SMALL_INPUT_BYTES, self.max_request_size or SMALL_INPUT_BYTES)

    async def compute(
        self,
        invocation: Invocation,
        deadline: float,
        body: bytes | None = None,
        trace: Trace | None = None,
    ) -> tuple[bytes | Path, str]:
        """The answer to ``invocation`` and its content type: its body, or for an input cut
        in pieces the file the pieces' answers were joined in. ``body``: its input when it was
        read already (at most :attr:`small_input` bytes). ``deadline`` is on the event loop's
        clock. A traced run's ``trace`` records each of its jobs."""
        if body is None:
            limit = self.max_request_size
            most = limit if limit and splittable(invocation.content_type) else 0
            if self.locations.is_local(invocation.input):
                found: bytes | int = await asyncio.to_thread(
                    self.locations.read_unless_larger, invocation.input, most
                )
            else:  # one call (its size, then the body if not larger) in an object process
                found = await self.objects.read_input(invocation.input, most)
            if isinstance(found, int):
                return await self._in_pieces(invocation, deadline, min(limit, PIECE_BYTES), trace)
            body = found
        job = make_request(body, invocation.content_type, invocation.accept)
        del body
        return _answer(await self._predict(invocation, job, deadline, trace), job)

    async def _in_pieces(
        self, invocation: Invocation, deadline: float, limit: int, trace: Trace | None
    ) -> tuple[Path, str]:
        """Read the input in pieces of at most ``limit`` bytes, each one a request, and join
        their answers in a file: the frontend holds one piece and its answer at a time."""
        stream = await asyncio.to_thread(self.locations.open, invocation.input)
        staged = self.locations.staging(invocation.output, self.staging)
        joiner = AnswerJoiner(staged)
        cut = pieces(stream, limit, invocation.content_type)
        try:
            while (piece := await asyncio.to_thread(next, cut, None)) is not None:
                job = make_request(piece, invocation.content_type, invocation.accept)
                del piece
                answer = await self._predict(invocation, job, deadline, trace)
                body, content_type = _answer(answer, job)
                await asyncio.to_thread(joiner.add, body, content_type)
            await asyncio.to_thread(joiner.close)
        except BaseException:
            joiner.discard()
            raise
        finally:
            stream.close()
        return staged, joiner.content_type or "application/json"

    async def _predict(
        self, invocation: Invocation, job: Request, deadline: float, trace: Trace | None
    ) -> bytes:
        """Submit ``job`` to the model of ``invocation`` as a background job when real-time
        traffic leaves room; the model's answer."""
        await self.turns.take()
        try:
            submission = self.wlm.submit(
                invocation.model, job, deadline=deadline, background=True, trace=trace
            )
            return await submission.answer
        finally:
            self.turns.give_back()


def _answer(answer: bytes, job: Request) -> tuple[bytes, str]:
    """The body and content type the real-time SageMaker path answers for ``answer``."""
    body, content_type = answer_body(answer, job[2])
    return bytes(body), content_type
