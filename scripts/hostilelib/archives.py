"""Hostile archives and management calls: header bombs written into the server's store, a model
whose exception text is huge, worker counts in the billions, a store entry linking out."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import io
import json
import tarfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from hostilelib import Case, Verdict
from hostilelib.http import ping


async def _call(
    args: argparse.Namespace, method: str, path: str, body: bytes = b""
) -> tuple[int, bytes, float]:
    url = urlsplit(args.url)
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    try:
        answer = await asyncio.wait_for(reader.read(), args.seconds)
    except (TimeoutError, ConnectionError):
        answer = b""  # no answer in time
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.") else 0
    return status, payload, time.monotonic() - started


def _store(args: argparse.Namespace) -> Path | None:
    """The server's store folder, where the case writes its model (``None``: not given)."""
    return Path(args.store) if args.store else None


SKIPPED = Verdict(True, "skipped: this case writes into the server's store (--store DIR)")


def _header_bomb(path: Path, pax: bool) -> None:
    raw = io.BytesIO()
    with tarfile.open(
        fileobj=raw, mode="w", format=tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT
    ) as tar:
        info = tarfile.TarInfo("model.joblib" if pax else "x" * 300_000_000)
        if pax:
            info.pax_headers = {"comment": "y" * 300_000_000}
        tar.addfile(info, io.BytesIO(b""))
    path.write_bytes(gzip.compress(raw.getvalue(), 9))


async def _bomb(args: argparse.Namespace, pax: bool) -> Verdict:
    store = _store(args)
    if store is None:
        return SKIPPED
    name = f"hostile-{'pax' if pax else 'longname'}-bomb"
    archive = store / f"{name}.tar.gz"
    await asyncio.to_thread(_header_bomb, archive, pax)
    size = archive.stat().st_size
    try:
        status, body, took = await _call(args, "POST", f"/predictions/{name}", b"[[0.5]]")
    finally:
        archive.unlink(missing_ok=True)
    alive, _ = await ping(args)
    return Verdict(
        status == 500 and len(body) < 4096 and alive == 200,
        f"a {size // 1024} KiB archive declaring a 300 MB header: answered {status} "
        f"({len(body)} bytes) in {took * 1000:.0f} ms; /ping {alive}",
    )


async def longname_bomb(args: argparse.Namespace) -> Verdict:
    return await _bomb(args, pax=False)


async def pax_bomb(args: argparse.Namespace) -> Verdict:
    return await _bomb(args, pax=True)


async def huge_error(args: argparse.Namespace) -> Verdict:
    """A model whose predict raises a 5 MB message."""
    store = _store(args)
    if store is None:
        return SKIPPED
    folder = store / "hostile-huge-error"
    folder.mkdir(exist_ok=True)
    (folder / "model.py").write_text(
        "def load(model_dir, properties):\n    return None\n\n"
        "def predict(model, batch):\n    raise ValueError('v' * 5_000_000)\n"
    )
    try:
        status, body, _ = await _call(args, "POST", "/predictions/hostile-huge-error", b"[[0.5]]")
        await _call(args, "DELETE", "/models/hostile-huge-error")
    finally:
        for item in folder.iterdir():
            item.unlink()
        folder.rmdir()
    return Verdict(
        status == 424 and len(body) < 16384, f"answered {status} with a {len(body)}-byte body"
    )


async def billion_workers(args: argparse.Namespace) -> Verdict:
    """``PUT /models/sklearn-0?min_worker=1000000000&max_worker=1000000000``."""
    status, body, took = await _call(
        args, "PUT", "/models/sklearn-0?min_worker=1000000000&max_worker=1000000000"
    )
    alive, ping_s = await ping(args)
    message = json.loads(body or b"{}").get("message", "")[:120] if body.startswith(b"{") else ""
    return Verdict(
        status == 400 and alive == 200 and ping_s < 1.0,
        f"answered {status} in {took * 1000:.0f} ms ({message}); /ping {alive}",
    )


async def link_out(args: argparse.Namespace) -> Verdict:
    """A store entry that is a symbolic link to a folder outside the store."""
    store = _store(args)
    if store is None:
        return SKIPPED
    link = store / "hostile-link-out"
    link.unlink(missing_ok=True)
    link.symlink_to("/etc")
    try:
        status, _, _ = await _call(args, "POST", "/predictions/hostile-link-out", b"[[0.5]]")
    finally:
        link.unlink()
    return Verdict(status == 403, f"answered {status}")


CASES = {
    "longname-bomb": Case("an archive declaring a 300 MB GNU long name (--store)", longname_bomb),
    "pax-bomb": Case("an archive declaring a 300 MB pax header (--store)", pax_bomb),
    "huge-error": Case("a model raising a 5 MB message: a bounded answer (--store)", huge_error),
    "billion-workers": Case("PUT min/max_worker=1e9: 400 naming the limit", billion_workers),
    "link-out": Case("a store entry linking to /etc: 403 (--store)", link_out),
}
