"""What the client's checks of every reply cost a learner: sample(256) of a 4-field
schema over gRPC from a daemon running in this process, with the checks and without
(``GrpcTransport._checked`` made a pass-through), turn after turn; and the check alone.

    PYTHONPATH=client:server python bench/reply_checks.py [--turns 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

import millpond
from millpond.remote import grpc_transport
from millpond.remote.grpc_transport import GrpcTransport
from millpond_server.operations import Operations
from millpond_server.registry import Registry
from millpond_server.service import ReplayService, add_to_server

FIELDS = {"obs": ("float32", (8,)), "actions": ("float32", (2,)), "rewards": ("float32", ()),
          "done": ("bool", ())}
BATCH = 256


def in_process_daemon(data_dir: Path, interceptors: list | None = None) -> str:
    """A daemon's gRPC service on a thread of this process (its own event loop), behind
    ``interceptors`` if given; its address."""
    started: dict[str, str] = {}
    ready = threading.Event()

    async def run() -> None:
        ops = Operations(Registry(data_dir), ThreadPoolExecutor(4))
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        server = grpc.aio.server(interceptors=interceptors)
        add_to_server(ReplayService(ops, 64), server)
        started["address"] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        ready.set()
        await server.wait_for_termination()

    threading.Thread(target=asyncio.run, args=(run(),), daemon=True).start()
    ready.wait(30)
    return started["address"]


def p50_us(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        address = in_process_daemon(Path(tmp))
        buf = millpond.connect(address, shm=False).create_buffer(
            "bench", capacity=100_000, fields=FIELDS)
        rng = np.random.default_rng(0)
        buf.push_batch(obs=rng.random((10_000, 8), np.float32),
                       actions=rng.random((10_000, 2), np.float32),
                       rewards=rng.random(10_000, np.float32), done=rng.random(10_000) < 0.01)
        checked = GrpcTransport._checked

        def unchecked(self, columns, specs, what):
            return columns

        sample = lambda: buf.sample(BATCH)  # noqa: E731
        for _ in range(200):  # warm up
            sample()
        on, off = [], []
        for _ in range(args.turns):
            GrpcTransport._checked = checked  # type: ignore[method-assign]
            on.append(p50_us(sample, args.calls))
            GrpcTransport._checked = unchecked  # type: ignore[method-assign]
            off.append(p50_us(sample, args.calls))
        GrpcTransport._checked = checked  # type: ignore[method-assign]

        transport = buf.backend.client.connection.grpc
        reply = buf.sample(BATCH)
        specs = grpc_transport._sample_specs(buf.backend.schema, BATCH, False)
        alone = min(timeit.repeat(lambda: transport._checked(reply, specs, "sample(256)"),
                                  number=10_000, repeat=5)) / 10_000 * 1e6
        with_specs = min(timeit.repeat(
            lambda: transport._checked(reply, grpc_transport._sample_specs(
                buf.backend.schema, BATCH, False), "sample(256)"),
            number=10_000, repeat=5)) / 10_000 * 1e6
    on_p50, off_p50 = statistics.median(on), statistics.median(off)
    print(f"sample({BATCH}) of {len(FIELDS)} fields over gRPC, in-process daemon, p50 of "
          f"{args.calls} calls, median of {args.turns} turns:")
    print(f"  with checks    {on_p50:7.1f} us   (turns: {', '.join(f'{t:.0f}' for t in on)})")
    print(f"  without checks {off_p50:7.1f} us   (turns: {', '.join(f'{t:.0f}' for t in off)})")
    print(f"  ratio {on_p50 / off_p50:.3f}")
    print(f"  the check alone: {alone:.2f} us ({with_specs:.2f} us with its cached specs "
          "looked up)")


if __name__ == "__main__":
    main()
