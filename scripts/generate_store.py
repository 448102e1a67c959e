#!/usr/bin/env python3
"""Write the reference model store.

``sklearn-0.tar.gz`` ... ``sklearn-{N-1}.tar.gz``: copies of one LinearRegression trained on
``y = 2x + 1 + noise`` (one feature), saved with joblib and packed as ``model.tar.gz`` with
``model.joblib`` at its root, as in the DJL/SageMaker multi-model walkthrough. Plus a few richer
examples as folders (:mod:`mmserver.commands.examples`, which ``mmserver example-store DIR`` writes
too): a classifier answering ``predict_proba``, a DataFrame pipeline, a Pipeline, a custom handler
and a model with its own ``serving.properties``.

Models are trained here, on the machine that serves them, so they load without version warnings.
A stamp file ``.generated`` records the scikit-learn version and count; a second run with the
same ones does nothing.

Usage: scripts/generate_store.py [--out DIR] [--count N]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"

if (
    __name__ == "__main__"
    and importlib.util.find_spec("sklearn") is None
    and _VENV_PYTHON.is_file()
):
    # Run directly with a Python that lacks scikit-learn: use the repository's .venv instead.
    os.execv(_VENV_PYTHON, [str(_VENV_PYTHON), *sys.argv])

import sklearn  # noqa: E402

from mmserver.commands.examples import (  # noqa: E402
    EXAMPLES,
    SEED,
    pack,
    train_linear,
    write_classifier_dir,
    write_custom_handler_dir,
    write_examples,
    write_linear_archive,
    write_linear_dir,
    write_pipeline_dir,
    write_tuned_dir,
)

__all__ = [
    "EXAMPLES",
    "SEED",
    "generate",
    "is_current",
    "pack",
    "train_linear",
    "write_classifier_dir",
    "write_custom_handler_dir",
    "write_linear_archive",
    "write_linear_dir",
    "write_pipeline_dir",
    "write_tuned_dir",
]

STAMP = ".generated"


def _stamp_text(count: int) -> str:
    return f"sklearn={sklearn.__version__}\ncount={count}\n"


def is_current(out: Path, count: int) -> bool:
    """Whether ``out`` already holds this store, written by this scikit-learn version."""
    try:
        if (out / STAMP).read_text() != _stamp_text(count):
            return False
    except OSError:
        return False
    return all((out / f"sklearn-{i}.tar.gz").is_file() for i in range(count)) and all(
        (out / name / "model.joblib").is_file() for name in EXAMPLES
    )


def generate(out: Path, count: int) -> None:
    """Write the reference store into ``out`` (``count`` archives and the examples)."""
    out = Path(out)
    if is_current(out, count):
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".generate-") as tmp:
        archive = write_linear_archive(Path(tmp) / "model.tar.gz")
        for i in range(count):
            # Copies, not links: replacing one archive must not change the others.
            target = out / f"sklearn-{i}.tar.gz"
            partial = Path(tmp) / target.name
            shutil.copyfile(archive, partial)
            partial.replace(target)
    write_examples(out)
    (out / STAMP).write_text(_stamp_text(count))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("model_store"), help="store directory")
    parser.add_argument("--count", type=int, default=1000, help="number of sklearn-N archives")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error("--count must not be negative")
    start = time.perf_counter()
    if is_current(args.out, args.count):
        print(f"{args.out}: up to date ({args.count} models, scikit-learn {sklearn.__version__})")
        return 0
    generate(args.out, args.count)
    elapsed = time.perf_counter() - start
    print(
        f"{args.out}: wrote {args.count} archives and {len(EXAMPLES)} examples in {elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
