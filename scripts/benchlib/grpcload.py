"""The gRPC section: V2 over gRPC beside V2 REST on the same models, and beside MLServer's gRPC.

The load generator (wrk speaks HTTP/1.1 only): ``load.threads`` worker processes, each one
``grpc.aio`` channel (one HTTP/2 connection) to a loopback address with
``load.connections / load.threads`` calls in flight, each sending its next ``ModelInfer`` as
soon as the previous one is answered (closed loop). Every call is one of ``load.models``
prebuilt messages (the model ``sklearn-K`` and the rows of ``load.body`` as one FP64 tensor in
``raw_input_contents``), picked by the pattern as ``load.lua`` picks wrk's; calls are sent and
answers taken as bytes, so the client does no protobuf work per call. A worker stops after
``load.duration_s`` or :data:`MAX_CALLS` calls, whichever comes first; the benchmark kills a
worker that has not reported ``_GRACE_S`` seconds after that.

A Python client costs more CPU per call than wrk, and shares the cores with the server: the
gRPC rows are comparable with each other (mmserver's and MLServer's), and with the REST row
only together with the ``client`` CPU column.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import ipaddress
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from proctools import HOST

from benchlib import report
from benchlib.loads import Log, Settings, describe_run, rotated
from benchlib.servers import Server
from mmserver.commands.loadtest import wrk

#: The most calls one worker sends in a run.
MAX_CALLS = 2_000_000
CALL_TIMEOUT_S = 5.0
_GRACE_S = 30.0
_METHOD = "/inference.GRPCInferenceService/ModelInfer"
#: The rows of the benchmark's cases, as the load's section (grpc) names them.
ROWS = ("mmserver v2 rest", "mmserver grpc", "mlserver grpc")


def picker(pattern: str, models: int, rng: random.Random, hot: float = 0.9) -> Callable[[], int]:
    """The index of each call's model, as ``load.lua`` picks them (``uniform``, ``hot``: 90 %
    to the first model, ``zipf``: s = 1.1, ``single``)."""
    if pattern == "single":
        return lambda: 0
    if pattern == "uniform":
        return lambda: rng.randrange(models)
    if pattern == "hot":
        return lambda: 0 if rng.random() < hot else rng.randrange(1, models)
    if pattern == "zipf":
        weights = [1 / k**1.1 for k in range(1, models + 1)]
        total = sum(weights)
        cdf, acc = [], 0.0
        for weight in weights:
            acc += weight / total
            cdf.append(acc)
        cdf[-1] = 1.0
        return lambda: bisect.bisect_left(cdf, rng.random())
    raise ValueError(f"pattern {pattern!r} is not uniform, hot, zipf or single")


def infer_message(model: str, rows: list[list[float]]) -> bytes:
    """The serialized ``ModelInferRequest`` of ``rows`` for ``model``: one FP64 tensor."""
    import numpy as np

    from mmserver.api.grpc.proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="input-0", datatype="FP64", shape=[len(rows), len(rows[0])])
    request.raw_input_contents.append(np.array(rows, dtype="<f8").tobytes())
    return request.SerializeToString()


async def _calls(args: argparse.Namespace) -> dict[str, Any]:
    """One worker's run: the latencies (µs) of its answered calls and its errors by status."""
    import grpc
    from grpc import aio

    host = args.target.rpartition(":")[0].strip("[]")
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"grpcload: {args.target} is not a loopback address")
    rows = json.loads(args.body)
    messages = [infer_message(f"sklearn-{i}", rows) for i in range(args.models)]
    pick = picker(args.pattern, args.models, random.Random(args.seed))
    latencies: list[int] = []
    errors: dict[str, int] = {}
    sent = 0
    async with aio.insecure_channel(args.target) as channel:
        call = channel.unary_unary(_METHOD)  # bytes in, bytes out
        await channel.channel_ready()
        end = time.perf_counter() + args.duration

        async def stream() -> None:
            nonlocal sent
            while sent < MAX_CALLS:
                started = time.perf_counter()
                if started >= end:
                    return
                sent += 1
                try:
                    await call(messages[pick()], timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                latencies.append(round((time.perf_counter() - started) * 1e6))

        began = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(args.streams)))
        elapsed = time.perf_counter() - began
    return {"latencies_us": latencies, "errors": errors, "seconds": elapsed}


def _command(load: wrk.Load, streams: int, seed: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchlib.grpcload",
        "--target",
        load.url,
        "--pattern",
        load.pattern,
        "--models",
        str(load.models),
        "--duration",
        str(load.duration_s),
        "--streams",
        str(streams),
        "--seed",
        str(seed),
        "--body",
        load.body,
    ]


def execute(load: wrk.Load) -> wrk.WrkResult:
    """Run ``load`` (its ``url`` a ``host:port`` gRPC target) with the worker processes and
    merge what they measured; the form of a wrk run's result."""
    streams = max(1, load.connections // load.threads)
    procs = [
        subprocess.Popen(
            _command(load, streams, load.seed * 1000 + k),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(load.threads)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=load.duration_s + _GRACE_S)
            if proc.returncode != 0:
                raise RuntimeError(f"grpcload worker exited with {proc.returncode}:\n{err[-2000:]}")
            outputs.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    latencies: list[int] = sorted(int(v) for o in outputs for v in o["latencies_us"])
    errors: dict[str, int] = {}
    for output in outputs:
        for code, n in output["errors"].items():
            errors[code] = errors.get(code, 0) + n
    seconds = max(o["seconds"] for o in outputs)

    def quantile(q: float) -> float:
        if not latencies:
            return 0.0
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1e3

    return wrk.WrkResult(
        requests=len(latencies),
        duration_s=seconds,
        rps=len(latencies) / seconds if seconds else 0.0,
        p50_ms=quantile(0.5),
        p90_ms=quantile(0.9),
        p99_ms=quantile(0.99),
        p999_ms=quantile(0.999),
        max_ms=latencies[-1] / 1e3 if latencies else 0.0,
        mean_ms=sum(latencies) / len(latencies) / 1e3 if latencies else 0.0,
        errors=errors,
    )


def section(
    server: Server, peer: Server | None, patterns: list[str], settings: Settings, log: Log
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The section's runs: per pattern, V2 REST (wrk) and V2 gRPC against mmserver, and with a
    peer its gRPC, in an order that rotates from run to run; every result by row."""
    cases: list[tuple[str, Server, wrk.Load]] = []
    for pattern in patterns:
        rest = wrk.Load(
            url=server.url,
            pattern=pattern,
            duration_s=settings.duration_s,
            connections=settings.concurrency,
            threads=settings.threads,
            api="v2",
        )
        cases.append(("mmserver v2 rest", server, rest))
        cases.append(("mmserver grpc", server, replace(rest, url=f"{HOST}:{server.grpc_port}")))
        if peer is not None:
            cases.append(("mlserver grpc", peer, replace(rest, url=f"{HOST}:{peer.grpc_port}")))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in range(settings.runs):
        for pattern in patterns:
            chosen = [c for c in cases if c[2].pattern == pattern]
            for name, target, load in rotated(chosen, run):
                grpc_load = name.endswith("grpc")
                result = wrk.run(
                    load,
                    target.pid,
                    settings.quiet_wait_s,
                    execute=execute if grpc_load else None,
                )
                log(describe_run(name.replace("mmserver ", "").replace(" ", "-")[:8], load, result))
                results.setdefault(pattern, {}).setdefault(name, []).append(result.to_json())
    return results


def summary_lines(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """The section's lines of the table: medians per pattern and row, and the ratios."""
    lines = [
        "",
        "gRPC (closed loop; REST by wrk, gRPC by benchlib/grpcload.py's Python client; "
        "client = CPU % of the load generator)",
        f"  {'pattern':<8} {'row':<17} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'server %':>9} {'client %':>9}  errors",
    ]
    for pattern, rows in raw.items():
        medians = {name: report.summarize_runs(runs) for name, runs in rows.items()}
        for name in ROWS:
            if name not in medians:
                continue
            m = medians[name]
            cpu = m["cpu"]
            server = (cpu.get("server") or 0.0) + (cpu.get("server_children") or 0.0)
            lines.append(
                f"  {pattern:<8} {name:<17} {m['rps'] or 0:8.0f} {m['p50_ms'] or 0:7.2f} "
                f"{m['p99_ms'] or 0:7.2f} {server:9.0f} {cpu.get('wrk') or 0:9.0f}  "
                f"{m['error_count']}"
            )
        ratios = []
        rps = {name: medians[name]["rps"] or 0.0 for name in medians}
        if rps.get("mmserver v2 rest") and "mmserver grpc" in rps:
            ratios.append(f"grpc / rest {rps['mmserver grpc'] / rps['mmserver v2 rest']:.2f}x")
        if rps.get("mlserver grpc") and "mmserver grpc" in rps:
            ratios.append(
                f"mmserver grpc / mlserver grpc {rps['mmserver grpc'] / rps['mlserver grpc']:.2f}x"
            )
        if ratios:
            lines.append(f"  {pattern:<8} {'; '.join(ratios)}")
    return lines


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchlib.grpcload")
    parser.add_argument("--target", required=True, help="host:port, a loopback address")
    parser.add_argument("--pattern", default="uniform")
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--streams", type=int, default=16, help="calls in flight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--body", default="[[0.5]]", help="the rows of every call")
    print(json.dumps(asyncio.run(_calls(parser.parse_args()))))


if __name__ == "__main__":
    _main()
