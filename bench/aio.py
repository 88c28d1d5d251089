"""millpond.aio beside the sync client: the same calls to the same daemon in the same run,
turn after turn; calls per second of each, and their ratio (median over turns, and the
range).

    PYTHONPATH=client:server python bench/aio.py [--turns 5] [--seconds 1] [--uvloop]

Rows: ``sample(256)`` of a CartPole record (42 bytes: 10.8 KB a call, on gRPC streams
whatever the transport) and ``sample(32)`` of an Atari one (56 KB: 1.8 MB a call, through
shared memory on the client's threads when it may), by one caller and by four (threads
for the sync client, tasks for aio), and with prefetch (``sampler`` / ``samples``);
``push_batch(1000)`` of CartPole records. Beside them, what millpond.aio chose not to do:
unary calls only (no streams), every call on a thread (``asyncio.to_thread`` of the sync
client's calls), and large calls over gRPC (``shm=False``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import ServerProcess  # noqa: E402

import millpond  # noqa: E402
import millpond.aio  # noqa: E402
from millpond.remote import aio_transport  # noqa: E402

CARTPOLE = {"obs": ("float32", (4,)), "next_obs": ("float32", (4,)), "actions": ("float32", (1,)),
            "rewards": ("float32", ()), "terminated": ("bool", ()), "truncated": ("bool", ())}
ATARI = {"obs": ("uint8", (84, 84, 4)), "next_obs": ("uint8", (84, 84, 4)),
         "actions": ("int64", ()), "rewards": ("float32", ()), "terminated": ("bool", ()),
         "truncated": ("bool", ())}
CALLERS = 4


def columns(fields: dict, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, (dtype, shape) in fields.items():
        if dtype == "uint8":
            out[name] = rng.integers(0, 256, (n, *shape), np.uint8)
        elif dtype == "bool":
            out[name] = rng.random(n) < 0.01
        else:
            out[name] = rng.random((n, *shape)).astype(dtype)
    return out


def sync_rate(call: Callable[[], Any], seconds: float, callers: int = 1) -> float:
    """Calls per second of ``call`` made back to back by ``callers`` threads."""
    call()
    done = [0] * callers
    end = time.perf_counter() + seconds

    def caller(i: int) -> None:
        while time.perf_counter() < end:
            call()
            done[i] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)


async def aio_rate(call: Callable[[], Awaitable[Any]], seconds: float, callers: int = 1) -> float:
    """Calls per second of ``await call()`` made back to back by ``callers`` tasks."""
    await call()
    done = 0
    end = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return done / (time.perf_counter() - start)


def sync_iterated(buf: Any, batch_size: int, seconds: float) -> float:
    with buf.sampler(batch_size, prefetch=CALLERS) as batches:
        next(batches)
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            next(batches)
            done += 1
    return done / (time.perf_counter() - start)


async def aio_iterated(buf: Any, batch_size: int, seconds: float) -> float:
    async with buf.samples(batch_size, prefetch=CALLERS) as batches:
        await anext(batches)
        done, start = 0, time.perf_counter()
        async for _ in batches:
            done += 1
            if time.perf_counter() - start >= seconds:
                break
    return done / (time.perf_counter() - start)


async def unary_only(call: Callable[[], Awaitable[Any]], seconds: float) -> float:
    """``aio_rate`` with every call unary (no message may go on a stream)."""
    streamed = aio_transport.STREAMED_MAX_BYTES
    aio_transport.STREAMED_MAX_BYTES = -1
    try:
        return await aio_rate(call, seconds)
    finally:
        aio_transport.STREAMED_MAX_BYTES = streamed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    parser.add_argument("--uvloop", action="store_true", help="run the event loop on uvloop")
    args = parser.parse_args()
    loop_factory = None
    if args.uvloop:
        import uvloop
        loop_factory = uvloop.new_event_loop
    rng = np.random.default_rng(0)
    seconds = args.seconds
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(Path(tmp) / "data") as server, \
            asyncio.Runner(loop_factory=loop_factory) as runner:
        sync_grpc = millpond.connect(server.address, shm=False)
        sync_shm = millpond.connect(server.address, shm=True)
        aio_auto = runner.run(millpond.aio.connect(server.address))  # the default: shm="auto"
        aio_grpc = runner.run(millpond.aio.connect(server.address, shm=False))
        runner.get_loop().set_default_executor(ThreadPoolExecutor(CALLERS))  # to_thread's
        rows: dict[str, list[tuple[float, float]]] = {}  # label: (first, second) per turn

        def row(label: str, first: Callable[[], Awaitable[float]],
                second: Callable[[], Awaitable[float] | float]) -> None:
            a = runner.run(first())
            b = second()
            rows.setdefault(label, []).append((a, b if isinstance(b, float) else runner.run(b)))

        buffers = {}
        for label, fields, n, batch in (("CartPole", CARTPOLE, 10_000, 256),
                                        ("Atari", ATARI, 1_000, 32)):
            made = sync_grpc.create_buffer(f"bench-{label.lower()}", capacity=n, fields=fields)
            made.push_batch(**columns(fields, n, rng))
            name = made.backend.name
            buffers[label] = (made, sync_shm.buffer(name), runner.run(aio_auto.buffer(name)),
                              runner.run(aio_grpc.buffer(name)), batch)
        push = columns(CARTPOLE, 1_000, rng)
        pushed = sync_grpc.create_buffer("bench-push", capacity=100_000, fields=CARTPOLE)
        apushed = runner.run(aio_auto.buffer("bench-push"))
        print(f"millpond.aio beside the sync client; {os.cpu_count()} cores; "
              f"{'uvloop' if args.uvloop else 'asyncio'} loop; {args.turns} turns of "
              f"{seconds} s per figure; sample(256) of CartPole moves 10.8 KB, sample(32) of "
              "Atari 1.8 MB\n")
        for _ in range(args.turns):
            sync, shm, auto, grpc_only, batch = buffers["CartPole"]
            call = f"CartPole sample({batch})"
            row(f"{call}, 1 caller: aio / sync gRPC",
                lambda: aio_rate(lambda: auto.sample(batch), seconds),
                lambda: sync_rate(lambda: sync.sample(batch), seconds))
            row(f"{call}, {CALLERS} callers: aio tasks / sync threads",
                lambda: aio_rate(lambda: auto.sample(batch), seconds, CALLERS),
                lambda: sync_rate(lambda: sync.sample(batch), seconds, CALLERS))
            row(f"{call}, prefetch {CALLERS}: aio samples() / sync sampler()",
                lambda: aio_iterated(auto, batch, seconds),
                lambda: sync_iterated(sync, batch, seconds))
            row(f"{call}, 1 caller: aio unary calls only / aio",
                lambda: unary_only(lambda: auto.sample(batch), seconds),
                lambda: aio_rate(lambda: auto.sample(batch), seconds))
            row(f"{call}, 1 caller: aio / sync shared memory",
                lambda: aio_rate(lambda: auto.sample(batch), seconds),
                lambda: sync_rate(lambda: shm.sample(batch), seconds))
            row(f"{call}, 1 caller: to_thread(sync shm) / aio",
                lambda: aio_rate(lambda: asyncio.to_thread(shm.sample, batch), seconds),
                lambda: aio_rate(lambda: auto.sample(batch), seconds))
            row(f"{call}, {CALLERS} callers: to_thread(sync shm) / aio",
                lambda: aio_rate(lambda: asyncio.to_thread(shm.sample, batch), seconds, CALLERS),
                lambda: aio_rate(lambda: auto.sample(batch), seconds, CALLERS))
            sync, shm, auto, grpc_only, batch = buffers["Atari"]
            call = f"Atari sample({batch})"
            row(f"{call}, 1 caller: aio (fast path on a thread) / sync shm",
                lambda: aio_rate(lambda: auto.sample(batch), seconds),
                lambda: sync_rate(lambda: shm.sample(batch), seconds))
            row(f"{call}, {CALLERS} callers: aio (fast path) / sync shm",
                lambda: aio_rate(lambda: auto.sample(batch), seconds, CALLERS),
                lambda: sync_rate(lambda: shm.sample(batch), seconds, CALLERS))
            row(f"{call}, prefetch {CALLERS}: aio samples() / sync sampler() (shm)",
                lambda: aio_iterated(auto, batch, seconds),
                lambda: sync_iterated(shm, batch, seconds))
            row(f"{call}, 1 caller: aio shm=False / sync gRPC",
                lambda: aio_rate(lambda: grpc_only.sample(batch), seconds),
                lambda: sync_rate(lambda: sync.sample(batch), seconds))
            row(f"{call}, 1 caller: aio (fast path) / aio shm=False",
                lambda: aio_rate(lambda: auto.sample(batch), seconds),
                lambda: aio_rate(lambda: grpc_only.sample(batch), seconds))
            row("CartPole push_batch(1000), 1 caller: aio / sync gRPC",
                lambda: aio_rate(lambda: apushed.push_batch(**push), seconds),
                lambda: sync_rate(lambda: pushed.push_batch(**push), seconds))
        print(f"{'':66s} {'calls/s':>17s}  {'ratio':>5s} (range)")
        for label, turns in rows.items():
            first = statistics.median(a for a, _ in turns)
            second = statistics.median(b for _, b in turns)
            ratios = [a / b for a, b in turns]
            print(f"{label:66s} {first:8.0f} {second:8.0f}  {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
        assert aio_auto.transport == "shm", aio_auto.shm_reason  # the Atari rows used it
        runner.run(aio_auto.close())
        runner.run(aio_grpc.close())
        for buf in (pushed, *(b[0] for b in buffers.values())):
            buf.close()


if __name__ == "__main__":
    main()
