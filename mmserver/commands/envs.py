"""``mmserver envs build``: build, ahead of time, every model environment a store needs (for an
image or a CI cache), as the server would build them on first load: each distinct requirement
set the server's own environment does not meet, once, under the server's ``env_dir``. A server
started later with the same ``env_dir`` finds them and builds nothing.

It builds with what the server would (``env_installer``: uv where it is installed, else pip;
``MMSERVER_ENV_INSTALLER`` is read). The store's models are listed and their archives unpacked
as the server does; their ``requirements.txt`` (and MLflow's ``python_env.yaml``) are read. A
pickle that needs an environment only because of ``on_version_skew=env`` is built on its first
load, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from mmserver.config.server import ServerConfig
from mmserver.envs import building
from mmserver.envs.requirements import RequirementSet, read_folder, unmet
from mmserver.errors import MMServerError
from mmserver.opening import open_store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserver envs",
        description="Model environments: build those a model store needs ahead of time.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    build = commands.add_parser(
        "build",
        help="build every environment the store's models need",
        description=(
            "Build the environment of every distinct requirement set the models of the store "
            "ask for (requirements.txt, MLflow's python_env.yaml) and the server's own "
            "environment does not meet, into env_dir; those built already are kept."
        ),
    )
    build.add_argument("--model-store", required=True, metavar="DIR", help="the model store")
    build.add_argument(
        "--env-dir", default="", metavar="DIR", help="where to build (default: as the server)"
    )
    build.add_argument("--cache-dir", default="", metavar="DIR", help="where archives are unpacked")
    build.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="seconds per build at most"
    )
    return parser


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        config = ServerConfig.build(
            env=os.environ,
            flags={
                "model_store": args.model_store,
                "env_dir": args.env_dir or None,
                "cache_dir": args.cache_dir or None,
            },
        )
        sets = needed_sets(config, out)
    except MMServerError as exc:
        print(f"mmserver envs: {exc.message}", file=sys.stderr)
        return 2
    folder = config.env_path(config.cache_path)
    return asyncio.run(_build_all(sets, folder, args.timeout, config.env_uv, out))


def needed_sets(config: ServerConfig, out: TextIO) -> dict[RequirementSet, list[str]]:
    """The requirement sets the store's models ask for that the server does not meet, each
    with the models asking for it."""
    store = open_store(config)
    sets: dict[RequirementSet, list[str]] = {}
    entries = store.list()
    for entry in entries:
        names = [f"{entry.name}/{v}" for v in entry.versions] if entry.versions else [entry.name]
        for name in names:
            found = store.find(name) if entry.versions else entry
            if found is None:
                continue
            try:
                wanted = read_folder(store.prepare(found))
            except MMServerError as exc:
                print(f"{name}: skipped: {exc.message}", file=out)
                continue
            if wanted is not None and unmet(wanted.requirements):
                sets.setdefault(wanted, []).append(name)
    print(
        f"{len(entries)} model(s) in {config.model_store}: {len(sets)} environment(s) needed",
        file=out,
    )
    return sets


async def _build_all(
    sets: dict[RequirementSet, list[str]],
    folder: Path,
    timeout: float,
    uv: str | None,
    out: TextIO,
) -> int:
    failed = 0
    for number, (wanted, models) in enumerate(sets.items(), 1):
        head = f"[{number}/{len(sets)}] {wanted.key} ({', '.join(wanted.requirements)})"
        target = folder / wanted.key
        if building.read_manifest(target) is not None:
            print(f"{head}: built already, for {', '.join(models)}", file=out, flush=True)
            continue
        print(f"{head}: building for {', '.join(models)} ...", file=out, flush=True)
        started = time.perf_counter()
        try:
            built = await building.build(wanted, target, timeout, uv)
        except building.BuildFailed as exc:
            failed += 1
            print(f"{head}: FAILED: {', '.join(exc.packages)}: {exc.line}", file=out, flush=True)
            continue
        except TimeoutError:
            failed += 1
            print(f"{head}: FAILED: not built within {timeout:g} s", file=out, flush=True)
            continue
        seconds = time.perf_counter() - started
        print(f"{head}: built with {built.tool} in {seconds:.1f} s", file=out, flush=True)
    return 1 if failed else 0
