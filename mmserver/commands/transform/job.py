"""The run of a job: files read one after another, their payloads sent by a fixed set of
senders, each file's output assembled and written once its last payload is answered.

Flow control: the reader puts payloads into a queue of ``concurrency`` places, and
``2 x concurrency`` senders take them; a sender holds one of ``concurrency`` slots only while
its request is in flight, so at most that many requests are, and a sender recording an answer
(the journal, the output) leaves its slot to another: the server is never kept waiting on the
job's own work. Only the files whose payloads are queued or in flight are held in memory.
Payloads already in the journal are not sent again. A payload refused fails its file: its later
payloads are not sent, and a ``.error`` is written instead of the output (``--on-error fail``
then stops the job). A
:class:`~mmserver.commands.transform.failures.TransformError` in any task stops the whole job (the
task group cancels the rest); what was recorded stays in the journal for the next run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mmserver.commands.transform import records as rec
from mmserver.commands.transform.cuts import Cut, cut
from mmserver.commands.transform.failures import FileFailed, TransformError
from mmserver.commands.transform.journal import Journal
from mmserver.commands.transform.options import TransformOptions
from mmserver.commands.transform.places import ERROR_SUFFIX, InputFile, Places
from mmserver.commands.transform.progress import Tally
from mmserver.commands.transform.sender import Sender


@dataclass
class _File:
    """One input file being transformed."""

    file: InputFile
    cut: Cut
    outputs: dict[int, bytes]
    remaining: int
    failed: str = ""


class Job:
    """Transforms ``files`` through ``sender``, recording progress in ``journal``."""

    def __init__(
        self,
        options: TransformOptions,
        places: Places,
        journal: Journal,
        sender: Sender,
        tally: Tally,
        concurrency: int,
    ) -> None:
        self.options = options
        self.places = places
        self.journal = journal
        self.sender = sender
        self.tally = tally
        self.concurrency = concurrency
        self.framing = rec.Framing(options)
        self.senders = 2 * concurrency
        self._slots = asyncio.Semaphore(concurrency)

    async def run(self, files: list[InputFile]) -> None:
        """Transform every file not done yet. Raises :class:`TransformError` when the job
        stops before the end."""
        queue: asyncio.Queue[tuple[_File, rec.Payload] | None] = asyncio.Queue(self.concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                for number in range(self.senders):
                    group.create_task(self._sender(queue), name=f"transform-sender-{number}")
                group.create_task(self._reader(files, queue), name="transform-reader")
        except* TransformError as failures:
            raise failures.exceptions[0] from None
        except* OSError as failures:  # the journal's disk (the outputs' is a TransformError)
            raise TransformError(
                f"the journal {self.journal.folder} cannot be written: {failures.exceptions[0]}"
            ) from None

    async def _reader(
        self, files: list[InputFile], queue: asyncio.Queue[tuple[_File, rec.Payload] | None]
    ) -> None:
        done = self.journal.done()
        for file in files:
            if file.name in done:
                self.tally.files_done += 1
                self.tally.files_resumed += 1
                self.tally.bytes_done += file.size
                continue
            try:
                state = await asyncio.to_thread(self._open, file)
            except FileFailed as exc:
                await self._failed(file, exc.message, 0)
                continue
            if state.remaining == 0:
                await self._finish(state)
                continue
            for payload in state.cut.payloads:
                if payload.index not in state.outputs:
                    await queue.put((state, payload))
        for _ in range(self.senders):
            await queue.put(None)

    def _open(self, file: InputFile) -> _File:
        """Read and split ``file``, and take its answered payloads from the journal."""
        data = self.places.read(file)
        pieces = cut(data, self.options, self.framing, self.options.max_payload_bytes)
        payloads = pieces.payloads
        header = {"size": len(data), "records": pieces.count, "payloads": len(payloads)}
        outputs = self.journal.parts(file.name, header)
        state = _File(file, pieces, outputs, len(payloads) - len(outputs))
        answered = [payloads[i] for i in outputs if i < len(payloads)]
        resumed = sum(p.end - p.start for p in answered)
        self.tally.records += resumed
        self.tally.records_resumed += resumed
        self.tally.bytes_done += sum(p.size for p in answered)
        return state

    async def _sender(self, queue: asyncio.Queue[tuple[_File, rec.Payload] | None]) -> None:
        while (item := await queue.get()) is not None:
            state, payload = item
            if not state.failed:
                try:
                    await self._send(state, payload)
                except FileFailed as exc:
                    state.failed = state.failed or (
                        f"records {payload.start + 1} to {payload.end}: {exc.message}"
                        if payload.end - payload.start > 1
                        else f"record {payload.start + 1}: {exc.message}"
                    )
            state.remaining -= 1
            if state.remaining == 0:
                await self._finish(state)

    async def _send(self, state: _File, payload: rec.Payload) -> None:
        body = state.cut.body(payload)
        async with self._slots:
            answer, kind = await self.sender.send(body, self.framing.content_type)
        # The sender waiting for the slot sends its request first: the server is not kept
        # waiting while this answer is read.
        await asyncio.sleep(0)
        output = self._output(state, payload, answer, kind)
        if state.remaining > 1:  # the last payload's output is written with its file's
            await asyncio.to_thread(self.journal.add_part, state.file.name, payload.index, output)
        state.outputs[payload.index] = output
        self.tally.records += payload.end - payload.start
        self.tally.bytes_done += payload.size

    def _output(self, state: _File, payload: rec.Payload, answer: bytes, kind: str) -> bytes:
        """The output of an answered payload. Made on the event loop: it is work on bytes in
        memory that holds the interpreter's lock (a thread would run it no sooner), and a hand-
        off to a thread and back cost each answer ~10 ms before the next request went out, on a
        machine whose cores the server kept busy (measured: a two-instance cluster's job)."""
        try:
            count = payload.end - payload.start
            records = state.cut.records_of(payload)
            return rec.part(count, records, answer, kind, self.options)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FileFailed(f"the answer cannot be used: {exc}") from None

    async def _finish(self, state: _File) -> None:
        name = state.file.name
        if state.failed:
            await self._failed(state.file, state.failed, state.cut.count)
            state.cut.release()
            return
        output = b"".join(state.outputs[p.index] for p in state.cut.payloads)
        state.cut.release()
        await asyncio.to_thread(self._write, name, output)
        self.tally.files_done += 1

    def _write(self, name: str, output: bytes) -> None:
        """Write a file's output whole, then mark it done (in a thread)."""
        self.places.write(name, output)
        self.places.remove_error(name)
        self.journal.finish(name)

    async def _failed(self, file: InputFile, message: str, records: int) -> None:
        text = f"{file.location}: {message}"
        await asyncio.to_thread(self.places.write, file.name, (text + "\n").encode(), ERROR_SUFFIX)
        self.tally.files_failed += 1
        self.tally.records_failed += records
        if self.options.on_error == "fail":
            raise TransformError(f"stopped at a failed file (--on-error fail): {text}")
