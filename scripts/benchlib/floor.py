"""The HTTP floors: servers on uvloop answering ``{"predictions": [2.0]}`` (and a fixed V2
answer on ``/v2/models/{model}/infer``) with nothing behind them.

- ``aiohttp`` (the default): mmserver's inference paths through aiohttp's web framework (router,
  request and response objects), each request's body read, nothing decoded, no model run: what a
  server built on that framework answers on this machine. (mmserver answers plain inference
  requests below that framework, so it can pass this floor.)
- ``raw`` (``--raw``): an :class:`asyncio.Protocol` on httptools (llhttp, one parser per
  connection) writing a fixed answer for each request: what one Python process on uvloop can
  answer at all, the limit mmserver's frontend is measured against.

Usage: python floor.py --port PORT [--host 127.0.0.1] [--raw]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from typing import cast

import httptools
import uvloop
from aiohttp import web

ANSWER = b'{"predictions": [2.0]}'
V2_ANSWER = (
    b'{"model_name": "m", "model_version": "1", "outputs": [{"name": "predict", '
    b'"datatype": "FP64", "shape": [1], "data": [2.0]}]}'
)


async def predict(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


async def infer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=V2_ANSWER, content_type="application/json")


async def ping(_: web.Request) -> web.Response:
    return web.json_response({"status": "Healthy"})


def make_app() -> web.Application:
    app = web.Application()
    app.add_routes(
        [
            web.get("/ping", ping),
            web.post("/predictions/{model}", predict),
            web.post("/invocations", predict),
            web.post("/endpoints/{endpoint}/invocations", predict),
            web.post("/models/{model}/invoke", predict),
            web.post("/v2/models/{model}/infer", infer),
        ]
    )
    return app


def _fixed(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Server: floor\r\n\r\n%s" % (len(body), body)
    )


_RAW_ANSWER = _fixed(ANSWER)
_RAW_V2_ANSWER = _fixed(V2_ANSWER)
_RAW_PING = _fixed(b'{"status": "Healthy"}')
_RAW_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class RawFloor(asyncio.Protocol):
    """One connection of the raw floor: each whole request (pipelined ones in order) gets the
    fixed answer its path picks; one llhttp refuses gets 400 and the connection closes."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer = _RAW_ANSWER

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_RAW_BAD)
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        if url.startswith(b"/v2/"):
            self.answer = _RAW_V2_ANSWER
        elif url == b"/ping":
            self.answer = _RAW_PING
        else:
            self.answer = _RAW_ANSWER

    def on_message_complete(self) -> None:
        if self.transport is not None:
            self.transport.write(self.answer)


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, set up as mmserver sets up its listener."""
    runner = web.AppRunner(make_app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024, reuse_address=True).start()
    try:
        await _until_signalled()
    finally:
        await runner.cleanup()


async def serve_raw(host: str, port: int) -> None:
    """The raw floor until SIGTERM or SIGINT, listening as :func:`serve` does."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(RawFloor, host, port, backlog=1024, reuse_address=True)
    try:
        await _until_signalled()
    finally:
        server.close()
        await server.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--raw", action="store_true", help="the raw floor: a protocol on httptools, no framework"
    )
    args = parser.parse_args()
    uvloop.run((serve_raw if args.raw else serve)(args.host, args.port))


if __name__ == "__main__":
    main()
