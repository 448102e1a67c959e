"""``scripts/cluster experiment``: the routing experiment (``python -m clusterlib experiment``
with ``scripts/`` on ``PYTHONPATH``); every other ``scripts/cluster`` command is
``mmserver cluster``."""

from __future__ import annotations

import argparse
import logging
import sys

from clusterlib import experiment


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    parser = argparse.ArgumentParser(
        prog="scripts/cluster",
        description="The routing experiment; the cluster itself is `mmserver cluster`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    experiment.add_parser(sub)
    return experiment.main(parser.parse_args(argv))


sys.exit(main())
