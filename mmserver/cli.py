"""The ``mmserver`` command.

Every flag of ``mmserver serve`` derives from a field of
:class:`~mmserver.config.server.ServerConfig`: ``max_workers`` is ``--max-workers`` and
``MMSERVER_MAX_WORKERS``. Flags default to ``None`` so that an option not given on the command line
keeps its value from the environment or the file.

``mmserver cluster ...`` hands its arguments to :mod:`mmserver.commands.cluster.cli`, and
``mmserver transform ...`` to :mod:`mmserver.commands.transform.cli` and ``mmserver recommend ...``
to
:mod:`mmserver.commands.recommend.cli`, each imported only then: the server never imports them, and
they never import the server's configuration (a transform's start-up is part of its time).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mmserver import __version__

if TYPE_CHECKING:
    from mmserver.config.server import ServerConfig

_METAVARS = {int: "INT", float: "NUMBER", str: "TEXT"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "unset"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: ``mmserver serve [options]``."""
    from mmserver.config.server import ENV_PREFIX, ServerConfig

    parser = argparse.ArgumentParser(
        prog="mmserver",
        description="Multi-model server for scikit-learn models.",
    )
    parser.add_argument("--version", action="version", version=f"mmserver {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the models of a model store",
        description=(
            "Serve the models of a model store on one port. Options come from, in rising "
            "precedence: defaults, --config FILE, MMSERVER_<OPTION> environment variables, flags."
        ),
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="Properties file with options (key=value, keys as in the environment names "
        "without the MMSERVER_ prefix, in lower case).",
    )
    for field in ServerConfig.options():
        help_text = str(field.metadata.get("help", ""))
        env = ENV_PREFIX + field.name.upper()
        full_help = (f"{help_text} Default: {_default_text(field.default)}. (env {env})").replace(
            "%", "%%"
        )
        if isinstance(field.default, bool):
            serve.add_argument(
                _flag(field.name),
                dest=field.name,
                # Either way, --<name> or --no-<name>: a command line keeps working when a
                # default changes (heavy_sched_idle was on until issue 34).
                action=argparse.BooleanOptionalAction,
                default=None,
                help=full_help,
            )
        else:
            serve.add_argument(
                _flag(field.name),
                dest=field.name,
                default=None,
                metavar=_METAVARS.get(type(field.default), "VALUE"),
                help=full_help,
            )
    examples = commands.add_parser(
        "example-store",
        help="write the example models into a model store folder",
        description=(
            "Write the example models (a classifier answering predict_proba, a DataFrame "
            "pipeline with string columns and missing values, a Pipeline, a custom handler, a "
            "model with its own serving.properties) into DIRECTORY, each as a folder; other "
            "entries there are left as they are. Then: mmserver serve --model-store DIRECTORY."
        ),
    )
    examples.add_argument("directory", metavar="DIRECTORY", help="the model store folder")
    # Listed for the help only: main() hands `cluster ...` to the cluster's own parser.
    commands.add_parser(
        "cluster",
        help="several mmserver instances behind HAProxy on one port (mmserver cluster --help)",
        add_help=False,
    )
    commands.add_parser(
        "transform",
        help="run a dataset (a folder, a file, an s3:// prefix) through a model, offline "
        "(mmserver transform --help)",
        add_help=False,
    )
    commands.add_parser(
        "envs",
        help="build the model environments a store needs ahead of time "
        "(mmserver envs build --help)",
        add_help=False,
    )
    commands.add_parser(
        "recommend",
        help="load-test a model and recommend its settings and instances "
        "(mmserver recommend --help)",
        add_help=False,
    )
    return parser


def build_config(argv: Sequence[str], env: Mapping[str, str]) -> ServerConfig:
    """The configuration for the command line ``argv`` (e.g. ``["serve", "--port", "9000"]``)
    and the environment ``env``. Raises :class:`ConfigError`; argparse exits on bad syntax."""
    from mmserver.config.server import ServerConfig
    from mmserver.errors import ConfigError

    args = build_parser().parse_args(list(argv))
    if args.command != "serve":
        raise ConfigError("no command given; use: mmserver serve [options]")
    flags = {f.name: getattr(args, f.name) for f in ServerConfig.options()}
    return ServerConfig.build(config_file=args.config, env=env, flags=flags)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["cluster"]:
        from mmserver.commands.cluster.cli import main as cluster_main

        return cluster_main(args[1:])
    if args[:1] == ["transform"]:
        from mmserver.commands.transform.cli import main as transform_main

        return transform_main(args[1:])
    if args[:1] == ["recommend"]:
        from mmserver.commands.recommend.cli import main as recommend_main

        return recommend_main(args[1:])
    if args[:1] == ["envs"]:
        from mmserver.commands.envs import main as envs_main

        return envs_main(args[1:])
    parser = build_parser()
    parsed = parser.parse_args(args) if args else None
    if parsed is None or parsed.command is None:
        parser.print_help()
        return 0
    if parsed.command == "example-store":
        return _example_store(Path(parsed.directory))
    from mmserver.errors import ConfigError
    from mmserver.opening import check_store
    from mmserver.ops import logs

    with logs.held() as early:  # written in the log's format, once the options say which
        try:
            config = build_config(args, os.environ)
            check_store(config)
        except ConfigError as exc:
            for record in early:
                print(f"mmserver: {record.getMessage()}", file=sys.stderr)
            print(f"mmserver: {exc.message}", file=sys.stderr)
            return 2

    from mmserver import server  # only here: the CLI must work without starting anything

    return server.run(config, early)


def _example_store(directory: Path) -> int:
    from mmserver.commands.examples import write_examples  # trains the models: only when asked

    try:
        names = write_examples(directory)
    except OSError as exc:
        print(f"mmserver: cannot write the examples into {directory}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(names)} into {directory}")
    print(f"serve them with: mmserver serve --model-store {directory}")
    print(
        "custom-handler runs its own code: it loads on a server that trusts it "
        "(--trusted-models custom-handler)"
    )
    return 0
