"""A transform job's description: every option of ``mmserver transform`` declared once, as a
field of :class:`TransformOptions` (``max_payload_mb`` is ``--max-payload-mb``), with SageMaker's
CreateTransformJob names and values where SageMaker has the option.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserver.commands.transform.failures import TransformError

PROG = "mmserver transform"

CSV = "text/csv"
JSON = "application/json"
JSON_LINES = "application/jsonlines"
LIBSVM = "text/libsvm"
NPY = "application/x-npy"
CONTENT_TYPES = (CSV, JSON_LINES, JSON, LIBSVM, NPY)
ACCEPTS = (CSV, JSON, JSON_LINES)
#: SageMaker's limit of MaxPayloadInMB.
MAX_PAYLOAD_MB = 100.0
MIB = 1 << 20


def _opt(default: Any, help: str, choices: Sequence[str] = (), metavar: str = "") -> Any:
    return field(
        default=default, metadata={"help": help, "choices": tuple(choices), "metavar": metavar}
    )


@dataclass(frozen=True)
class TransformOptions:
    """One job. Frozen; :meth:`check` validates it once built."""

    model: str = _opt("", "The model to run, NAME or NAME/VERSION (required).", metavar="NAME")
    input: str = _opt(
        "",
        "A local folder (every file under it), a local file, an s3://bucket/prefix (every "
        "object under it) or, with --data-type ManifestFile, a manifest (required).",
        metavar="LOCATION",
    )
    output: str = _opt(
        "",
        "A local folder or s3://bucket/prefix; one <input file>.out per input file, at the "
        "input's relative path (required).",
        metavar="LOCATION",
    )
    data_type: str = _opt(
        "S3Prefix",
        "S3Prefix: --input names a folder, file or prefix; ManifestFile: it names a SageMaker "
        'manifest, [{"prefix": "s3://bucket/prefix/"}, "key", ...] (a local file or an object).',
        ("S3Prefix", "ManifestFile"),
    )
    url: str = _opt(
        "",
        "A running server or mmserver cluster (http://host:port); without it, the command "
        "starts mmserver serve over --model-store on a free loopback port and stops it at the "
        "end.",
        metavar="URL",
    )
    token: str = _opt(
        "",
        "A bearer token sent with every request (Authorization: Bearer): a tenant's token or the "
        "management token, for a server with tenants. MMSERVER_TOKEN in the environment gives "
        "it without showing it in the process list.",
        metavar="TOKEN",
    )
    model_store: str = _opt(
        "./model_store",
        "The model store of the server started without --url (a folder or s3://bucket/prefix).",
        metavar="STORE",
    )
    backend_processes: int = _opt(
        0,
        "Backend processes of the server started without --url; 0 = one per CPU core.",
        metavar="INT",
    )
    content_type: str = _opt(
        CSV,
        "The input's type: text/csv and text/libsvm (a record a line), application/jsonlines "
        "(a JSON row or record a line, sent as a JSON array), application/json or "
        "application/x-npy (whole files, --split-type None).",
        CONTENT_TYPES,
    )
    split_type: str = _opt(
        "Line",
        "Line: a record is a line (blank lines are skipped); None: a record is a whole file.",
        ("Line", "None"),
    )
    batch_strategy: str = _opt(
        "MultiRecord",
        "MultiRecord: as many records a request as fit in --max-payload-mb; SingleRecord: one.",
        ("MultiRecord", "SingleRecord"),
    )
    max_payload_mb: float = _opt(
        6.0,
        "The largest request body in MiB (at most 100); a record larger than it fails its "
        "file. Keep it within the server's max_request_size.",
        metavar="MB",
    )
    max_concurrent_transforms: int = _opt(
        0,
        "Requests in flight; 0 = the backend processes of the server started without --url, "
        "or the CPUs this machine gives the job (its cgroup quota, its affinity) with --url "
        "(give the instances' backend processes in total for a cluster).",
        metavar="INT",
    )
    accept: str = _opt(
        "",
        "The answers' type: text/csv (a line a record), application/json or "
        "application/jsonlines (a JSON value a line); default text/csv for CSV input, else "
        "application/jsonlines.",
        ACCEPTS,
    )
    assemble_with: str = _opt(
        "Line",
        "Line: one output line per record, in the input's order; None: the answers' bodies "
        "as the server sent them, concatenated.",
        ("Line", "None"),
    )
    join_source: str = _opt(
        "None",
        "Input: each output line joined to its input record (CSV: the record, a comma, the "
        "answer; JSON: the record with a SageMakerOutput key, or {SageMakerInput, "
        "SageMakerOutput} for a record that is not an object). Needs --split-type Line and "
        "--assemble-with Line.",
        ("Input", "None"),
    )
    on_error: str = _opt(
        "continue",
        "continue: a file a record of which fails gets <file>.error instead of <file>.out, and "
        "the job goes on; fail: the job stops at the first failed file.",
        ("continue", "fail"),
    )
    journal: str = _opt(
        "",
        "The folder holding the job's progress; default <output>/.mmserver-transform for a "
        "local output, ~/.cache/mmserver/transform/<hash of the output> for s3://.",
        metavar="DIR",
    )
    progress: str = _opt(
        "auto",
        "auto: a progress bar on a terminal, plain progress lines otherwise; bar; lines; none.",
        ("auto", "bar", "lines", "none"),
    )
    timeout: float = _opt(
        300.0, "Seconds one request may take before its file fails.", metavar="SECONDS"
    )

    @classmethod
    def options(cls) -> tuple[dataclasses.Field[Any], ...]:
        return dataclasses.fields(cls)

    def check(self) -> TransformOptions:
        """``self``, once every value is known to be usable; raises :class:`TransformError`."""
        for name in ("model", "input", "output"):
            if not str(getattr(self, name)).strip():
                raise TransformError(f"--{name} is required")
        if not 0 < self.max_payload_mb <= MAX_PAYLOAD_MB:
            raise TransformError(
                f"--max-payload-mb {self.max_payload_mb}: give a size above 0 and at most "
                f"{MAX_PAYLOAD_MB:g} MiB"
            )
        if self.max_concurrent_transforms < 0 or self.backend_processes < 0:
            raise TransformError("--max-concurrent-transforms and --backend-processes are >= 0")
        if self.timeout <= 0:
            raise TransformError("--timeout must be above 0")
        if self.split_type == "Line" and self.content_type in (JSON, NPY):
            raise TransformError(
                f"--content-type {self.content_type} is not split into lines: use "
                f"--split-type None, or {JSON_LINES} for a JSON value a line"
            )
        if self.join_source == "Input" and (
            self.split_type != "Line" or self.assemble_with != "Line"
        ):
            raise TransformError(
                "--join-source Input joins each output line to its input line: it needs "
                "--split-type Line and --assemble-with Line"
            )
        if self.url and not self.url.startswith(("http://", "https://")):
            raise TransformError(f"--url {self.url!r}: give http://host:port")
        return self

    @property
    def answer_type(self) -> str:
        """The ``Accept`` the requests send."""
        if self.accept:
            return self.accept
        return CSV if self.content_type == CSV else JSON_LINES

    @property
    def request_accept(self) -> str:
        """The ``Accept`` the requests send: JSON, unless the answers' bodies are the output
        (``--assemble-with None``). The server's JSON answers are the cheaper to make, and the
        job writes them in the ``--accept`` form itself."""
        return self.answer_type if self.assemble_with == "None" else JSON

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * MIB)

    def fingerprint(self) -> str:
        """What makes two runs the same job: a rerun continues only a job of the same
        fingerprint (where it runs and how fast do not change the outputs)."""
        kept = {
            f.name: getattr(self, f.name)
            for f in self.options()
            if f.name
            not in (
                "url",
                "model_store",
                "backend_processes",
                "max_concurrent_transforms",
                "on_error",
                "journal",
                "progress",
                "timeout",
            )
        }
        kept["accept"] = self.answer_type
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:32]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """``mmserver transform [options]``: one flag per :class:`TransformOptions` field."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run every record of a folder, a file or an s3:// prefix through a model and write "
            "the predictions beside it, one <file>.out per input file, in the input's order "
            "(SageMaker's batch transform). A job records its progress beside its output: run "
            "the same command again after a crash or Ctrl-C and it continues where it stopped."
        ),
    )
    types = {int: int, float: float, str: str}
    for option in TransformOptions.options():
        choices = option.metadata["choices"] or None
        default = option.default
        shown = "unset" if default == "" else str(default)
        parser.add_argument(
            _flag(option.name),
            dest=option.name,
            type=types[type(default)],
            choices=choices,
            default=default,
            metavar=option.metadata["metavar"] or None,
            help=f"{option.metadata['help']} Default: {shown}.".replace("%", "%%"),
        )
    return parser


def parse(argv: Sequence[str]) -> TransformOptions:
    """The job the command line ``argv`` describes; argparse exits on bad syntax, a bad value
    raises :class:`TransformError`."""
    args = build_parser().parse_args(list(argv))
    values = {f.name: getattr(args, f.name) for f in TransformOptions.options()}
    if not values["token"]:
        values["token"] = os.environ.get("MMSERVER_TOKEN", "")
    return TransformOptions(**values).check()


def default_journal(options: TransformOptions, home: str | None = None) -> str:
    """Where the job's progress is kept (:attr:`TransformOptions.journal`)."""
    if options.journal:
        return options.journal
    if options.output[:5].lower() == "s3://":
        digest = hashlib.sha256(options.output.rstrip("/").encode()).hexdigest()[:16]
        base = home or os.path.expanduser("~")
        return os.path.join(base, ".cache", "mmserver", "transform", digest)
    return os.path.join(options.output, ".mmserver-transform")
