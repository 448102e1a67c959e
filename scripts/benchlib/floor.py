"""The HTTP floor: a bare aiohttp server on uvloop answering ``{"predictions": [2.0]}`` (and a
fixed V2 answer on ``/v2/models/{model}/infer``).

It serves mmserver's inference paths through aiohttp's web framework (router, request and
response objects) and reads each request's body, but decodes nothing and runs no model: what a
server built on that framework answers on this machine with nothing behind it. (mmserver answers
plain inference requests below that framework, so it can pass this floor.)

Usage: python floor.py --port PORT [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

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


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, set up as mmserver sets up its listener."""
    runner = web.AppRunner(make_app(), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024, reuse_address=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
