"""Every command the README and the pages of ``docs/`` show a user, run for real.

The rule: a fenced block whose info string is ``sh runnable`` or ``python runnable`` is run;
every other block is left alone (``pip install`` from the package index, Docker, Helm, kubectl,
the repository's scripts that set up a machine, PromQL, files shown as they are).

- A page's runnable blocks run in order, as a reader runs them, in one temporary folder that is
  the current directory of each: a model a block saves there is the model the next one serves.
- ``sh runnable``: ``bash -euo pipefail``, with the venv's ``bin`` first on ``PATH`` (its
  ``mmserver`` and ``python``). Every ``curl`` must be answered 2xx: the blocks' curl reads a
  ``.curlrc`` with ``fail-with-body``. No proxy, no AWS or ``MMSERVER_*`` variable reaches them.
- A ``sh runnable`` block that is one ``mmserver serve ...`` line, which would serve in the
  foreground, starts that server instead (:class:`tests.e2e.server_process.ServerProcess`: the
  real ``mmserver serve`` with the block's options, on a free loopback port, ready once ``/ping``
  answers); the blocks after it talk to it, and it is stopped at the end of the page or when the
  next such block starts another.
- ``python runnable``: the venv's Python.
- The blocks name the server as a user types it, ``127.0.0.1:8080`` (and ``127.0.0.1:8081``, or
  ``--grpc-port 8081``, for gRPC); the test puts in the ports it chose.
- When the next fenced block of the page has an info string ending in ``output``, the runnable
  block must print what it shows. ``json output``: JSON values, compared as values; strings,
  keys, integers, booleans and nulls exactly, and a number written with decimals to within half
  a unit of its last written place (``7.0`` stands for 6.999999999999998, ``0.98`` for
  0.98155...). ``text output``: line by line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shlex
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from mmserver.config.server import ModelConfig, ServerConfig
from tests.e2e.server_process import ROOT, ServerProcess, free_port

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: The seconds one block may take (a first import of scikit-learn, a cold model load).
BLOCK_TIMEOUT = 60.0

_OPENING = re.compile(r"^```([^`]*)$")
_PROXIES = {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy"}


@dataclass(frozen=True)
class Fence:
    """One fenced block of a page: its info string's words and its text."""

    page: Path
    line: int
    words: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return "runnable" in self.words[1:]

    @property
    def is_output(self) -> bool:
        return self.words[-1:] == ("output",)


@dataclass(frozen=True)
class Block:
    """A runnable block, and the output block after it if there is one."""

    fence: Fence
    output: Fence | None

    @property
    def serve_args(self) -> list[str] | None:
        """The options of a block that is one ``mmserver serve`` line, else ``None``."""
        if self.fence.words[0] != "sh":
            return None
        lines = [
            line
            for line in self.fence.text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if len(lines) != 1:
            return None
        words = shlex.split(lines[0], comments=True)
        return words[2:] if words[:2] == ["mmserver", "serve"] else None


def fences(page: Path) -> list[Fence]:
    found: list[Fence] = []
    opened: tuple[int, tuple[str, ...], list[str]] | None = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if opened is None:
            match = _OPENING.match(line)
            if match:
                opened = (number, tuple(match.group(1).split()), [])
        elif line == "```":
            found.append(Fence(page, opened[0], opened[1], "\n".join(opened[2]) + "\n"))
            opened = None
        else:
            opened[2].append(line)
    assert opened is None, f"{page}: the block opened at line {opened[0]} is never closed"
    return found


def blocks(page: Path) -> list[Block]:
    every = fences(page)
    after: list[Fence | None] = [*every[1:], None]
    return [
        Block(fence, nxt if nxt is not None and nxt.is_output else None)
        for fence, nxt in zip(every, after, strict=False)
        if fence.runnable
    ]


# ------------------------------------------------------------------------------------------------
# What a block prints against what its page shows
# ------------------------------------------------------------------------------------------------


def json_values(text: str, shown: bool = False) -> list[Any]:
    """The JSON values of ``text``, one after another (curl prints answers without a newline
    between them). ``shown``: numbers with decimals as :class:`Decimal`, which keeps what was
    written."""
    decoder = json.JSONDecoder(parse_float=Decimal) if shown else json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)


def agree(actual: Any, shown: Any, path: str = "") -> None:
    """Assert that ``actual`` (parsed JSON) is what ``shown`` (parsed with :class:`Decimal`
    numbers) shows of it."""
    if isinstance(shown, Decimal):
        assert isinstance(actual, int | float) and not isinstance(actual, bool), (
            f"{path}: {actual!r} where the page shows the number {shown}"
        )
        exponent = shown.as_tuple().exponent
        assert isinstance(exponent, int)
        within = 0.5 * 10.0**exponent
        assert abs(actual - float(shown)) <= within * (1 + 1e-9), (
            f"{path}: {actual!r} is not {shown} (to within {within:g})"
        )
    elif isinstance(shown, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r} where the page shows an object"
        assert actual.keys() == shown.keys(), (
            f"{path}: keys {sorted(actual)} where the page shows {sorted(shown)}"
        )
        for key, value in shown.items():
            agree(actual[key], value, f"{path}.{key}")
    elif isinstance(shown, list):
        assert isinstance(actual, list), f"{path}: {actual!r} where the page shows a list"
        assert len(actual) == len(shown), (
            f"{path}: {len(actual)} items where the page shows {len(shown)}: {actual!r}"
        )
        for index, (item, value) in enumerate(zip(actual, shown, strict=True)):
            agree(item, value, f"{path}[{index}]")
    else:
        assert type(actual) is type(shown) and actual == shown, (
            f"{path}: {actual!r} where the page shows {shown!r}"
        )


def check_output(output: Fence, printed: str) -> None:
    if output.words[0] == "json":
        actual = json_values(printed)
        shown = json_values(output.text, shown=True)
        assert len(actual) == len(shown), (
            f"{len(actual)} JSON values printed where the page shows {len(shown)}:\n{printed}"
        )
        for index, (value, expected) in enumerate(zip(actual, shown, strict=True)):
            agree(value, expected, f"value {index + 1}")
    else:
        lines = [line.rstrip() for line in printed.strip().splitlines()]
        shown = [line.rstrip() for line in output.text.strip().splitlines()]
        assert lines == shown, f"printed {lines} where the page shows {shown}"


# ------------------------------------------------------------------------------------------------
# A reader going through a page
# ------------------------------------------------------------------------------------------------


class Reader:
    """Runs a page's blocks in ``root / "reader"``, the reader's folder, with the server the
    page started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / "reader"
        self.folder.mkdir(parents=True)
        curl_home = root / "curl"
        curl_home.mkdir()
        (curl_home / ".curlrc").write_text("fail-with-body\nshow-error\n")
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("MMSERVER_", "AWS_")) and key.lower() not in _PROXIES
        }
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["CURL_HOME"] = str(curl_home)
        self.env = env
        self.server: ServerProcess | None = None
        self.grpc_port: int | None = None
        self._servers = AsyncExitStack()
        self._started = 0

    async def __aenter__(self) -> Reader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._servers.aclose()

    def localize(self, fence: Fence) -> str:
        """The block's text calling the server the page started, never another one."""
        text = fence.text
        for documented, port in (
            ("8080", self.server and self.server.port),
            ("8081", self.grpc_port),
        ):
            if f"127.0.0.1:{documented}" in text:
                assert port, f"{fence.where} calls 127.0.0.1:{documented}, which no block started"
                text = text.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{port}")
        return text

    async def run(self, block: Block) -> None:
        args = block.serve_args
        if args is not None:
            await self.serve(block, args)
            return
        fence = block.fence
        language = fence.words[0]
        script = self.root / f"block-{fence.line}.{'py' if language == 'python' else 'sh'}"
        script.write_text(self.localize(fence))
        argv = (
            [sys.executable, str(script)]
            if language == "python"
            else ["bash", "-euo", "pipefail", str(script)]
        )
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.folder,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), BLOCK_TIMEOUT)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"{fence.where}: still running after {BLOCK_TIMEOUT} s") from None
        printed = out.decode(errors="replace")
        said = f"stdout:\n{printed}\nstderr:\n{err.decode(errors='replace')}{self.server_log()}"
        assert process.returncode == 0, f"{fence.where} exited {process.returncode}\n{said}"
        if block.output is not None:
            try:
                check_output(block.output, printed)
            except AssertionError as exc:
                raise AssertionError(f"{fence.where} printed otherwise: {exc}\n{said}") from None

    async def serve(self, block: Block, args: list[str]) -> None:
        where = block.fence.where
        assert "--model-store" in args, f"{where}: a served page names its --model-store"
        assert not {"--host", "--port"} & set(args), f"{where}: the test chooses host and port"
        at = args.index("--model-store")
        store = self.folder / args[at + 1]
        options = args[:at] + args[at + 2 :]
        if "--capture-path" in options:  # a folder of the reader's, as the store is
            at = options.index("--capture-path")
            if "://" not in options[at + 1]:
                options[at + 1] = str(self.folder / options[at + 1])
        self.grpc_port = None
        if "--grpc-port" in options:
            at = options.index("--grpc-port")
            assert options[at + 1] == "8081", f"{where}: gRPC on 8081, as the blocks call it"
            self.grpc_port = free_port()
            options[at + 1] = str(self.grpc_port)
        await self._servers.aclose()  # the reader stops the one before (Ctrl-C)
        self.server = None
        self._started += 1
        log = self.root / f"serve-{self._started}.log"
        self.server = await self._servers.enter_async_context(ServerProcess(store, log, *options))

    def server_log(self) -> str:
        if self.server is None:
            return ""
        tail = "\n".join(self.server.log().splitlines()[-30:])
        return f"\nserver log (last 30 lines):\n{tail}"


# ------------------------------------------------------------------------------------------------
# The pages
# ------------------------------------------------------------------------------------------------

RUNNABLE_PAGES = [page for page in PAGES if blocks(page)]


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[p.name for p in RUNNABLE_PAGES])
async def test_the_page_runs_as_it_says(page: Path, tmp_path: Path) -> None:
    async with Reader(tmp_path) as reader:
        for block in blocks(page):
            await reader.run(block)


def test_the_readme_runs_the_three_steps() -> None:
    """Save with joblib, serve the folder, call it with curl, boto3 and tritonclient (each
    answer shown and checked), then the example models, in that order."""
    steps = blocks(README)

    def first(after: int, language: str, *needles: str) -> int:
        for index in range(after + 1, len(steps)):
            fence = steps[index].fence
            if fence.words[0] == language and all(n in fence.text for n in needles):
                return index
        raise AssertionError(f"no runnable {language} block with {needles} after block {after}")

    saved = first(-1, "python", "joblib.dump(", "/model.joblib")
    served = first(saved, "sh", "mmserver serve --model-store")
    assert steps[served].serve_args is not None
    for language, needles in [
        ("sh", ("curl", "/predictions/")),
        ("python", ("boto3.client(", "TargetModel=")),
        ("python", ("tritonclient.http",)),
    ]:
        call = first(served, language, *needles)
        assert steps[call].output is not None, f"{steps[call].fence.where} shows no answer"
    first(served, "sh", "mmserver example-store")
    assert len(RUNNABLE_PAGES) >= 2


def test_every_page_keeps_the_rule() -> None:
    """Runnable blocks are ``sh`` or ``python``; an output block follows a runnable block and
    parses; a served page chooses neither host nor port."""
    outputs = 0
    for page in PAGES:
        every = fences(page)
        for before, fence in zip([None, *every], every, strict=False):
            if fence.runnable:
                assert fence.words in {("sh", "runnable"), ("python", "runnable")}, fence.where
            if fence.is_output:
                outputs += 1
                assert fence.words in {("json", "output"), ("text", "output")}, fence.where
                assert before is not None and before.runnable, f"{fence.where}: nothing prints it"
                if fence.words[0] == "json":
                    assert json_values(fence.text, shown=True), fence.where
    assert outputs >= 8


def section(page: Path, heading: str) -> str:
    """The text of ``page`` under ``heading`` (a whole heading line), to the next heading."""
    text = page.read_text()
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    end = re.compile(r"^#", re.M).search(text, start)
    return text[start : end.start() if end else len(text)]


def first_column_names(table: str) -> set[str]:
    """The backticked names in the first column of the tables of ``table``."""
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("|")]
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def test_the_operations_page_lists_every_option_and_key() -> None:
    """Each of the server's options, and each ``serving.properties`` key, has its row."""
    operations = ROOT / "docs" / "operations.md"
    options = first_column_names(section(operations, "### Server options"))
    unlisted = {f.name for f in dataclasses.fields(ServerConfig)} - options
    assert not unlisted, f"options missing from the table: {sorted(unlisted)}"
    keys = first_column_names(section(operations, "### serving.properties"))
    declared = {
        f.metadata["keys"][0] for f in dataclasses.fields(ModelConfig) if f.metadata.get("keys")
    }
    unlisted = (declared | {"option.columns"}) - keys
    assert not unlisted, f"serving.properties keys missing from the table: {sorted(unlisted)}"


# ------------------------------------------------------------------------------------------------
# The checks themselves
# ------------------------------------------------------------------------------------------------


def test_numbers_agree_to_the_decimals_shown() -> None:
    [shown] = json_values('{"predictions": [7.0, 0.98, 1.5e-08, 3], "id": "42"}', shown=True)
    agree({"predictions": [6.999999999999998, 0.98155, 1.52e-08, 3], "id": "42"}, shown)
    for actual in [
        {"predictions": [7.06, 0.98, 1.5e-08, 3], "id": "42"},
        {"predictions": [7.0, 0.9856, 1.5e-08, 3], "id": "42"},
        {"predictions": [7.0, 0.98, 1.56e-08, 3], "id": "42"},
        {"predictions": [7.0, 0.98, 1.5e-08, 3.0], "id": "42"},
        {"predictions": [7.0, 0.98, 1.5e-08], "id": "42"},
        {"predictions": [7.0, 0.98, 1.5e-08, 3], "id": 42},
        {"predictions": [7.0, 0.98, 1.5e-08, 3]},
    ]:
        with pytest.raises(AssertionError):
            agree(actual, shown)


def test_answers_printed_back_to_back_are_read_one_by_one() -> None:
    assert json_values('{"a": 1}{"b": [2]}\n[3]') == [{"a": 1}, {"b": [2]}, [3]]
    output = Fence(README, 1, ("json", "output"), '{"a": 1}\n{"b": [2.0]}\n')
    check_output(output, '{"a": 1}{"b": [2.0004]}')
    with pytest.raises(AssertionError):
        check_output(output, '{"a": 1}')
    with pytest.raises(AssertionError):
        check_output(Fence(README, 1, ("text", "output"), "wrote a\n"), "wrote b\n")


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_page_fails_on_an_error_answer_a_wrong_output_or_a_failed_command(
    tmp_path: Path,
) -> None:
    """A call before any server was started, a curl answered 404, an answer other than the one
    shown and a command that exits non-zero each fail their block."""
    page = tmp_path / "page.md"
    page.write_text(
        "```sh runnable\ncurl -s http://127.0.0.1:8080/ping\n```\n\n"
        "```sh runnable\nmkdir models\n```\n\n"
        "```sh runnable\nmmserver serve --model-store models\n```\n\n"
        "```sh runnable\ncurl -s http://127.0.0.1:8080/ping\n```\n\n"
        '```json output\n{"status": "Healthy"}\n```\n\n'
        "```sh runnable\ncurl -s http://127.0.0.1:8080/predictions/none -d '[[1]]'\n```\n\n"
        "```sh runnable\ncurl -s http://127.0.0.1:8080/ping\n```\n\n"
        '```json output\n{"status": "Unhealthy"}\n```\n\n'
        "```python runnable\nraise SystemExit(3)\n```\n"
    )
    early, made, served, healthy, unknown, wrong, failing = blocks(page)
    async with Reader(tmp_path / "run") as reader:
        with pytest.raises(AssertionError, match="which no block started"):
            await reader.run(early)
        await reader.run(made)
        await reader.run(served)
        await reader.run(healthy)
        with pytest.raises(AssertionError, match="exited 22"):
            await reader.run(unknown)  # answered 404
        with pytest.raises(AssertionError, match="printed otherwise"):
            await reader.run(wrong)
        with pytest.raises(AssertionError, match="exited 3"):
            await reader.run(failing)
