"""``scripts/hostile``: run the cases of every module of :mod:`hostilelib` against ``--url``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import pkgutil
import sys

import hostilelib
from hostilelib import Case


def cases() -> dict[str, Case]:
    found: dict[str, Case] = {}
    for module in pkgutil.iter_modules(hostilelib.__path__):
        if not module.name.startswith("_"):
            found.update(importlib.import_module(f"hostilelib.{module.name}").CASES)
    return found


def main() -> int:
    known = cases()
    parser = argparse.ArgumentParser(
        prog="scripts/hostile", description="Replay hostile clients against a running mmserver."
    )
    parser.add_argument("cases", nargs="*", metavar="CASE", help="cases to run (default: all)")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server (loopback)")
    parser.add_argument("--store", default="", help="the server's store folder (archive cases)")
    parser.add_argument(
        "--connections", type=int, default=300, help="most connections a case opens (default 300)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="most seconds a case waits for one answer (default 30)",
    )
    parser.add_argument("--list", action="store_true", help="name the cases and stop")
    args = parser.parse_args()
    if args.list:
        for name, case in known.items():
            print(f"{name:<16} {case.description}")
        return 0
    host = args.url.split("//", 1)[-1].split(":", 1)[0].split("/", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]"):
        parser.error("--url must be a loopback address")
    if not 1 <= args.connections <= 5000 or not 0 < args.seconds <= 600:
        parser.error("--connections must be 1-5000 and --seconds 0-600")
    unknown = [c for c in args.cases if c not in known]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; --list names them")
    failed = 0
    for name in args.cases or list(known):
        verdict = asyncio.run(known[name].run(args))
        failed += not verdict.held
        print(f"{'HELD' if verdict.held else 'FAILED':<7} {name:<16} {verdict.what}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
